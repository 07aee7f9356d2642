"""The tolerance rule of DESIGN.md, shared by all tests.

Relative Frobenius error ||out - ref|| / ||ref|| against a float64 reference (computed on the
CPU from the very same inputs). float32 (tf32 off): at most 1e-5. float16/bfloat16: at most 1.5x
the error of PyTorch's own implementation in that precision. NaN or Inf never passes.
"""

from __future__ import annotations

import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP32_TOL = 1e-5
LOW_PRECISION_FACTOR = 1.5


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.detach().cpu().double()
    ref = ref.detach().cpu().double()
    if out.shape != ref.shape:
        raise AssertionError(f"shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


def tolerance(dtype: torch.dtype, torch_out: torch.Tensor | None, ref: torch.Tensor) -> float:
    """The error our result may show: 1e-5 in float32, else 1.5x PyTorch's error in `dtype`."""
    if dtype == torch.float32:
        return FP32_TOL
    assert torch_out is not None, "16-bit checks need PyTorch's result in the same precision"
    return LOW_PRECISION_FACTOR * rel_err(torch_out, ref)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype,
                 torch_out: torch.Tensor | None = None) -> None:
    err, tol = rel_err(out, ref), tolerance(dtype, torch_out, ref)
    assert err <= tol, f"{dtype}: relative error {err:.3e} > tolerance {tol:.3e}"


def randomize_(module: torch.nn.Module, scale: float = 0.1, seed: int | None = None) -> torch.nn.Module:
    """Perturb every parameter so no LayerNorm weight is 1 and no bias 0 (default init hides bugs)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    with torch.no_grad():
        for p in module.parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.add_((noise * scale).to(device=p.device, dtype=p.dtype))
    return module
