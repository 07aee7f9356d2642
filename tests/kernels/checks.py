"""What every kernel test does: fresh random inputs on DEVICE, a float64 reference on the CPU from
the very same (already rounded) inputs, PyTorch's own result in the inputs' precision on DEVICE,
and the docs/design.md tolerance between them."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

from tests.numerics import DEVICE, DTYPES, LOW_PRECISION_FACTOR, assert_close, rel_err

# @each_dtype on a test runs it once per dtype, with readable ids ("float32", "bfloat16", "float16").
each_dtype = pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))


def rand(*shape: int, dtype: torch.dtype, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    """N(shift, scale^2) on DEVICE, rounded to dtype."""
    return (torch.randn(*shape, device=DEVICE) * scale + shift).to(dtype)


def nan_filled(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    """An out= buffer that shows any element a kernel forgets to write."""
    return torch.full(shape, float("nan"), device=DEVICE, dtype=dtype)


def reference(torch_fn, *inputs: torch.Tensor | None) -> torch.Tensor:
    """torch_fn on float64 CPU copies of the inputs (None and non-float inputs pass through)."""
    return torch_fn(*(t.to("cpu", torch.float64) if t is not None and t.is_floating_point() else t
                      for t in inputs))


def assert_like_torch(out: torch.Tensor, ref: torch.Tensor, torch_out: torch.Tensor) -> None:
    """The 16-bit rule in any precision: out's error at most 1.5x PyTorch's own, never NaN or Inf."""
    err, torch_err = rel_err(out, ref), rel_err(torch_out, ref)
    assert err <= LOW_PRECISION_FACTOR * torch_err, (
        f"{out.dtype}: relative error {err:.3e} > {LOW_PRECISION_FACTOR} x PyTorch's {torch_err:.3e}")


def check(out: torch.Tensor, torch_fn, *inputs: torch.Tensor | None) -> torch.Tensor:
    """out, our kernel's result from `inputs`, against torch_fn: float64 on the CPU for the reference,
    and torch_fn(*inputs) on DEVICE in out's precision for the 16-bit tolerance. Returns out."""
    assert_close(out, reference(torch_fn, *inputs), out.dtype, torch_fn(*inputs))
    return out


def torch_grads(fn, dy, *inputs):
    """The gradients of fn(*inputs) . dy with respect to each input, through torch autograd (None for a None input)."""
    leaves = [None if t is None else t.detach().requires_grad_() for t in inputs]
    fn(*leaves).backward(dy)
    return [None if t is None else t.grad for t in leaves]


def check_grads(grads, fn, dy, *inputs):
    """Our gradients (one per input, None: not checked) of fn(*inputs) against dy, each held to the tolerance rule:
    torch autograd on float64 CPU copies of the very same dy and inputs for the reference, and on the inputs as they
    are for PyTorch's own error in their precision."""
    references = reference(lambda *args: torch_grads(fn, *args), dy, *inputs)
    for i, (ours, ref, torch_grad) in enumerate(zip(grads, references, torch_grads(fn, dy, *inputs))):
        if ours is not None:
            assert ours.shape == ref.shape and ours.dtype == inputs[i].dtype, (i, ours.shape, ours.dtype)
            try:
                assert_close(ours, ref, ours.dtype, torch_grad)
            except AssertionError as error:
                raise AssertionError(f"gradient of input {i}: {error}") from None


@contextlib.contextmanager
def tf32_matmuls():
    """PyTorch's float32 matmuls on tf32 tensor cores (allow_tf32) for the duration."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


# Where a tf32 GEMM gets its weight rounded (kernels/tf32.py): the copy kept with the weight, or, for an
# inference tensor (no version counter, so no copy is kept), in the K loop below TF32_WEIGHT_ROWS rows
# and rounded for the call from there on. large: the product has at least TF32_WEIGHT_ROWS rows.
TF32_WEIGHT_PATHS = pytest.mark.parametrize("large, inference_weight", [(False, False), (False, True), (True, True)],
                                            ids=["weight-copy-kept", "weight-rounded-in-kernel",
                                                 "weight-rounded-for-the-call"])


def inference(t: torch.Tensor) -> torch.Tensor:
    """A copy of t made in inference mode: it has no version counter, so no tf32 copy is kept of it."""
    with torch.inference_mode():
        return t.clone()


def tf32_emulated(t: torch.Tensor) -> torch.Tensor:
    """float32 rounded to 10 mantissa bits, ties away from zero: PyTorch's tf32 operands on a machine
    without tf32 (the CPU), as cuBLAS rounds them."""
    bits = t.contiguous().view(torch.int32)
    return ((bits + 0x1000) & -0x2000).view(torch.float32)


def assert_written_in_place(result: torch.Tensor, out: torch.Tensor, buffer: torch.Tensor) -> None:
    """result is the out= view, every element of it written, and nothing of `buffer` outside it."""
    assert result.data_ptr() == out.data_ptr() and result.shape == out.shape
    assert not out.isnan().any(), "elements of out were left unwritten"
    assert buffer.isnan().sum() == buffer.numel() - out.numel(), "elements outside out were written"


def empty(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A tensor whose values no test reads: the bad-input cases, rejected before any launch."""
    return torch.empty(*shape, device=DEVICE, dtype=dtype)


def raises_value_error(message: str):
    """pytest.raises for a ValueError whose message contains `message` word for word."""
    return pytest.raises(ValueError, match=re.escape(message))
