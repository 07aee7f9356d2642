"""fused_attention and attention_backward against F.scaled_dot_product_attention and its autograd, on the strided
q/k/v the model passes."""

import importlib
import math

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.checks import (
    assert_written_in_place, check, each_dtype, empty, nan_filled, rand, raises_value_error, reference, tf32_emulated,
    tf32_matmuls, torch_grads,
)
from tests.numerics import DEVICE, DTYPES, assert_close, rel_err
from vit_triton.kernels import attention_backward, fused_attention

ATTENTION = importlib.import_module("vit_triton.kernels.attention")   # the module; the package exports the function


def torch_attention(scale=None):
    """SDPA on [B, H, T, Dh] (transposed views of the [B, T, H, Dh] inputs), back to [B, T, H, Dh]."""
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              scale=scale).transpose(1, 2)
    return fn


def matmul_attention(scale=None, matmul=torch.matmul):
    """softmax(q k^T scale) v by two matmuls and PyTorch's softmax, on [B, T, H, Dh]."""
    def fn(q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return matmul((matmul(q, k.mT) * (scale or q.shape[-1] ** -0.5)).softmax(-1), v).transpose(1, 2)
    return fn


def qkv(batch, tokens, heads, head_dim, dtype, strided=True, qk_scale=1.0):
    """q, k, v [B, T, H, Dh], q and k times qk_scale. strided: views of one [B, T, 3, H, Dh] tensor,
    the QKV GEMM's output as the model hands it over; else three contiguous tensors."""
    axis = 2 if strided else 0
    shape = [batch, tokens, heads, head_dim]
    x = rand(*shape[:axis], 3, *shape[axis:], dtype=torch.float32)
    x.narrow(axis, 0, 2).mul_(qk_scale)
    return x.to(dtype).unbind(axis)


def pool_qkv(batch, queries, tokens, heads, head_dim, dtype, expanded):
    """An attention-pool head's q [B, Tq, H, Dh] and k, v [B, Tk, H, Dh]: k and v views of one
    [B, Tk, 2, H, Dh] tensor (the kv GEMM's output); q one set of queries expanded over the batch (batch
    stride 0) if expanded, else B of them."""
    q = rand(1 if expanded else batch, queries, heads, head_dim, dtype=dtype).expand(batch, -1, -1, -1)
    return q, *rand(batch, tokens, 2, heads, head_dim, dtype=dtype).unbind(2)


def attend(q, k, v, scale=None):
    check(fused_attention(q, k, v, scale=scale), torch_attention(scale), q, k, v)


def use_path(monkeypatch, path):
    """Runs the kernel on one of its paths: streamed key blocks with an online softmax (never one pass),
    or one pass over all keys (wherever T allows, however many programs)."""
    monkeypatch.setattr(ATTENTION, "ONE_PASS_WAVES", 0 if path == "streaming" else 1 << 30)


@pytest.fixture(params=["streaming", "one pass"])
def path(request, monkeypatch):
    """Each test that takes it runs on both paths of the kernel."""
    use_path(monkeypatch, request.param)


# Every pair of sequence length and head dim once (pairwise, not the full product with the dtypes:
# the interpreter is slow). Along each diagonal i + j the dtype cycles through three and batch x heads
# through 1 x 3 and 3 x 2, so each dtype meets every length, every head dim and both batch sizes.
TOKENS = [1, 50, 37, 197, 257]  # 50 (ViT-B/32): two 16-key tail blocks after a whole one
HEAD_DIMS = [32, 64, 80, 96, 128]
# Each shape on both paths, but for T = 257, which streams at any launch size.
SHAPES = [(1 + (i + j) % 2 * 2, t, 3 - (i + j) % 2, d, DTYPES[(i + j) % 3], path)
          for i, t in enumerate(TOKENS) for j, d in enumerate(HEAD_DIMS)
          for path in ("streaming", "one pass")[:1 if t > ATTENTION.ONE_PASS_MAX_T else 2]]


@pytest.mark.parametrize("batch, tokens, heads, head_dim, dtype, path", SHAPES,
                         ids=[f"B{b}-T{t}-H{h}-Dh{d}-{str(dt)[6:]}-{p}" for b, t, h, d, dt, p in SHAPES])
def test_shapes(batch, tokens, heads, head_dim, dtype, path, monkeypatch):
    use_path(monkeypatch, path)
    attend(*qkv(batch, tokens, heads, head_dim, dtype))


# Attention pooling: Tq queries, Tk keys, in every pairing with the head dims of the pooled families
# (72: SigLIP SO400M), dtypes and batch x heads cycling as in SHAPES; q expanded over the batch in every
# other case.
QUERIES_KEYS = [(1, 37), (3, 50), (1, 197), (3, 257)]
POOL_HEAD_DIMS = [64, 72, 80]
POOL_SHAPES = [(1 + (i + j) % 2 * 2, tq, tk, 3 - (i + j) % 2, d, DTYPES[(i + j) % 3], bool((i + j) % 2), path)
               for i, (tq, tk) in enumerate(QUERIES_KEYS) for j, d in enumerate(POOL_HEAD_DIMS)
               for path in ("streaming", "one pass")[:1 if tk > ATTENTION.ONE_PASS_MAX_T else 2]]


@pytest.mark.parametrize("batch, queries, tokens, heads, head_dim, dtype, expanded, path", POOL_SHAPES,
                         ids=[f"B{b}-Tq{tq}-Tk{tk}-H{h}-Dh{d}-{str(dt)[6:]}{'-expanded' if e else ''}-{p}"
                              for b, tq, tk, h, d, dt, e, p in POOL_SHAPES])
def test_query_length_differs(batch, queries, tokens, heads, head_dim, dtype, expanded, path, monkeypatch):
    use_path(monkeypatch, path)
    q, k, v = pool_qkv(batch, queries, tokens, heads, head_dim, dtype, expanded)
    buffer = nan_filled(batch, queries, 2, heads, head_dim, dtype=dtype)   # out: queries 2*H*Dh apart
    out = buffer[:, :, 0]
    assert_written_in_place(fused_attention(q, k, v, out=out), out, buffer)
    check(out, torch_attention(), q, k, v)


@each_dtype
@pytest.mark.usefixtures("path")
def test_head_dim_72(dtype):
    # SigLIP SO400M's blocks: 16 heads of 72
    attend(*qkv(3, 37, 2, 72, dtype))


@pytest.mark.parametrize("head_dim, strides, align", [(72, None, 8), (64, None, 16), (80, None, 16),
                                                      (20, None, 4), (72, (0, 72), 8), (24, (3 * 24, 1), 1)])
def test_alignment_divides_every_batch_and_head_stride(head_dim, strides, align):
    # the kernels' ALIGN: the largest power of two up to 16 dividing the strides the hint claims it divides
    from vit_triton.kernels.attention import alignment

    qkv = torch.empty(2, 5, 3, 4, head_dim).unbind(2)   # a QKV GEMM's output: 3 * H * Dh a token, Dh a head
    tensors = list(qkv)
    if strides is not None:   # another tensor whose batch and head strides are these
        tensors.append(torch.empty(10_000).as_strided((2, 5, 4, head_dim), (strides[0], 4 * 16 * 3, strides[1], 1)))
    assert alignment(*tensors) == align


@pytest.mark.parametrize("head_dim, pieces", [(16, (16, 0)), (20, (32, 0)), (24, (32, 0)), (40, (32, 16)),
                                               (64, (64, 0)), (72, (64, 16)), (80, (64, 16)), (96, (64, 32)),
                                               (112, (128, 0)), (160, (128, 32)), (200, (256, 0))])
def test_head_pieces(head_dim, pieces):
    # a second piece only where it saves columns over padding the whole head dim to a power of two
    from vit_triton.kernels.attention import head_pieces

    assert head_pieces(head_dim) == pieces


@each_dtype
@pytest.mark.parametrize("tokens, head_dim", [(37, 80), (197, 64)])
@pytest.mark.usefixtures("path")
def test_contiguous_inputs(dtype, tokens, head_dim):
    attend(*qkv(3, tokens, 2, head_dim, dtype, strided=False))


def test_577_tokens():
    attend(*qkv(1, 577, 1, 64, torch.bfloat16))


@pytest.mark.parametrize("tokens, pieces", [(1, (16, 0, 0)), (16, (16, 0, 0)), (17, (32, 0, 0)), (50, (64, 0, 0)),
                                            (145, (128, 32, 0)), (197, (128, 64, 16)), (240, (128, 64, 64)),
                                            (256, (256, 0, 0))])
def test_one_pass_key_pieces(tokens, pieces):
    # T rounded up to 16, as at most three powers of two that cover it
    assert ATTENTION.key_pieces(tokens) == pieces


@pytest.fixture
def tuned(monkeypatch):
    """The tuning key of each launch of the tuned streaming kernel. One pass runs where at most ONE_PASS_WAVES
    programs an SM: here 4 SMs and 32-row query blocks, on any device, so 8 programs."""
    monkeypatch.setattr(ATTENTION, "sm_count", lambda device: 4)
    monkeypatch.setattr(ATTENTION, "ONE_PASS_BLOCK_M", 32)
    keys = []
    pick = ATTENTION._TUNER.pick
    monkeypatch.setattr(ATTENTION._TUNER, "pick", lambda key, *args: keys.append(key) or pick(key, *args))
    return keys


def sizes(batch, heads, queries, keys):
    """The sizes a launch's tuning key starts with."""
    return ATTENTION.tuning_sizes(batch, heads, queries, keys)


def test_one_pass_only_for_short_launches(tuned):
    # One pass where T <= 256 and the launch is at most 8 programs; otherwise the tuned streaming kernel runs.
    for batch, tokens, heads in [(2, 17, 4), (3, 17, 3), (1, 257, 1), (1, 40, 4)]:   # 8, 9, 9 and 8 programs
        attend(*qkv(batch, tokens, heads, 32, torch.bfloat16))
    assert [key[:3] for key in tuned] == [sizes(3, 3, 17, 17), sizes(1, 1, 257, 257)]


def test_one_pass_decided_by_key_length(tuned):
    # The key length bounds the scores a one-pass program holds; the query length sets the programs.
    for batch, queries, tokens in [(8, 1, 200), (9, 1, 17), (1, 1, 257), (4, 64, 17)]:   # 8, 9, 1 and 8 programs
        attend(*pool_qkv(batch, queries, tokens, 1, 32, torch.bfloat16, expanded=True))
    assert [key[:3] for key in tuned] == [sizes(9, 1, 1, 17), sizes(1, 1, 1, 257)]


def test_tuned_per_batch_class(tuned, monkeypatch):
    # The best tile at one image (few programs) is not the best at 256 (1.38x slower there on an H100),
    # so the tuning key holds B*H rounded up to a power of two, not the sequence alone.
    monkeypatch.setattr(ATTENTION, "ONE_PASS_WAVES", 0)
    for batch, heads in ((1, 3), (5, 3), (2, 2)):
        attend(*qkv(batch, 17, heads, 32, torch.float32))
    assert [key[0] for key in tuned] == [4, 16, 4]


def test_nearby_lengths_share_a_tuning_key(tuned, monkeypatch):
    # An image size near a tuned one (197 -> 211 tokens) keys the tuner as that one did; 226 tokens do not.
    monkeypatch.setattr(ATTENTION, "ONE_PASS_WAVES", 0)
    for tokens in (197, 211, 226):
        attend(*qkv(1, tokens, 1, 32, torch.bfloat16))
    assert tuned[0] == tuned[1] != tuned[2]


@each_dtype
@pytest.mark.usefixtures("path")
def test_custom_scale(dtype):
    attend(*qkv(3, 37, 2, 96, dtype), scale=0.3)


@each_dtype
@pytest.mark.usefixtures("path")
def test_large_logits_stay_finite_and_accurate(dtype):
    # q and k x10: logits in the hundreds, so exp() overflows unless the running max is subtracted
    # first. (At x30 the float32 rounding of logits in the thousands alone moves any implementation's
    # softmax past 1e-5, PyTorch's SDPA included; x10 keeps float32 under the ordinary rule.)
    attend(*qkv(3, 197, 2, 64, dtype, qk_scale=10.0))


@each_dtype
@pytest.mark.usefixtures("path")
def test_every_element_is_written_in_place(dtype):
    q, k, v = qkv(3, 37, 2, 80, dtype)
    buffer = nan_filled(3, 37, 2, 2, 80, dtype=dtype)
    out = buffer[:, :, 1]                               # [B, T, H, Dh] with tokens 2*H*Dh apart
    result = fused_attention(q, k, v, out=out)
    assert_written_in_place(result, out, buffer)
    check(result, torch_attention(), q, k, v)


@pytest.mark.parametrize("change, message", [
    (dict(q=empty(5, 2, 32)), "q must be 4-D [B, T, H, Dh], got shape (5, 2, 32)"),
    (dict(k=empty(2, 4, 2, 32)), "k must have shape (2, 5, 2, 32), got (2, 4, 2, 32)"),
    (dict(k=empty(2, 4, 2, 32), v=empty(2, 4, 2, 32), out=empty(2, 4, 2, 32)),
     "out must have shape (2, 5, 2, 32), got (2, 4, 2, 32)"),
    (dict(k=empty(1, 4, 2, 32), v=empty(1, 4, 2, 32)), "k must have shape (2, 4, 2, 32), got (1, 4, 2, 32)"),
    (dict(v=empty(2, 5, 64)), "v must be 4-D [B, T, H, Dh], got shape (2, 5, 64)"),
    (dict(v=empty(2, 5, 2, 32, dtype=torch.float16)), "v must be torch.float32, got torch.float16"),
    (dict(q=empty(2, 5, 2, 32, dtype=torch.bfloat16)), "k must be torch.bfloat16, got torch.float32"),
    (dict(q=empty(2, 5, 2, 32, dtype=torch.float64)), "q must be float32, float16 or bfloat16, got torch.float64"),
    (dict(q=empty(2, 5, 2, 8), k=empty(2, 5, 2, 8), v=empty(2, 5, 2, 8)), "head dim must be between 16 and 256, got 8"),
    (dict(q=empty(2, 5, 2, 288), k=empty(2, 5, 2, 288), v=empty(2, 5, 2, 288)),
     "head dim must be between 16 and 256, got 288"),
    (dict(v=empty(2, 5, 32, 2).transpose(2, 3)), "v must have unit stride along the head dim, got strides (320, 64, 1, 2)"),
    (dict(out=empty(2, 5, 32)), "out must have shape (2, 5, 2, 32), got (2, 5, 32)"),
    (dict(out=empty(2, 5, 2, 32, dtype=torch.float16)), "out must be torch.float32, got torch.float16"),
    (dict(scale=0.0), "scale must be positive, got 0.0"),
    (dict(scale=-0.125), "scale must be positive, got -0.125"),
    (dict(lse=empty(2, 5, 2)), "lse must have shape (2, 2, 5), got (2, 5, 2)"),
    (dict(lse=empty(2, 2, 5, dtype=torch.bfloat16)), "lse must be torch.float32, got torch.bfloat16"),
    (dict(lse=empty(2, 5, 2).transpose(1, 2)), "lse must be contiguous, got strides (10, 1, 2)"),
    (dict(bias=empty(2, 5, 4)), "bias must have shape (2, 5, 5), got (2, 5, 4)"),
    (dict(bias=empty(2, 5, 5, dtype=torch.float16)), "bias must be torch.float32, got torch.float16"),
    (dict(bias=empty(2, 5, 5).transpose(1, 2)), "bias must be contiguous, got strides (25, 1, 5)"),
])
def test_bad_input(change, message):
    args = dict(zip("qkv", qkv(2, 5, 2, 32, torch.float32)), out=None, scale=None, lse=None, bias=None) | change
    with raises_value_error(message):
        fused_attention(args["q"], args["k"], args["v"], out=args["out"], scale=args["scale"], lse=args["lse"],
                        bias=args["bias"])


# BEiT's relative position bias: each head's [Tq, Tk] added to its scaled scores, the same for every image; float32
# (a float32 table under autocast) or the inputs' dtype (a bf16 model's table). SDPA takes it as a float mask.

def biased_attention(q, k, v, bias):
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=bias.to(q.dtype)).transpose(1, 2)


