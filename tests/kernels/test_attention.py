"""fused_attention against F.scaled_dot_product_attention, on the strided q/k/v the model passes."""

import pytest
import torch
import torch.nn.functional as F

from tests.numerics import DEVICE, DTYPES, assert_matches_torch
from vit_triton.kernels import fused_attention


def torch_attention(scale=None):
    def fn(qkv):
        q, k, v = qkv.permute(2, 0, 3, 1, 4)                  # [B, H, T, Dh] each
        return F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2)
    return fn


def ours_attention(scale=None):
    return lambda qkv: fused_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], scale=scale)


def qkv(batch, tokens, heads, head_dim, dtype, scale=1.0):
    return (torch.randn(batch, tokens, 3, heads, head_dim, device=DEVICE) * scale).to(dtype)


# Pairs of sequence length and head dim (not the full product, to keep the interpreter quick).
SHAPES = [(1, 1, 2, 64), (3, 37, 2, 32), (1, 197, 3, 64), (3, 197, 1, 80), (1, 257, 2, 96), (3, 50, 2, 128),
          (1, 577, 1, 64), (2, 1025, 1, 32)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch, tokens, heads, head_dim", SHAPES)
def test_shapes(dtype, batch, tokens, heads, head_dim):
    torch.manual_seed(tokens * head_dim + batch)
    assert_matches_torch(ours_attention(), torch_attention(), qkv(batch, tokens, heads, head_dim, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_logits_stay_finite(dtype):
    # Scores in the hundreds: the online softmax must subtract the running max before exp.
    torch.manual_seed(3)
    assert_matches_torch(ours_attention(), torch_attention(), qkv(2, 70, 2, 64, dtype, scale=6.0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_custom_scale(dtype):
    torch.manual_seed(4)
    assert_matches_torch(ours_attention(0.3), torch_attention(0.3), qkv(2, 45, 3, 48, dtype))


def test_contiguous_inputs_and_every_element_written():
    q, k, v = (torch.randn(3, 29, 2, 40, device=DEVICE) for _ in range(3))
    out = torch.full((3, 29, 2, 40), float("nan"), device=DEVICE)
    fused_attention(q, k, v, out=out)
    ref = F.scaled_dot_product_attention(*(t.transpose(1, 2).double() for t in (q, k, v))).transpose(1, 2)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call, match", [
    (lambda q, k, v: fused_attention(q[0], k[0], v[0]), r"q must be 4-D \[B, T, H, Dh\], got shape \(5, 2, 32\)"),
    (lambda q, k, v: fused_attention(q, k[:, :4], v), r"k must have shape \(2, 5, 2, 32\), got \(2, 4, 2, 32\)"),
    (lambda q, k, v: fused_attention(q, k, v.half()), r"v must be torch.float32, got torch.float16"),
    (lambda q, k, v: fused_attention(q[..., :8], k[..., :8], v[..., :8]), r"head dim must be between 16 and 256, got 8"),
    (lambda q, k, v: fused_attention(q.transpose(1, 3).contiguous().transpose(1, 3), k, v),
     r"q must have unit stride along the head dim"),
])
def test_bad_input(call, match):
    q, k, v = (torch.randn(2, 5, 2, 32, device=DEVICE) for _ in range(3))
    with pytest.raises(ValueError, match=match):
        call(q, k, v)
