"""The tolerance rule of docs/design.md, shared by `vit-triton verify`, the GPU check and the tests.

Relative Frobenius error ||out - ref|| / ||ref|| against a float64 reference computed from the
very same inputs. float32 (tf32 off): at most 1e-5. float16/bfloat16, and float32 with tf32: at
most 1.5x the error of PyTorch's own implementation in that precision. NaN or Inf never passes.
"""

from __future__ import annotations

import torch

FP32_TOL = 1e-5
LOW_PRECISION_FACTOR = 1.5


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when out holds NaN or Inf."""
    if out.shape != ref.shape:
        raise ValueError(f"shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    out = out.detach().double()
    ref = ref.detach().to(device=out.device, dtype=torch.float64)
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm()).item()


def tolerance(dtype: torch.dtype, torch_err: float | None) -> float:
    """The error a result in `dtype` may show: 1e-5 in float32 with exact matmuls, else (16-bit, or
    float32 while torch.get_float32_matmul_precision() allows tf32) 1.5x PyTorch's own error."""
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return FP32_TOL
    if torch_err is None:
        raise ValueError("16-bit and tf32 checks need PyTorch's own error in the same precision")
    return LOW_PRECISION_FACTOR * torch_err


def randomize_(module: torch.nn.Module, scale: float = 0.05, seed: int | None = None) -> torch.nn.Module:
    """Add N(0, scale^2) noise to every parameter, in place: random weights with no LayerNorm left at
    1 and no bias or token at 0 (a default initialisation hides indexing and epilogue bugs)."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    with torch.no_grad():
        for p in module.parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            p.add_((noise * scale).to(device=p.device, dtype=p.dtype))
    return module