# batch, tokens, heads, head dim, dtype, bias dtype: GRAD_SHAPES' sizes, with a bias of BEiT's magnitudes (N(0, 1))
BIAS_CASES = [(3, 37, 2, 72, torch.float16, torch.float32), (1, 50, 3, 80, torch.float32, torch.float32),
              (1, 197, 1, 64, torch.bfloat16, torch.float32), (1, 37, 3, 80, torch.bfloat16, torch.bfloat16)]
BIAS_IDS = [f"B{b}-T{t}-H{h}-Dh{d}-{str(dt)[6:]}-bias-{str(bt)[6:]}" for b, t, h, d, dt, bt in BIAS_CASES]


@pytest.mark.usefixtures("path")
@pytest.mark.parametrize("batch, tokens, heads, head_dim, dtype, bias_dtype", BIAS_CASES, ids=BIAS_IDS)
def test_bias(batch, tokens, heads, head_dim, dtype, bias_dtype):
    q, k, v = qkv(batch, tokens, heads, head_dim, dtype)
    bias = rand(heads, tokens, tokens, dtype=bias_dtype)
    check(fused_attention(q, k, v, bias=bias), biased_attention, q, k, v, bias)


# The backward. Each test runs the forward with lse=, then attention_backward, against the gradients of SDPA by
# torch autograd: in float64 on the CPU from the same inputs, and in the inputs' own precision for the 1.5x rule.

