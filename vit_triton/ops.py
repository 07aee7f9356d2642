"""The kernels as PyTorch operators (torch.library), with their backward registered for autograd.

Each launcher of vit_triton.kernels is registered as a custom op `vit_triton::<name>` with a fake
(meta) implementation that gives the output's shape, dtype and layout without running anything, and,
for the ops a model trains through, a backward (torch.library.register_autograd) whose kernels are custom ops
too. torch.compile then traces a vit-triton model, forward and backward, into one graph of these opaque calls (no
graph breaks on Triton's Python launcher), which it can place in a CUDA graph or compile into a larger model.

A call goes straight to its launcher where nothing is traced or differentiated: inference pays no dispatcher
(about 5-10 us a call, which an eager forward at small batch, 87 launches, would feel). It goes through the op
when torch.compile traces it. Where autograd must record it (grad mode on and an input that requires grad), or
under torch.autocast, whose dtype the floating inputs are first cast to (bf16 activations, a bf16 copy of each
fp32 weight, as autocast casts F.linear's inputs; the casts are differentiable, so fp32 master weights get fp32
gradients), an eager call goes through an autograd.Function over the op's own function, with the op's setup and
backward, whose backward calls the backward ops' functions directly (_apply, _call): the same kernels without the
dispatcher and the custom op's autograd wrapper, about a quarter of an eager training step's host time. A
frozen parameter (requires_grad False) gets no gradient, and its product costs no dW GEMM.

What each op saves for its backward is only what the backward cannot cheaply recompute: a linear's input (and,
with an activation, its pre-activation), LayerNorm's mean and rstd, attention's output and log-sum-exp (the
scores are recomputed from them). Those extra outputs are non-differentiable outputs of the ops. Two composite
ops fuse across layers: `mlp` (fc1 -> activation -> fc2: its backward applies the activation's derivative in
fc2's dX epilogue and recomputes fc2's input from fc1's pre-activation there, so the forward keeps only the
pre-activation), and `attention` over the packed QKV (or KV) output, whose backward writes the packed gradient.

ResidualStream is the one place where a model meets the small-batch plan of its residual GEMMs (split K,
with the sum left to the next LayerNorm); a block reads `x = x.add(proj, attn)`, `h = x.norm(norm2)`. Split K is
an inference plan: a stream that autograd records is never split.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import kernels
from .kernels import split_k


def _recorded(*tensors: Tensor | None) -> bool:
    """Whether autograd records a call on these tensors."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _via_op(*tensors: Tensor | None) -> bool:
    """Whether a call goes through the custom op (or, eager, its autograd.Function: _apply): traced, recorded by
    autograd, or under autocast."""
    return torch.compiler.is_compiling() or _recorded(*tensors) or _autocast_dtype(tensors[0]) is not None


def _autocast_dtype(t: Tensor) -> torch.dtype | None:
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def _cast(x: Tensor, *tensors: Tensor | None) -> list[Tensor | None]:
    """tensors in the autocast dtype where autocast is on (x decides the device), else as they are."""
    dtype = _autocast_dtype(x)
    if dtype is None:
        return list(tensors)
    return [t if t is None or t.dtype == dtype else t.to(dtype) for t in tensors]


_IMPLS: dict = {}       # each custom op's Python function
_FUNCTIONS: dict = {}   # each differentiable custom op's autograd.Function, for eager calls


def _custom_op(name: str):
    """torch.library.custom_op(name) (mutating nothing) as a decorator, the function kept for direct calls."""
    def register(fn):
        op = torch.library.custom_op(name, mutates_args=())(fn)
        _IMPLS[op] = fn
        return op
    return register


def _register_autograd(op, backward, setup) -> None:
    """op's backward: registered with the custom op, which torch.compile traces, and as an autograd.Function over
    op's function for eager calls (_apply), whose backward calls its kernels' functions directly (_call)."""
    op.register_autograd(backward, setup_context=setup)
    fn = _IMPLS[op]

    def forward(ctx, *inputs):   # with a setup_context instead, each apply would bind defaults (inspect)
        output = fn(*inputs)
        setup(ctx, inputs, output)
        ctx.eager = True
        return output

    _FUNCTIONS[op] = type(fn.__name__, (torch.autograd.Function,),
                          {"forward": staticmethod(forward), "backward": staticmethod(backward)})


