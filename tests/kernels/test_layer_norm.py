"""layer_norm against F.layer_norm."""

import pytest
import torch
import torch.nn.functional as F

from tests.numerics import DEVICE, DTYPES, assert_matches_torch
from vit_triton.kernels import layer_norm


def rows(m, d, dtype):
    # A mean offset and a scale, so that a one-pass E[x^2] - E[x]^2 variance would lose digits.
    return (torch.randn(m, d, device=DEVICE) * 3 + 5).to(dtype)


def affine(d, dtype):
    return (torch.randn(d, device=DEVICE) * 0.5 + 1).to(dtype), torch.randn(d, device=DEVICE).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, d, eps", [(1, 32, 1e-6), (197, 80, 1e-12), (37, 768, 1e-6), (45, 1000, 1e-5),
                                       (3, 1024, 1e-6)])
def test_shapes(dtype, m, d, eps):
    torch.manual_seed(m + d)
    assert_matches_torch(lambda x, w, b: layer_norm(x, w, b, eps), lambda x, w, b: F.layer_norm(x, (d,), w, b, eps),
                         rows(m, d, dtype), *affine(d, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows(dtype):
    x = rows(3 * 37, 96, dtype).view(3, 37, 96)[:, 0]          # class tokens: row stride 37 * 96
    assert_matches_torch(lambda x, w, b: layer_norm(x, w, b, 1e-6), lambda x, w, b: F.layer_norm(x, (96,), w, b, 1e-6),
                         x, *affine(96, dtype))


def test_every_element_is_written():
    x, (w, b) = rows(67, 130, torch.float32), affine(130, torch.float32)
    out = torch.full((67, 130), float("nan"), device=DEVICE)
    layer_norm(x, w, b, 1e-6, out=out)
    torch.testing.assert_close(out, F.layer_norm(x, (130,), w, b, 1e-6), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call, match", [
    (lambda x, w, b: layer_norm(x, w[:-1], b, 1e-6), r"weight must have shape \(12,\), got \(11,\)"),
    (lambda x, w, b: layer_norm(x, w, b.half(), 1e-6), r"bias must be torch.float32, got torch.float16"),
    (lambda x, w, b: layer_norm(x[None], w, b, 1e-6), r"x must be 2-D \[M, D\]"),
    (lambda x, w, b: layer_norm(x.t(), w[:5], b[:5], 1e-6), r"unit stride along D"),
    (lambda x, w, b: layer_norm(x, w, b, 1e-6, out=torch.empty(5, 11, device=DEVICE)),
     r"out must have shape \(5, 12\)"),
])
def test_bad_input(call, match):
    x, (w, b) = rows(5, 12, torch.float32), affine(12, torch.float32)
    with pytest.raises(ValueError, match=match):
        call(x, w, b)