def torch_gradients(scale=None, attention=None):
    """fn(q, k, v, do) -> (dq, dk, dv) of attention (SDPA's by default) by torch autograd; q is expanded to do's
    batch, so a q of batch 1 gets the gradient summed over the batch."""
    attention = attention or torch_attention(scale)

    def fn(q, k, v, do):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        return torch.autograd.grad(attention(q.expand(do.shape[0], -1, -1, -1), k, v), (q, k, v), do)
    return fn


def output_gradient(batch, queries, heads, head_dim, dtype, strided):
    """dL/do [B, Tq, H, Dh]: strided, the [B, H, Tq, Dh] layout of SDPA's gradients, transposed; else contiguous."""
    if strided:
        return rand(batch, heads, queries, head_dim, dtype=dtype).transpose(1, 2)
    return rand(batch, queries, heads, head_dim, dtype=dtype)


def backward(q, k, v, do, scale=None, **grads):
    """Our forward (storing lse), then attention_backward: (dq, dk, dv)."""
    lse = torch.empty(q.shape[0], q.shape[2], q.shape[1], device=q.device)
    o = fused_attention(q, k, v, scale=scale, lse=lse)
    return attention_backward(q, k, v, o, lse, do, scale=scale, **grads)


def check_gradients(grads, q, k, v, do, scale=None, torch_fn=None):
    """grads (dq, dk, dv) against the float64 reference; q as the reference takes it (batch 1 if expanded).
    Returns the reference."""
    fn = torch_gradients(scale)
    refs, torch_grads = reference(fn, q, k, v, do), (torch_fn or fn)(q, k, v, do)
    for ours, ref, theirs in zip(grads, refs, torch_grads):
        assert_close(ours, ref, ours.dtype, theirs)
    return refs