def _apply(op, *args):
    """op(*args): through the custom op where torch.compile traces, else through its autograd.Function where
    autograd records the call (as the op's autograd does), else its function (autocast alone): the same kernels,
    without the dispatcher and the custom op's autograd wrapper."""
    if torch.compiler.is_compiling():
        return op(*args)
    if _recorded(*(a for a in args if isinstance(a, Tensor))):
        return _FUNCTIONS[op].apply(*args)
    return _IMPLS[op](*args)


def _call(ctx, op, *args):
    """A backward's kernel op: its function in the backward of an eager call (_apply), else the op (traced)."""
    if getattr(ctx, "eager", False) and not torch.compiler.is_compiling():
        return _IMPLS[op](*args)
    return op(*args)


def _needs(ctx, inputs: int) -> tuple[bool, ...]:
    """ctx.needs_input_grad for every one of an op's `inputs` positional inputs: the dispatcher drops the trailing
    ones passed at their defaults (None tensors, which need no gradient)."""
    return tuple(ctx.needs_input_grad) + (False,) * (inputs - len(ctx.needs_input_grad))


def _none(t: Tensor) -> Tensor | None:
    """The backward ops return an empty tensor for a gradient not asked for (an op's schema has no optional
    outputs); autograd takes None."""
    return None if t.numel() == 0 and t.dim() == 1 and t.shape[0] == 0 else t


def _empty(like: Tensor) -> Tensor:
    return like.new_empty(0)


def _out(t: Tensor | None, like: Tensor) -> Tensor:
    return _empty(like) if t is None else t


# ---------------------------------------------------------------------------------------------------- linear

@_custom_op("vit_triton::linear")
def _linear(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str, residual: Tensor | None,
            scale: float, tf32_input: bool, tf32_output: bool, cos: Tensor | None = None, sin: Tensor | None = None,
            rope_half: bool = False, rope_prefix: int = 0, col_scale: Tensor | None = None,
            row_scale: Tensor | None = None) -> Tensor:
    rope = None if cos is None else (cos, sin)
    return kernels.linear(x, weight, bias, activation=activation, residual=residual, scale=scale,
                          tf32_input=tf32_input, tf32_output=tf32_output, rope=rope, rope_half=rope_half,
                          rope_prefix=rope_prefix, col_scale=col_scale, row_scale=row_scale)


