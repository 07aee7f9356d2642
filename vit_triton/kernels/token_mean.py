"""Mean over tokens: y[b] = mean(x[b, start:T]) for x [B, T, D], the "avg" pooling of a ViT.

Layout: x [B, T, D] with unit stride along D (any batch/token stride); y [B, D] contiguous.
Program (b, j) sums BLOCK_T-token tiles of its BLOCK_D columns in fp32, TILE elements a step: 256 columns by 16
tokens, or, where B * D / 256 programs would leave SMs idle (one image), 64 columns by 64 tokens, four times the
programs each walking a quarter of the steps (one EVA02-B/14 @ 448 image: 12 programs of 16 steps, not 3 of 64).

Cost: B*(T-start)*D adds; at least B*(T-start)*D + B*D elements moved (memory-bound).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import cast, check_device, check_float, pdl, sm_count, start_next_kernel, wait_for_previous_kernel

TILE = 4096   # elements a program loads a step


@triton.jit
def _token_mean_kernel(
    x_ptr, y_ptr, T, D, start, s_xb, s_xt, s_yb,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    b = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    toks = tl.arange(0, BLOCK_T)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for t0 in range(start, T, BLOCK_T):
        t = t0 + toks
        mask = (t < T)[:, None] & (cols < D)[None, :]
        acc += tl.load(x_ptr + b * s_xb + t[:, None] * s_xt + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    start_next_kernel(PDL)
    y = tl.sum(acc, axis=0) / (T - start)
    tl.store(y_ptr + b * s_yb + cols, cast(y, y_ptr.dtype.element_ty), mask=cols < D)


def token_mean(x: torch.Tensor, start: int = 0, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Mean of x [B, T, D] over tokens start..T-1; returns [B, D]."""
    check_device(x, out)
    check_float("x", x)
    if x.dim() != 3 or x.stride(2) != 1:
        raise ValueError(f"x must be 3-D [B, T, D] with unit stride along D, got shape {tuple(x.shape)} "
                         f"and strides {x.stride()}")
    B, T, D = x.shape
    if not 0 <= start < T:
        raise ValueError(f"start must be in [0, {T}), got {start}")
    if out is None:
        out = torch.empty((B, D), device=x.device, dtype=x.dtype)
    elif tuple(out.shape) != (B, D) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be a {x.dtype} tensor of shape ({B}, {D}) with unit stride along D")
    block_d = column_block(B, D, x.device)
    _token_mean_kernel[(B, triton.cdiv(D, block_d))](
        x, out, T, D, start, x.stride(0), x.stride(1), out.stride(0),
        BLOCK_T=TILE // block_d, BLOCK_D=block_d, num_warps=4, **pdl(x.device, B * triton.cdiv(D, block_d)),
    )
    return out


def column_block(B: int, D: int, device: torch.device) -> int:
    """The columns a program averages: 256 (fewer where D is less), or 64 where B * D / 256 programs would not give
    every SM one."""
    wide = min(256, triton.next_power_of_2(D))
    return wide if B * triton.cdiv(D, wide) >= sm_count(device) else min(64, wide)
