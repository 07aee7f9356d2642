"""linear: y = act(x @ W^T + b) [+ residual] against F.linear and torch's activations."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from tests.numerics import DEVICE, DTYPES, assert_matches_torch
from vit_triton.kernels import ACTIVATIONS, linear
from vit_triton.model.reference import activation


def torch_linear(act):
    def fn(x, w, b, r):
        y = activation(F.linear(x, w, b), act)
        return y if r is None else y + r
    return fn


def ours_linear(act):
    return lambda x, w, b, r: linear(x, w, b, activation=act, residual=r)


def inputs(m, n, k, dtype, bias=True, residual=True):
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)
    return rand(m, k), rand(n, k, scale=k ** -0.5), rand(n) if bias else None, rand(m, n) if residual else None


EPILOGUES = list(itertools.product((True, False), ACTIVATIONS, (True, False)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias, act, residual", EPILOGUES)
def test_every_epilogue(dtype, bias, act, residual):
    torch.manual_seed(len(EPILOGUES) * DTYPES.index(dtype) + EPILOGUES.index((bias, act, residual)))
    assert_matches_torch(ours_linear(act), torch_linear(act), *inputs(37, 45, 53, dtype, bias, residual))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m, n, k", [(1, 7, 3), (3 * 197, 3 * 96, 96), (257, 160, 96), (111, 1000, 64), (5, 96, 384)])
def test_odd_shapes(dtype, m, n, k):
    torch.manual_seed(m * n + k)
    assert_matches_torch(ours_linear("gelu"), torch_linear("gelu"), *inputs(m, n, k, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_output_scale_applies_after_the_residual(dtype):
    torch.manual_seed(11)
    assert_matches_torch(lambda x, w, b, r: linear(x, w, b, activation="gelu", residual=r, scale=0.5),
                         lambda x, w, b, r: 0.5 * torch_linear("gelu")(x, w, b, r), *inputs(29, 40, 33, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_rows_are_read_in_place(dtype):
    # The class tokens of a [B, T, D] tensor: a [B, D] view with row stride T*D; the residual too.
    tokens = torch.randn(3, 37, 48, device=DEVICE).to(dtype)
    res = torch.randn(3, 5, 24, device=DEVICE).to(dtype)[:, 2]
    w, b = (torch.randn(24, 48, device=DEVICE) / 7).to(dtype), torch.randn(24, device=DEVICE).to(dtype)
    assert_matches_torch(ours_linear("quick_gelu"), torch_linear("quick_gelu"), tokens[:, 0], w, b, res)


def test_tf32_path():
    torch.manual_seed(1)
    x, w, b, _ = inputs(65, 72, 80, torch.float32, residual=False)
    out = linear(x, w, b, allow_tf32=True)
    ref = F.linear(x.double(), w.double(), b.double())
    rel = ((out.double() - ref).norm() / ref.norm()).item()
    # tf32 keeps 10 mantissa bits: ~1e-3 relative at most; exact fp32 on the CPU interpreter.
    assert rel < (2e-3 if DEVICE.type == "cuda" else 1e-5)


def test_every_element_is_written():
    x, w, b, r = inputs(70, 33, 40, torch.float32)
    out = torch.full((70, 33), float("nan"), device=DEVICE)
    linear(x, w, b, activation="gelu", residual=r, out=out)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch_linear("gelu")(x, w, b, r), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call, match", [
    (lambda x, w, b: linear(x, w.to(torch.bfloat16), b), r"weight must be torch.float32, got torch.bfloat16"),
    (lambda x, w, b: linear(x, w[:, :-1], b), r"weight must have shape \(6, 8\), got \(6, 7\)"),
    (lambda x, w, b: linear(x, w, b[:-1]), r"bias must have shape \(6,\), got \(5,\)"),
    (lambda x, w, b: linear(x[None], w, b), r"x must be 2-D \[M, K\]"),
    (lambda x, w, b: linear(x.t().contiguous().t(), w, b), r"unit stride along K"),
    (lambda x, w, b: linear(x, w, b, activation="relu"), r"activation must be one of \('none', 'gelu'"),
    (lambda x, w, b: linear(x, w, b, residual=torch.zeros(5, 7, device=DEVICE)), r"residual must have shape \(5, 6\)"),
    (lambda x, w, b: linear(x.long(), w, b), r"x must be float32, float16 or bfloat16, got torch.int64"),
])
def test_bad_input(call, match):
    x, w, b, _ = inputs(5, 6, 8, torch.float32)
    with pytest.raises(ValueError, match=match):
        call(x, w, b)