@_linear.register_fake
def _(x, weight, bias, activation, residual, scale, tf32_input, tf32_output, cos=None, sin=None, rope_half=False,
      rope_prefix=0, col_scale=None, row_scale=None):
    # swiglu: weight holds a gate's and a value's rows, two for each column of y
    return x.new_empty((x.shape[0], weight.shape[0] // 2 if activation == "swiglu" else weight.shape[0]))


def _linear_setup(ctx, inputs, output):
    (x, weight, bias, activation, residual, scale, _, _, cos, sin, rope_half, rope_prefix, col_scale,
     row_scale) = inputs
    if activation != "none":
        raise RuntimeError("vit_triton::linear with an activation has no backward: autograd records "
                           "vit_triton::linear_pre (ops.linear chooses it)")
    ctx.save_for_backward(x, weight, bias, col_scale, row_scale, cos, sin)
    ctx.scale, ctx.rope_half, ctx.rope_prefix = scale, rope_half, rope_prefix


def _linear_backward(ctx, dy):
    x, weight, bias, col_scale, row_scale, cos, sin = ctx.saved_tensors
    need = _needs(ctx, 14)
    dx, dweight, dbias, dcol = _linear_grads(ctx, dy, x, weight, bias, "none", None, ctx.scale, col_scale,
                                             row_scale, cos, sin, ctx.rope_half, ctx.rope_prefix, "none", None,
                                             [need[0], need[1], need[2], need[12]])
    dresidual = None
    if need[4]:
        dresidual = dy if ctx.scale == 1.0 else dy * ctx.scale
    return dx, dweight, dbias, None, dresidual, None, None, None, None, None, None, None, dcol, None


_register_autograd(_linear, _linear_backward, _linear_setup)


@_custom_op("vit_triton::linear_pre")
def _linear_pre(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str, tf32_input: bool,
                tf32_output: bool) -> tuple[Tensor, Tensor]:
    pre = x.new_empty((x.shape[0], weight.shape[0]))
    y = kernels.linear(x, weight, bias, activation=activation, tf32_input=tf32_input, tf32_output=tf32_output,
                       pre_out=pre)
    return y, pre


@_linear_pre.register_fake
def _(x, weight, bias, activation, tf32_input, tf32_output):
    n = weight.shape[0]
    return x.new_empty((x.shape[0], n // 2 if activation == "swiglu" else n)), x.new_empty((x.shape[0], n))


def _linear_pre_setup(ctx, inputs, output):
    x, weight, bias, activation, _, _ = inputs
    ctx.save_for_backward(x, weight, bias, output[1])
    ctx.activation = activation
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _linear_pre_backward(ctx, dy, _):
    x, weight, bias, pre = ctx.saved_tensors
    need = ctx.needs_input_grad
    dx, dweight, dbias, _ = _linear_grads(ctx, dy, x, weight, bias, ctx.activation, pre, 1.0, None, None, None, None,
                                          False, 0, "none", None, [need[0], need[1], need[2], False])
    return dx, dweight, dbias, None, None, None


_register_autograd(_linear_pre, _linear_pre_backward, _linear_pre_setup)


@_custom_op("vit_triton::mlp")
def _mlp(h: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None, activation: str,
         residual: Tensor | None, col_scale: Tensor | None, row_scale: Tensor | None,
         tf32_input: bool) -> tuple[Tensor, Tensor]:
    pre = h.new_empty((h.shape[0], w1.shape[0]))
    post = kernels.linear(h, w1, b1, activation=activation, tf32_input=tf32_input, tf32_output=True, pre_out=pre)
    y = kernels.linear(post, w2, b2, residual=residual, tf32_input=True, col_scale=col_scale, row_scale=row_scale)
    return y, pre


@_mlp.register_fake
def _(h, w1, b1, w2, b2, activation, residual, col_scale, row_scale, tf32_input):
    return h.new_empty((h.shape[0], w2.shape[0])), h.new_empty((h.shape[0], w1.shape[0]))


def _mlp_setup(ctx, inputs, output):
    h, w1, b1, w2, b2, activation, _, col_scale, row_scale, _ = inputs
    ctx.save_for_backward(h, w1, b1, w2, b2, col_scale, row_scale, output[1])
    ctx.activation = activation
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _mlp_backward(ctx, dy, _):
    h, w1, b1, w2, b2, col_scale, row_scale, pre = ctx.saved_tensors
    need = ctx.needs_input_grad
    need_fc1 = [need[0], need[1], need[2]]
    # fc2's dX product gives d pre directly (the activation's derivative in its epilogue), and fc2's input
    # act(pre), which the forward did not keep, for its dW product.
    dpre, dw2, db2, dcol = _linear_grads(ctx, dy, None, w2, b2, "none", None, 1.0, col_scale, row_scale, None,
                                         None, False, 0, ctx.activation, pre,
                                         [any(need_fc1), need[3], need[4], need[7]])
    dh = dw1 = db1 = None
    if any(need_fc1):
        dh, dw1, db1, _ = _linear_grads(ctx, dpre, h, w1, b1, "none", None, 1.0, None, None, None, None, False, 0,
                                        "none", None, need_fc1 + [False])
    return dh, dw1, db1, dw2, db2, None, dy if need[6] else None, dcol, None, None


_register_autograd(_mlp, _mlp_backward, _mlp_setup)


@_custom_op("vit_triton::linear_backward")
def _linear_backward_op(dy: Tensor, x: Tensor | None, weight: Tensor, bias: Tensor | None, activation: str,
                        pre: Tensor | None, scale: float, col_scale: Tensor | None, row_scale: Tensor | None,
                        cos: Tensor | None, sin: Tensor | None, rope_half: bool, rope_prefix: int,
                        x_activation: str, x_pre: Tensor | None,
                        need: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    grads = kernels.linear_backward(
        dy, x, weight, bias=bias, activation=activation, pre=pre, scale=scale, col_scale=col_scale,
        row_scale=row_scale, rope=None if cos is None else (cos, sin), rope_half=rope_half, rope_prefix=rope_prefix,
        x_activation=x_activation, x_pre=x_pre, need_dx=need[0], need_dweight=need[1], need_dbias=need[2],
        need_col_scale=need[3])
    return tuple(_out(g, dy) for g in grads)


@_linear_backward_op.register_fake
def _(dy, x, weight, bias, activation, pre, scale, col_scale, row_scale, cos, sin, rope_half, rope_prefix,
      x_activation, x_pre, need):
    rows, k = dy.shape[0], weight.shape[1]
    dx = (dy.new_empty((rows, x_pre.shape[1])) if x_pre is not None else dy.new_empty((rows, k))) if need[0] \
        else _empty(dy)
    return (dx, weight.new_empty(weight.shape) if need[1] else _empty(dy),
            weight.new_empty(weight.shape[:1]) if need[2] and bias is not None else _empty(dy),
            col_scale.new_empty(col_scale.shape) if need[3] and col_scale is not None else _empty(dy))


def _linear_grads(ctx, dy, x, weight, bias, activation, pre, scale, col_scale, row_scale, cos, sin, rope_half,
                  rope_prefix, x_activation, x_pre, need):
    """(dx, dweight, dbias, dcol_scale) of kernels.linear_backward in the backward of ctx, None where not
    needed."""
    need = [need[0], need[1], need[2] and bias is not None, need[3] and col_scale is not None]
    if not any(need):
        return None, None, None, None
    grads = _call(ctx, _linear_backward_op, dy.contiguous(), x, weight, bias, activation, pre, scale, col_scale,
                  row_scale, cos, sin, rope_half, rope_prefix, x_activation, x_pre, need)
    return tuple(g if n else None for g, n in zip(grads, need))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, activation: str = "none",
           residual: Tensor | None = None, scale: float = 1.0, tf32_input: bool = False,
           tf32_output: bool = False, rope: tuple[Tensor, Tensor] | None = None, rope_half: bool = False,
           rope_prefix: int = 0, col_scale: Tensor | None = None, row_scale: Tensor | None = None) -> Tensor:
    """kernels.linear: scale * (row_scale ⊙ col_scale ⊙ activation(x @ weight.T + bias) + residual); with "swiglu",
    weight [2N, K] holds the gate's and the value's rows interleaved and y is [M, N]; with rope = (cos, sin), a QKV
    projection whose q and k are rotated from token rope_prefix on. col_scale [N]: LayerScale's gamma; row_scale
    [M] float32: stochastic depth's per-image scale, repeated over the image's rows."""
    cos, sin = (None, None) if rope is None else rope
    if not _via_op(x, weight, bias, residual, col_scale):
        return kernels.linear(x, weight, bias, activation=activation, residual=residual, scale=scale,
                              tf32_input=tf32_input, tf32_output=tf32_output, rope=rope, rope_half=rope_half,
                              rope_prefix=rope_prefix, col_scale=col_scale, row_scale=row_scale)
    x, weight, bias, residual, col_scale = _cast(x, x, weight, bias, residual, col_scale)
    if activation != "none" and _recorded(x, weight, bias):
        if residual is not None or scale != 1.0 or col_scale is not None or row_scale is not None or rope:
            raise ValueError("a linear layer with an activation that autograd records takes no residual, scale, "
                             "col_scale, row_scale or rope (ops.mlp fuses the MLP's)")
        return _apply(_linear_pre, x, weight, bias, activation, tf32_input, tf32_output)[0]
    return _apply(_linear, x, weight, bias, activation, residual, scale, tf32_input, tf32_output, cos, sin, rope_half,
                  rope_prefix, col_scale, row_scale)


def mlp(h: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None, *, activation: str,
        residual: Tensor | None = None, col_scale: Tensor | None = None, row_scale: Tensor | None = None,
        tf32_input: bool = False) -> Tensor:
    """residual + row_scale ⊙ col_scale ⊙ (activation(h @ w1.T + b1) @ w2.T + b2): fc1 (its output stored rounded
    to tf32 for fc2 where matmuls run on tf32) then fc2, as two linear launches; recorded by autograd as one op, so
    that fc2's backward applies the activation's derivative and rebuilds its input from fc1's pre-activation."""
    if not _via_op(h, w1, b1, w2, b2, residual, col_scale):
        post = kernels.linear(h, w1, b1, activation=activation, tf32_input=tf32_input, tf32_output=True)
        return kernels.linear(post, w2, b2, residual=residual, tf32_input=True, col_scale=col_scale,
                              row_scale=row_scale)
    h, w1, b1, w2, b2, residual, col_scale = _cast(h, h, w1, b1, w2, b2, residual, col_scale)
    return _apply(_mlp, h, w1, b1, w2, b2, activation, residual, col_scale, row_scale, tf32_input)[0]


@_custom_op("vit_triton::linear_partials")
def _linear_partials(x: Tensor, weight: Tensor, bias: Tensor | None, splits: int, tf32_input: bool) -> Tensor:
    return kernels.linear_partials(x, weight, bias, splits, tf32_input=tf32_input)


@_linear_partials.register_fake
def _(x, weight, bias, splits, tf32_input):
    return x.new_empty((splits, x.shape[0], weight.shape[0]), dtype=torch.float32)


def linear_partials(x: Tensor, weight: Tensor, bias: Tensor | None, splits: int, *, tf32_input: bool = False) -> Tensor:
    """kernels.linear_partials: x @ weight.T + bias as fp32 partial sums [splits, M, N] over slices of K
    (inference only: no backward)."""
    if torch.compiler.is_compiling():
        return _linear_partials(x, weight, bias, splits, tf32_input)
    return kernels.linear_partials(x, weight, bias, splits, tf32_input=tf32_input)


# ------------------------------------------------------------------------------------------------ layer_norm

@_custom_op("vit_triton::layer_norm")
def _layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, tf32_output: bool,
                rms: bool = False, post_add: Tensor | None = None) -> tuple[Tensor, Tensor]:
    stats = torch.empty((2, x.shape[0]), device=x.device, dtype=torch.float32)
    y = kernels.layer_norm(x, weight, bias, eps, rms=rms, tf32_output=tf32_output, post_add=post_add, stats=stats)
    return y, stats


@_layer_norm.register_fake
def _(x, weight, bias, eps, tf32_output, rms=False, post_add=None):
    return x.new_empty(x.shape), x.new_empty((2, x.shape[0]), dtype=torch.float32)


def _layer_norm_setup(ctx, inputs, output):
    x, weight, bias, _, _, rms, post_add = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.rms, ctx.has_bias = rms, bias is not None
    ctx.post_add_rows = 0 if post_add is None else post_add.shape[0]
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _layer_norm_backward(ctx, dy, _):
    x, weight, stats = ctx.saved_tensors
    need = _needs(ctx, 7)
    need = [need[0], need[1], need[2] and ctx.has_bias, need[6] and ctx.post_add_rows > 0]
    if not any(need):
        return None, None, None, None, None, None, None
    grads = _call(ctx, _layer_norm_backward_op, dy.contiguous(), x, weight, stats, ctx.rms, ctx.has_bias,
                  ctx.post_add_rows, need)
    dx, dweight, dbias, dpost = (g if n else None for g, n in zip(grads, need))
    return dx, dweight, dbias, None, None, None, dpost


_register_autograd(_layer_norm, _layer_norm_backward, _layer_norm_setup)


@_custom_op("vit_triton::layer_norm_backward")
def _layer_norm_backward_op(dy: Tensor, x: Tensor, weight: Tensor, stats: Tensor, rms: bool, has_bias: bool,
                            post_add_rows: int, need: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    grads = kernels.layer_norm_backward(dy, x, weight, stats, rms=rms, has_bias=has_bias,
                                        post_add_rows=post_add_rows if need[3] else 0, need_dx=need[0],
                                        need_dweight=need[1], need_dbias=need[2])
    return tuple(_out(g, dy) for g in grads)


@_layer_norm_backward_op.register_fake
def _(dy, x, weight, stats, rms, has_bias, post_add_rows, need):
    return (dy.new_empty(x.shape) if need[0] else _empty(dy), weight.new_empty(weight.shape) if need[1] else _empty(dy),
            weight.new_empty(weight.shape) if need[2] else _empty(dy),
            dy.new_empty((post_add_rows, x.shape[1])) if need[3] else _empty(dy))


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, *, rms: bool = False,
               tf32_output: bool = False, post_add: Tensor | None = None) -> Tensor:
    """kernels.layer_norm: LayerNorm (RMSNorm with rms) of each row of x [M, D], plus post_add[m % R] on row m."""
    if not _via_op(x, weight, bias, post_add):
        return kernels.layer_norm(x, weight, bias, eps, rms=rms, tf32_output=tf32_output, post_add=post_add)
    x, weight, bias, post_add = _cast(x, x, weight, bias, post_add)
    return _apply(_layer_norm, x, weight, bias, eps, tf32_output, rms, post_add)[0]


@_custom_op("vit_triton::add_layer_norm")
def _add_layer_norm(x: Tensor, parts: Tensor, weight: Tensor, bias: Tensor | None, eps: float,
                    tf32_output: bool, rms: bool = False) -> tuple[Tensor, Tensor]:
    return kernels.add_layer_norm(x, parts, weight, bias, eps, rms=rms, tf32_output=tf32_output)


@_add_layer_norm.register_fake
def _(x, parts, weight, bias, eps, tf32_output, rms=False):
    return x.new_empty(x.shape), x.new_empty(x.shape)


def add_layer_norm(x: Tensor, parts: Tensor, weight: Tensor, bias: Tensor | None, eps: float, *, rms: bool = False,
                   tf32_output: bool = False) -> tuple[Tensor, Tensor]:
    """kernels.add_layer_norm: (s, LayerNorm(s)) for s = x + parts.sum(0) (RMSNorm(s) with rms); inference only."""
    if torch.compiler.is_compiling():
        return _add_layer_norm(x, parts, weight, bias, eps, tf32_output, rms)
    return kernels.add_layer_norm(x, parts, weight, bias, eps, rms=rms, tf32_output=tf32_output)


# ------------------------------------------------------------------------------------------------- attention

def _split(qkv: Tensor, q: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """q, k, v [B, T, H, Dh] views of the packed qkv [B, T, 3, H, Dh], or of kv [B, T, 2, H, Dh] with q
    [1 or B, Tq, H, Dh] (one set of queries expanded over the batch)."""
    if q is None:
        return qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    return q.expand(qkv.shape[0], -1, -1, -1), qkv[:, :, 0], qkv[:, :, 1]


@_custom_op("vit_triton::attention")
def _attention(qkv: Tensor, q: Tensor | None, scale: float | None, tf32_input: bool, tf32_output: bool,
               bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    q, k, v = _split(qkv, q)
    lse = torch.empty((q.shape[0], q.shape[2], q.shape[1]), device=q.device, dtype=torch.float32)
    o = kernels.fused_attention(q, k, v, scale=scale, tf32_input=tf32_input, tf32_output=tf32_output, lse=lse,
                                bias=bias)
    return o, lse


@_attention.register_fake
def _(qkv, q, scale, tf32_input, tf32_output, bias=None):
    b, t, _, h, dh = qkv.shape
    tq = t if q is None else q.shape[1]
    return qkv.new_empty((b, tq, h, dh)), qkv.new_empty((b, h, tq), dtype=torch.float32)


def _attention_setup(ctx, inputs, output):
    qkv, q, scale, _, _, *bias = inputs
    ctx.save_for_backward(qkv, q, *output, *bias)
    ctx.scale = scale
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _attention_backward(ctx, do, _):
    qkv, q, o, lse, *bias = ctx.saved_tensors
    bias = bias[0] if bias else None
    if do is None:
        return None, None, None, None, None, None
    need_dbias = _needs(ctx, 6)[5]
    dqkv, dq, dbias = _call(ctx, _attention_backward_op, qkv, q, o, lse, do.contiguous(), ctx.scale, bias,
                            need_dbias)
    return dqkv, _none(dq), None, None, None, _none(dbias).to(bias.dtype) if need_dbias else None


_register_autograd(_attention, _attention_backward, _attention_setup)


@_custom_op("vit_triton::attention_backward")
def _attention_backward_op(qkv: Tensor, q: Tensor | None, o: Tensor, lse: Tensor, do: Tensor,
                           scale: float | None, bias: Tensor | None = None,
                           need_dbias: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    dqkv = torch.empty_like(qkv)
    q_, k, v = _split(qkv, q)
    dbias = torch.empty(bias.shape, device=qkv.device, dtype=torch.float32) if need_dbias else None
    if q is None:
        kernels.attention_backward(q_, k, v, o, lse, do, scale=scale, dq=dqkv[:, :, 0], dk=dqkv[:, :, 1],
                                   dv=dqkv[:, :, 2], bias=bias, dbias=dbias)
        return dqkv, _empty(qkv), _out(dbias, qkv)
    dq, _, _ = kernels.attention_backward(q_, k, v, o, lse, do, scale=scale, dk=dqkv[:, :, 0], dv=dqkv[:, :, 1],
                                          bias=bias, dbias=dbias)
    return dqkv, dq.view(q.shape), _out(dbias, qkv)


@_attention_backward_op.register_fake
def _(qkv, q, o, lse, do, scale, bias=None, need_dbias=False):
    dbias = bias.new_empty(bias.shape, dtype=torch.float32) if need_dbias else _empty(qkv)
    return torch.empty_like(qkv), _empty(qkv) if q is None else q.new_empty(q.shape), dbias


def attention(qkv: Tensor, q: Tensor | None = None, *, bias: Tensor | None = None, scale: float | None = None,
              tf32_input: bool = False, tf32_output: bool = False) -> Tensor:
    """kernels.fused_attention over a packed projection: qkv [B, T, 3, H, Dh] (q, k and v of a transformer
    block, the QKV GEMM's output viewed in place), or kv [B, T, 2, H, Dh] with queries q [1 or B, Tq, H, Dh] (one
    set expanded over the batch: an attention-pool head). Returns o [B, Tq, H, Dh] contiguous. Autograd's gradient
    of the packed tensor is written by the backward kernels in place, with no concatenation. bias [H, Tq, T]: each
    head's scores' bias (BEiT's relative position bias), differentiable: its gradient is summed over the batch."""
    bias = None if bias is None else bias.contiguous()
    if not _via_op(qkv, q, bias):
        return kernels.fused_attention(*_split(qkv, q), scale=scale, tf32_input=tf32_input, tf32_output=tf32_output,
                                       bias=bias)
    qkv, q = _cast(qkv, qkv, q)
    return _apply(_attention, qkv, q, scale, tf32_input, tf32_output, bias)[0]


# ------------------------------------------------------------------------------------ patch_embed, token_mean

@_custom_op("vit_triton::patch_embed")
def _patch_embed(pixels: Tensor, weight: Tensor, bias: Tensor | None, pos_embed: Tensor | None,
                 prefix_tokens: Tensor | None) -> Tensor:
    return kernels.patch_embed(pixels, weight, bias, pos_embed, prefix_tokens)


@_patch_embed.register_fake
def _(pixels, weight, bias, pos_embed, prefix_tokens):
    size = weight.shape[-1]
    num_patches = (pixels.shape[2] // size) * (pixels.shape[3] // size)
    num_prefix = 0 if prefix_tokens is None else prefix_tokens.shape[0]
    return weight.new_empty((pixels.shape[0], num_prefix + num_patches, weight.shape[0]))


def _patch_embed_setup(ctx, inputs, output):
    pixels, weight, bias, pos_embed, prefix_tokens = inputs
    ctx.save_for_backward(pixels, weight)
    ctx.has_bias = bias is not None
    ctx.pos_rows = 0 if pos_embed is None else pos_embed.shape[0]
    ctx.num_prefix = 0 if prefix_tokens is None else prefix_tokens.shape[0]


def _patch_embed_backward(ctx, dtokens):
    pixels, weight = ctx.saved_tensors
    n = ctx.needs_input_grad
    need = [n[0], n[1], n[2] and ctx.has_bias, n[3] and ctx.pos_rows > 0, n[4] and ctx.num_prefix > 0]
    if not any(need):
        return None, None, None, None, None
    grads = _call(ctx, _patch_embed_backward_op, dtokens.contiguous(), pixels, weight, ctx.num_prefix, ctx.has_bias,
                  ctx.pos_rows, need)
    return tuple(g if k else None for g, k in zip(grads, need))


_register_autograd(_patch_embed, _patch_embed_backward, _patch_embed_setup)


@_custom_op("vit_triton::patch_embed_backward")
def _patch_embed_backward_op(dtokens: Tensor, pixels: Tensor, weight: Tensor, num_prefix: int, has_bias: bool,
                             pos_rows: int, need: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    grads = kernels.patch_embed_backward(dtokens, pixels, weight, num_prefix=num_prefix, has_bias=has_bias,
                                         pos_rows=pos_rows, need_pixels=need[0], need_weight=need[1],
                                         need_bias=need[2], need_pos=need[3], need_prefix=need[4])
    return tuple(_out(g, dtokens) for g in grads)


@_patch_embed_backward_op.register_fake
def _(dtokens, pixels, weight, num_prefix, has_bias, pos_rows, need):
    d = weight.shape[0]
    shapes = (pixels.shape, weight.shape, (d,), (pos_rows, d), (num_prefix, d))
    dtypes = (pixels.dtype,) + (weight.dtype,) * 4
    return tuple(dtokens.new_empty(s, dtype=t) if k else _empty(dtokens) for s, t, k in zip(shapes, dtypes, need))


def patch_embed(pixels: Tensor, weight: Tensor, bias: Tensor | None = None, pos_embed: Tensor | None = None,
                prefix_tokens: Tensor | None = None) -> Tensor:
    """kernels.patch_embed: tokens [B, P0 + Np, D] from pixels [B, C, H, W]."""
    if not _via_op(weight, pixels, bias, pos_embed, prefix_tokens):
        return kernels.patch_embed(pixels, weight, bias, pos_embed, prefix_tokens)
    weight, bias, pos_embed, prefix_tokens = _cast(weight, weight, bias, pos_embed, prefix_tokens)
    if pixels.dtype != torch.float32:
        pixels = pixels.to(weight.dtype)
    return _apply(_patch_embed, pixels, weight, bias, pos_embed, prefix_tokens)


@_custom_op("vit_triton::token_mean")
def _token_mean(x: Tensor, start: int) -> Tensor:
    return kernels.token_mean(x, start)


@_token_mean.register_fake
def _(x, start):
    return x.new_empty((x.shape[0], x.shape[2]))


def _token_mean_setup(ctx, inputs, output):
    x, start = inputs
    ctx.tokens, ctx.start = x.shape[1], start


def _token_mean_backward(ctx, dy):
    return _call(ctx, _token_mean_backward_op, dy.contiguous(), ctx.tokens, ctx.start), None


_register_autograd(_token_mean, _token_mean_backward, _token_mean_setup)


@_custom_op("vit_triton::token_mean_backward")
def _token_mean_backward_op(dy: Tensor, tokens: int, start: int) -> Tensor:
    return kernels.token_mean_backward(dy, tokens, start)


@_token_mean_backward_op.register_fake
def _(dy, tokens, start):
    return dy.new_empty((dy.shape[0], tokens, dy.shape[1]))


def token_mean(x: Tensor, start: int = 0) -> Tensor:
    """kernels.token_mean: mean of x [B, T, D] over tokens start..T-1."""
    if not _via_op(x):
        return kernels.token_mean(x, start)
    return _apply(_token_mean, _cast(x, x)[0], start)


# -------------------------------------------------------------------------------------------- the residual stream

class ResidualStream:
    """A transformer's residual stream, the [M, D] token matrix, with the update its last GEMM may have left
    pending.

    add(layer, h) is stream + layer(h) for a linear layer (anything with weight, bias, activation and tf32_input):
    done in the GEMM's epilogue, or, for a product too small to fill the GPU (kernels.split_k: ViT-B/16's fc2 and
    proj at one or two images), left as K-slice partial sums that the next norm(layer) adds to the stream while it
    normalizes it, in one kernel (add_layer_norm). Nothing outside this class sees the partial sums. A stream that
    autograd records (training), a LayerScale and stochastic depth are never split."""

    def __init__(self, x: Tensor, batch: int) -> None:
        """x: the tokens of `batch` images as one [B*T, D] matrix."""
        self._x, self._parts, self.batch = x, None, batch

    @property
    def shape(self) -> tuple[int, int, int]:
        """(B, T, D)."""
        return self.batch, self._x.shape[0] // self.batch, self._x.shape[1]

    def add(self, layer, h: Tensor, *, defer: bool = True, col_scale: Tensor | None = None,
            row_scale: Tensor | None = None) -> ResidualStream:
        """The stream plus row_scale ⊙ col_scale ⊙ layer(h) (ops.linear's col_scale, row_scale); defer=False when
        no norm will read the stream next. A layer with an activation is never split: the activation must see the
        whole sum."""
        x = self.tensor()
        split = (defer and layer.activation == "none" and col_scale is None and row_scale is None
                 and not _recorded(x, h, layer.weight, layer.bias) and _autocast_dtype(x) is None)
        splits = split_k(h.shape[0], layer.weight.shape[0], h.shape[1], h.device) if split else 1
        if splits == 1:
            return ResidualStream(layer(h, residual=x, col_scale=col_scale, row_scale=row_scale), self.batch)
        out = ResidualStream(x, self.batch)
        out._parts = linear_partials(h, layer.weight, layer.bias, splits, tf32_input=layer.tf32_input)
        return out

    def add_mlp(self, fc1, fc2, h: Tensor, *, col_scale: Tensor | None = None,
                row_scale: Tensor | None = None, defer: bool = True) -> ResidualStream:
        """The stream plus row_scale ⊙ col_scale ⊙ fc2(fc1(h)) (fc1 with its activation): fc2 as add() places it,
        or, where autograd records the stream, both as one ops.mlp."""
        x = self.tensor()
        if _recorded(x, h, fc1.weight, fc1.bias, fc2.weight, fc2.bias, col_scale):
            return ResidualStream(mlp(h, fc1.weight, fc1.bias, fc2.weight, fc2.bias, activation=fc1.activation,
                                      residual=x, col_scale=col_scale, row_scale=row_scale,
                                      tf32_input=fc1.tf32_input), self.batch)
        return self.add(fc2, fc1(h), defer=defer, col_scale=col_scale, row_scale=row_scale)

    def norm(self, layer) -> Tensor:
        """layer's LayerNorm (anything with weight, bias, eps, rms and tf32_output) of the stream, after adding a
        pending update to the stream."""
        if self._parts is None:
            return layer(self._x)
        self._x, y = add_layer_norm(self._x, self._parts, layer.weight, layer.bias, layer.eps, rms=layer.rms,
                                    tf32_output=layer.tf32_output)
        self._parts = None
        return y

    def tensor(self) -> Tensor:
        """The stream as a tensor; there is no pending update (add with defer=False before)."""
        if self._parts is not None:
            raise RuntimeError("the stream has a pending split-K update: read it through norm()")
        return self._x