LSE_SHAPES = [(3, 37, 37, 2, 64, torch.bfloat16, False), (1, 50, 50, 3, 80, torch.float32, False),
              (3, 3, 50, 2, 72, torch.float16, True)]   # batch, queries, tokens, heads, head dim, dtype, expanded


@pytest.mark.usefixtures("path")
@pytest.mark.parametrize("batch, queries, tokens, heads, head_dim, dtype, expanded", LSE_SHAPES,
                         ids=[f"B{b}-Tq{tq}-Tk{tk}-H{h}-Dh{d}-{str(dt)[6:]}{'-expanded' if e else ''}"
                              for b, tq, tk, h, d, dt, e in LSE_SHAPES])
def test_lse(batch, queries, tokens, heads, head_dim, dtype, expanded):
    # log2(sum_j exp(scale q.k_j)), against float64; lse is float32 from the products the tensor cores give,
    # whatever the inputs' dtype, so it is held to float32's 1e-5. Storing it changes nothing in o.
    q, k, v = pool_qkv(batch, queries, tokens, heads, head_dim, dtype, expanded)
    lse = nan_filled(batch, heads, queries, dtype=torch.float32)
    assert torch.equal(fused_attention(q, k, v, lse=lse), fused_attention(q, k, v))
    ref = torch.logsumexp(head_dim ** -0.5 * reference(lambda q, k: q.transpose(1, 2) @ k.permute(0, 2, 3, 1), q, k),
                          dim=-1) / math.log(2)
    assert_close(lse, ref, torch.float32)


