"""The kernels as PyTorch operators (torch.library), so that torch.compile sees each one.

Each launcher of vit_triton.kernels is registered as a custom op `vit_triton::<name>` with a fake
(meta) implementation that gives the output's shape, dtype and layout without running anything.
torch.compile then traces a vit-triton model into one graph of these opaque calls (no graph breaks
on Triton's Python launcher) and can place it in a CUDA graph, fuse the PyTorch code around it, or
compile a larger model that contains a ViT.

Eager calls go straight to the launcher: the dispatcher costs about 5-10 us a call, which an
eager forward at small batch (87 launches) would feel. Under torch.compile the same call is
traced as the custom op. The launchers validate their inputs when they run; the fake functions
only compute output shapes.

ResidualStream is the one place where a model meets the small-batch plan of its residual GEMMs (split K,
with the sum left to the next LayerNorm); a block reads `x = x.add(proj, attn)`, `h = x.norm(norm2)`.

No op here has a backward yet.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import kernels
from .kernels import split_k


@torch.library.custom_op("vit_triton::linear", mutates_args=())
def _linear(x: Tensor, weight: Tensor, bias: Tensor | None, activation: str, residual: Tensor | None,
            scale: float, tf32_input: bool, tf32_output: bool, cos: Tensor | None = None, sin: Tensor | None = None,
            rope_half: bool = False, rope_prefix: int = 0) -> Tensor:
    rope = None if cos is None else (cos, sin)
    return kernels.linear(x, weight, bias, activation=activation, residual=residual, scale=scale,
                          tf32_input=tf32_input, tf32_output=tf32_output, rope=rope, rope_half=rope_half,
                          rope_prefix=rope_prefix)


@_linear.register_fake
def _(x, weight, bias, activation, residual, scale, tf32_input, tf32_output, cos=None, sin=None, rope_half=False,
      rope_prefix=0):
    # swiglu: weight holds a gate's and a value's rows, two for each column of y
    return x.new_empty((x.shape[0], weight.shape[0] // 2 if activation == "swiglu" else weight.shape[0]))


@torch.library.custom_op("vit_triton::layer_norm", mutates_args=())
def _layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, tf32_output: bool,
                rms: bool = False, post_add: Tensor | None = None) -> Tensor:
    return kernels.layer_norm(x, weight, bias, eps, rms=rms, tf32_output=tf32_output, post_add=post_add)


@_layer_norm.register_fake
def _(x, weight, bias, eps, tf32_output, rms=False, post_add=None):
    return x.new_empty(x.shape)


@torch.library.custom_op("vit_triton::linear_partials", mutates_args=())
def _linear_partials(x: Tensor, weight: Tensor, bias: Tensor | None, splits: int, tf32_input: bool) -> Tensor:
    return kernels.linear_partials(x, weight, bias, splits, tf32_input=tf32_input)


@_linear_partials.register_fake
def _(x, weight, bias, splits, tf32_input):
    return x.new_empty((splits, x.shape[0], weight.shape[0]), dtype=torch.float32)


@torch.library.custom_op("vit_triton::add_layer_norm", mutates_args=())
def _add_layer_norm(x: Tensor, parts: Tensor, weight: Tensor, bias: Tensor | None, eps: float,
                    tf32_output: bool, rms: bool = False) -> tuple[Tensor, Tensor]:
    return kernels.add_layer_norm(x, parts, weight, bias, eps, rms=rms, tf32_output=tf32_output)


@_add_layer_norm.register_fake
def _(x, parts, weight, bias, eps, tf32_output, rms=False):
    return x.new_empty(x.shape), x.new_empty(x.shape)


@torch.library.custom_op("vit_triton::fused_attention", mutates_args=())
def _fused_attention(q: Tensor, k: Tensor, v: Tensor, scale: float | None, tf32_input: bool,
                     tf32_output: bool) -> Tensor:
    return kernels.fused_attention(q, k, v, scale=scale, tf32_input=tf32_input, tf32_output=tf32_output)


@_fused_attention.register_fake
def _(q, k, v, scale, tf32_input, tf32_output):
    # [B, Tq, H, Dh] contiguous, whatever q's strides (a query expanded over the batch has batch stride 0)
    return q.new_empty(q.shape)


@torch.library.custom_op("vit_triton::patch_embed", mutates_args=())
def _patch_embed(pixels: Tensor, weight: Tensor, bias: Tensor | None, pos_embed: Tensor | None,
                 prefix_tokens: Tensor | None) -> Tensor:
    return kernels.patch_embed(pixels, weight, bias, pos_embed, prefix_tokens)


@_patch_embed.register_fake
def _(pixels, weight, bias, pos_embed, prefix_tokens):
    size = weight.shape[-1]
    num_patches = (pixels.shape[2] // size) * (pixels.shape[3] // size)
    num_prefix = 0 if prefix_tokens is None else prefix_tokens.shape[0]
    return weight.new_empty((pixels.shape[0], num_prefix + num_patches, weight.shape[0]))


@torch.library.custom_op("vit_triton::token_mean", mutates_args=())
def _token_mean(x: Tensor, start: int) -> Tensor:
    return kernels.token_mean(x, start)


@_token_mean.register_fake
def _(x, start):
    return x.new_empty((x.shape[0], x.shape[2]))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, activation: str = "none",
           residual: Tensor | None = None, scale: float = 1.0, tf32_input: bool = False,
           tf32_output: bool = False, rope: tuple[Tensor, Tensor] | None = None, rope_half: bool = False,
           rope_prefix: int = 0) -> Tensor:
    """kernels.linear: scale * (activation(x @ weight.T + bias) + residual); with "swiglu", weight [2N, K] holds
    the gate's and the value's rows interleaved and y is [M, N]; with rope = (cos, sin), a QKV projection whose q
    and k are rotated from token rope_prefix on."""
    if torch.compiler.is_compiling():
        cos, sin = (None, None) if rope is None else rope
        return _linear(x, weight, bias, activation, residual, scale, tf32_input, tf32_output, cos, sin, rope_half,
                       rope_prefix)
    return kernels.linear(x, weight, bias, activation=activation, residual=residual, scale=scale,
                          tf32_input=tf32_input, tf32_output=tf32_output, rope=rope, rope_half=rope_half,
                          rope_prefix=rope_prefix)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, *, rms: bool = False,
               tf32_output: bool = False, post_add: Tensor | None = None) -> Tensor:
    """kernels.layer_norm: LayerNorm (RMSNorm with rms) of each row of x [M, D], plus post_add[m % R] on row m."""
    if torch.compiler.is_compiling():
        return _layer_norm(x, weight, bias, eps, tf32_output, rms, post_add)
    return kernels.layer_norm(x, weight, bias, eps, rms=rms, tf32_output=tf32_output, post_add=post_add)


def linear_partials(x: Tensor, weight: Tensor, bias: Tensor | None, splits: int, *, tf32_input: bool = False) -> Tensor:
    """kernels.linear_partials: x @ weight.T + bias as fp32 partial sums [splits, M, N] over slices of K."""
    if torch.compiler.is_compiling():
        return _linear_partials(x, weight, bias, splits, tf32_input)
    return kernels.linear_partials(x, weight, bias, splits, tf32_input=tf32_input)


def add_layer_norm(x: Tensor, parts: Tensor, weight: Tensor, bias: Tensor | None, eps: float, *, rms: bool = False,
                   tf32_output: bool = False) -> tuple[Tensor, Tensor]:
    """kernels.add_layer_norm: (s, LayerNorm(s)) for s = x + parts.sum(0) (RMSNorm(s) with rms)."""
    if torch.compiler.is_compiling():
        return _add_layer_norm(x, parts, weight, bias, eps, tf32_output, rms)
    return kernels.add_layer_norm(x, parts, weight, bias, eps, rms=rms, tf32_output=tf32_output)


def fused_attention(q: Tensor, k: Tensor, v: Tensor, *, scale: float | None = None, tf32_input: bool = False,
                    tf32_output: bool = False) -> Tensor:
    """kernels.fused_attention: softmax(q k^T * scale) v for q [B, Tq, H, Dh] and k, v [B, Tk, H, Dh]."""
    if torch.compiler.is_compiling():
        return _fused_attention(q, k, v, scale, tf32_input, tf32_output)
    return kernels.fused_attention(q, k, v, scale=scale, tf32_input=tf32_input, tf32_output=tf32_output)


def patch_embed(pixels: Tensor, weight: Tensor, bias: Tensor | None = None, pos_embed: Tensor | None = None,
                prefix_tokens: Tensor | None = None) -> Tensor:
    """kernels.patch_embed: tokens [B, P0 + Np, D] from pixels [B, C, H, W]."""
    if torch.compiler.is_compiling():
        return _patch_embed(pixels, weight, bias, pos_embed, prefix_tokens)
    return kernels.patch_embed(pixels, weight, bias, pos_embed, prefix_tokens)


def token_mean(x: Tensor, start: int = 0) -> Tensor:
    """kernels.token_mean: mean of x [B, T, D] over tokens start..T-1."""
    if torch.compiler.is_compiling():
        return _token_mean(x, start)
    return kernels.token_mean(x, start)


class ResidualStream:
    """A transformer's residual stream, the [M, D] token matrix, with the update its last GEMM may have left
    pending.

    add(layer, h) is stream + layer(h) for a linear layer (anything with weight, bias, activation and tf32_input):
    done in the GEMM's epilogue, or, for a product too small to fill the GPU (kernels.split_k: ViT-B/16's fc2 and
    proj at one or two images), left as K-slice partial sums that the next norm(layer) adds to the stream while it
    normalizes it, in one kernel (add_layer_norm). Nothing outside this class sees the partial sums."""

    def __init__(self, x: Tensor, batch: int) -> None:
        """x: the tokens of `batch` images as one [B*T, D] matrix."""
        self._x, self._parts, self.batch = x, None, batch

    @property
    def shape(self) -> tuple[int, int, int]:
        """(B, T, D)."""
        return self.batch, self._x.shape[0] // self.batch, self._x.shape[1]

    def add(self, layer, h: Tensor, *, defer: bool = True) -> ResidualStream:
        """The stream plus layer(h); defer=False when no norm will read the stream next. A layer with an
        activation is never split: the activation must see the whole sum."""
        x = self.tensor()
        split = defer and layer.activation == "none"
        splits = split_k(h.shape[0], layer.weight.shape[0], h.shape[1], h.device) if split else 1
        if splits == 1:
            return ResidualStream(layer(h, residual=x), self.batch)
        out = ResidualStream(x, self.batch)
        out._parts = linear_partials(h, layer.weight, layer.bias, splits, tf32_input=layer.tf32_input)
        return out

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
