"""Test-side helpers around the package's tolerance rule (vit_triton.bench.numerics)."""

from __future__ import annotations

from functools import partial

import torch

from vit_triton.bench import numerics
from vit_triton.bench.numerics import FP32_TOL, LOW_PRECISION_FACTOR, rel_err, tolerance

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

__all__ = ["DEVICE", "DTYPES", "FP32_TOL", "LOW_PRECISION_FACTOR", "assert_close", "randomize_", "rel_err"]


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype,
                 torch_out: torch.Tensor | None = None) -> None:
    """out within the docs/design.md tolerance of the float64 ref; torch_out is PyTorch's own 16-bit result."""
    err = rel_err(out, ref)
    tol = tolerance(dtype, None if torch_out is None else rel_err(torch_out, ref))
    assert err <= tol, f"{dtype}: relative error {err:.3e} > tolerance {tol:.3e}"


# Tests perturb twice as hard as the package's default (0.05): LayerNorm weights further from 1.
randomize_ = partial(numerics.randomize_, scale=0.1)