# Pairs of sequence length and head dim (each length with two head dims, each head dim with two lengths), the
# dtype cycling; batch x heads 1 x 3 and 3 x 2 (one head at 197, to keep the interpreter's time down); q, k, v and
# do strided (views of one packed tensor; do transposed from [B, H, T, Dh]) or contiguous; the explicit scale.
GRAD_SHAPES = [   # batch, tokens, heads, head dim, dtype, strided, scale
    (1, 5, 3, 64, torch.float32, True, None), (3, 5, 2, 72, torch.bfloat16, False, None),
    (3, 37, 2, 72, torch.float16, True, 0.3), (1, 37, 3, 80, torch.float32, False, None),
    (1, 50, 3, 80, torch.bfloat16, True, 0.3), (3, 50, 2, 128, torch.float16, False, None),
    (1, 197, 1, 128, torch.float32, True, None), (1, 197, 1, 64, torch.bfloat16, False, None),
]


@pytest.mark.parametrize("batch, tokens, heads, head_dim, dtype, strided, scale", GRAD_SHAPES,
                         ids=[f"B{b}-T{t}-H{h}-Dh{d}-{str(dt)[6:]}-{'strided' if s else 'contiguous'}"
                              f"{'' if sc is None else f'-scale{sc}'}" for b, t, h, d, dt, s, sc in GRAD_SHAPES])
