"""Mean over tokens: y[b] = mean(x[b, start:T]) for x [B, T, D], the "avg" pooling of a ViT; and its backward,
dx[b, t] = dy[b] / (T - start) for t >= start, 0 before.

Layout: x [B, T, D] with unit stride along D (any batch/token stride); y [B, D] contiguous.
Program (b, j) sums BLOCK_T-token tiles of its BLOCK_D columns in fp32, TILE elements a step: 256 columns by 16
tokens, or, where B * D / 256 programs would leave SMs idle (one image), 64 columns by 64 tokens, four times the
programs each walking a quarter of the steps (one EVA02-B/14 @ 448 image: 12 programs of 16 steps, not 3 of 64).
Backward: dy [B, D] with unit stride along D; dx [B, T, D] (contiguous, or any batch/token stride), one program a
TILE of it (BLOCK_T tokens by BLOCK_D columns of one image), each reading its BLOCK_D values of dy once.

Cost: B*(T-start)*D adds; at least B*(T-start)*D + B*D elements moved (memory-bound). Backward: B*D divisions;
B*D elements read and B*T*D written (memory-bound).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import (
    cast, cdiv, check_device, check_float, next_power_of_2, pdl, sm_count, start_next_kernel, wait_for_previous_kernel,
)

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


@triton.jit
def _token_mean_backward_kernel(
    dy_ptr, dx_ptr, T, D, start, s_dyb, s_dxb, s_dxt,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    b = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = cols < D
    g = tl.load(dy_ptr + b * s_dyb + cols, mask=mask_d, other=0.0).to(tl.float32) / (T - start)
    # The prefix tokens (t < start) were not in the mean: their gradient is 0, written here too.
    dx = tl.where((t >= start)[:, None], g[None, :], 0.0)
    start_next_kernel(PDL)
    tl.store(dx_ptr + b * s_dxb + t[:, None] * s_dxt + cols[None, :], cast(dx, dx_ptr.dtype.element_ty),
             mask=(t < T)[:, None] & mask_d[None, :])


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
    _token_mean_kernel[(B, cdiv(D, block_d))](
        x, out, T, D, start, x.stride(0), x.stride(1), out.stride(0),
        BLOCK_T=TILE // block_d, BLOCK_D=block_d, num_warps=4, **pdl(x.device, B * cdiv(D, block_d)),
    )
    return out


def token_mean_backward(dy: torch.Tensor, tokens: int, start: int, *, dx: torch.Tensor | None = None) -> torch.Tensor:
    """The gradient of token_mean(x, start) for x of `tokens` tokens, from dy [B, D] (unit stride along D):
    dx [B, tokens, D] in dy's dtype, dy[b] / (tokens - start) at every token from start on and 0 before. A new
    contiguous tensor, or `dx` when given (unit stride along D, any batch and token strides)."""
    check_device(dy, dx)
    check_float("dy", dy)
    if dy.dim() != 2 or dy.stride(1) != 1:
        raise ValueError(f"dy must be 2-D [B, D] with unit stride along D, got shape {tuple(dy.shape)} "
                         f"and strides {dy.stride()}")
    B, D = dy.shape
    if not 0 <= start < tokens:
        raise ValueError(f"start must be in [0, {tokens}), got {start}")
    if dx is None:
        dx = torch.empty((B, tokens, D), device=dy.device, dtype=dy.dtype)
    elif tuple(dx.shape) != (B, tokens, D) or dx.dtype != dy.dtype or dx.stride(2) != 1:
        raise ValueError(f"dx must be a {dy.dtype} tensor of shape ({B}, {tokens}, {D}) with unit stride along D")
    block_d = min(256, next_power_of_2(D))
    block_t = min(TILE // block_d, next_power_of_2(tokens))
    grid = (B, cdiv(tokens, block_t), cdiv(D, block_d))
    _token_mean_backward_kernel[grid](
        dy, dx, tokens, D, start, dy.stride(0), dx.stride(0), dx.stride(1),
        BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4, **pdl(dy.device, math.prod(grid)),
    )
    return dx


def column_block(B: int, D: int, device: torch.device) -> int:
    """The columns a program averages: 256 (fewer where D is less), or 64 where B * D / 256 programs would not give
    every SM one."""
    wide = min(256, next_power_of_2(D))
    return wide if B * cdiv(D, wide) >= sm_count(device) else min(64, wide)