def test_gradients(batch, tokens, heads, head_dim, dtype, strided, scale):
    q, k, v = qkv(batch, tokens, heads, head_dim, dtype, strided)
    do = output_gradient(batch, tokens, heads, head_dim, dtype, strided)
    check_gradients(backward(q, k, v, do, scale), q, k, v, do, scale)


# Attention pooling: Tq learned queries (1 or 3) over Tk tokens, k and v views of one [B, Tk, 2, H, Dh] tensor; q
# one set expanded over the batch (dq: its gradient, summed over the batch) or one per image.
POOL_GRAD_SHAPES = [   # batch, queries, tokens, heads, head dim, dtype, expanded
    (3, 1, 37, 2, 72, torch.float32, True), (3, 3, 50, 1, 64, torch.bfloat16, True),
    (2, 3, 37, 2, 80, torch.float16, True), (3, 1, 50, 2, 64, torch.float16, False),
]


@pytest.mark.parametrize("batch, queries, tokens, heads, head_dim, dtype, expanded", POOL_GRAD_SHAPES,
                         ids=[f"B{b}-Tq{tq}-Tk{tk}-H{h}-Dh{d}-{str(dt)[6:]}{'-expanded' if e else ''}"
                              for b, tq, tk, h, d, dt, e in POOL_GRAD_SHAPES])
def test_pool_gradients(batch, queries, tokens, heads, head_dim, dtype, expanded):
    q, k, v = pool_qkv(batch, queries, tokens, heads, head_dim, dtype, expanded)
    do = output_gradient(batch, queries, heads, head_dim, dtype, strided=True)
    grads = backward(q, k, v, do)
    assert grads[0].shape == (1 if expanded else batch, queries, heads, head_dim)
    check_gradients(grads, q[:1] if expanded else q, k, v, do)


def very_negative_qk(batch, tokens, heads, dtype):
    """q and k [B, T, H, 64] whose every score q.k / 8 lies within about 2 of -104: q's first feature -52 and k's
    16, the other 63 small for q and large for k, all on a grid of 1/16 (exact in bfloat16). Every product and
    partial sum of q.k is then exact in float32 in any order, and k's part common to all keys (which dq's sum over
    keys cancels) is small beside the rest, so no gradient is ill-conditioned: near -100 float32's spacing is 1e-5
    of the exponent, and with normal draws around a shared mean both PyTorch's gradients and ours were 0.4-2e-5
    off float64, which order of summation came closest changing with the draw."""
    shape = (batch, tokens, heads, 64)
    q = torch.randint(-8, 9, shape, device=DEVICE) / 16
    k = torch.randint(-64, 65, shape, device=DEVICE) / 16
    q[..., 0], k[..., 0] = -52, 16
    return q.to(dtype), k.to(dtype)


@each_dtype
def test_gradients_of_very_negative_scores(dtype):
    # Every score of a row near -104: lse < -88, so exp(0 - lse) overflows float32. A key past T_K (37 keys: the
    # last 5 in a masked block) that loads as zeros must still get P = 0, else dS is inf there and dS K NaN.
    q, k = very_negative_qk(2, 37, 2, dtype)
    k, v = torch.stack((k, rand(2, 37, 2, 64, dtype=dtype)), dim=2).unbind(2)   # views of one [B, T, 2, H, Dh]
    do = output_gradient(2, 37, 2, 64, dtype, strided=False)
    check_gradients(backward(q, k, v, do), q, k, v, do)


@each_dtype
def test_gradients_written_in_place(dtype):
    # dq, dk, dv: three views of one packed [B, T, 3, H, Dh] gradient (the QKV GEMM output's), NaN-filled, inside a
    # buffer of one more head, which must stay NaN (a store past Dh or past the last head would land there).
    batch, tokens, heads, head_dim = 2, 37, 2, 80
    q, k, v = qkv(batch, tokens, heads, head_dim, dtype)
    do = output_gradient(batch, tokens, heads, head_dim, dtype, strided=False)
    buffer = nan_filled(batch, tokens, 3, heads + 1, head_dim, dtype=dtype)
    packed = buffer[:, :, :, :heads]
    views = packed.unbind(2)
    grads = backward(q, k, v, do, **dict(zip(("dq", "dk", "dv"), views)))
    assert all(g.data_ptr() == t.data_ptr() and g.shape == t.shape for g, t in zip(grads, views))
    assert not packed.isnan().any(), "elements of dq, dk or dv were left unwritten"
    assert buffer[:, :, :, heads].isnan().all(), "elements outside dq, dk and dv were written"
    check_gradients(grads, q, k, v, do)


class _Tf32Matmul(torch.autograd.Function):
    """a @ b with its operands rounded to tf32, and so the two products of its backward: cuBLAS's tf32 matmuls."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return tf32_emulated(a) @ tf32_emulated(b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad = tf32_emulated(grad)
        return grad @ tf32_emulated(b.mT), tf32_emulated(a.mT) @ grad


# PyTorch's attention with tf32 matmuls, forward and backward (the math backend's products, each rounded).
tf32_attention = matmul_attention(matmul=_Tf32Matmul.apply)


def test_tf32_gradients():
    # float32 under torch.set_float32_matmul_precision("high"): held to 1.5x the error of PyTorch's attention on
    # tf32 matmuls, emulated on every device (operands rounded to nearest tf32, as cuBLAS does; which SDPA backend
    # a GPU picks in float32, and whether it uses tf32, is PyTorch's choice).
    q, k, v = qkv(1, 37, 2, 64, torch.float32)
    do = output_gradient(1, 37, 2, 64, torch.float32, strided=True)
    with tf32_matmuls():
        refs = check_gradients(backward(q, k, v, do), q, k, v, do, torch_fn=torch_gradients(attention=tf32_attention))
    # The backward's own products follow the setting: from one exact forward's o and lse, its error with tf32
    # (about 1e-3) is far above its error with exact products (about 1e-7).
    lse = torch.empty(1, 2, 37, device=q.device)
    o = fused_attention(q, k, v, lse=lse)
    with tf32_matmuls():
        tf32_grads = attention_backward(q, k, v, o, lse, do)
    for tf32_grad, exact_grad, ref in zip(tf32_grads, attention_backward(q, k, v, o, lse, do), refs):
        assert rel_err(tf32_grad, ref) > 100 * rel_err(exact_grad, ref)


@pytest.mark.parametrize("batch, tokens, heads, head_dim, dtype, bias_dtype", BIAS_CASES, ids=BIAS_IDS)
def test_bias_gradients(batch, tokens, heads, head_dim, dtype, bias_dtype):
    # dq, dk, dv and the bias's gradient (dS summed over the batch; one image's stored straight), NaN-filled first;
    # with the bias frozen (no dbias), the same dq, dk and dv.
    q, k, v = qkv(batch, tokens, heads, head_dim, dtype)
    bias = rand(heads, tokens, tokens, dtype=bias_dtype)
    do = output_gradient(batch, tokens, heads, head_dim, dtype, strided=True)
    lse = torch.empty(batch, heads, tokens, device=q.device)
    o = fused_attention(q, k, v, bias=bias, lse=lse)
    dbias = nan_filled(heads, tokens, tokens, dtype=torch.float32)
    grads = attention_backward(q, k, v, o, lse, do, bias=bias, dbias=dbias)
    refs = reference(lambda *t: torch_grads(biased_attention, *t), do, q, k, v, bias)
    theirs = torch_grads(biased_attention, do, q, k, v, bias)
    for ours, ref, their in zip((*grads, dbias), refs, theirs):
        assert_close(ours, ref, dtype, their)
    frozen = attention_backward(q, k, v, o, lse, do, bias=bias)
    assert all(torch.equal(a, b) for a, b in zip(frozen, grads))


@pytest.mark.parametrize("change, message", [
    (dict(lse=empty(2, 5, 2)), "lse must have shape (2, 2, 5), got (2, 5, 2)"),
    (dict(lse=empty(2, 2, 5, dtype=torch.bfloat16)), "lse must be torch.float32, got torch.bfloat16"),
    (dict(dbias=empty(2, 5, 5)), "dbias is the gradient of a bias: give the forward's bias too"),
    (dict(bias=empty(2, 5, 5), dbias=empty(2, 5, 5, dtype=torch.bfloat16)),
     "dbias must be torch.float32, got torch.bfloat16"),
    (dict(bias=empty(2, 5, 5), dbias=empty(2, 5, 4)), "dbias must have shape (2, 5, 5), got (2, 5, 4)"),
    (dict(bias=empty(2, 5, 5), dbias=empty(2, 5, 5).transpose(1, 2)),
     "dbias must be contiguous, got strides (25, 1, 5)"),
    (dict(do=empty(2, 4, 2, 32)), "do must have shape (2, 5, 2, 32), got (2, 4, 2, 32)"),
    (dict(do=empty(2, 5, 2, 32, dtype=torch.float16)), "do must be torch.float32, got torch.float16"),
    (dict(o=empty(2, 5, 32, 2).transpose(2, 3)),
     "o must have unit stride along the head dim, got strides (320, 64, 1, 2)"),
    (dict(dq=empty(2, 5, 2, 16)), "dq must have shape (2, 5, 2, 32), got (2, 5, 2, 16)"),
    (dict(q=empty(1, 5, 2, 32).expand(2, -1, -1, -1), dq=empty(2, 5, 2, 32)),
     "dq must have shape (1, 5, 2, 32), got (2, 5, 2, 32)"),
    (dict(dk=empty(2, 5, 2, 32, dtype=torch.bfloat16)), "dk must be torch.float32, got torch.bfloat16"),
    (dict(dv=empty(2, 4, 2, 32)), "dv must have shape (2, 5, 2, 32), got (2, 4, 2, 32)"),
    (dict(scale=0.0), "scale must be positive, got 0.0"),
])
def test_backward_bad_input(change, message):
    args = dict(zip("qkv", qkv(2, 5, 2, 32, torch.float32)), o=empty(2, 5, 2, 32), lse=empty(2, 2, 5),
                do=empty(2, 5, 2, 32), scale=None, dq=None, dk=None, dv=None, bias=None, dbias=None) | change
    inputs = [args.pop(name) for name in ("q", "k", "v", "o", "lse", "do")]
    with raises_value_error(message):
        attention_backward(*inputs, **args)
