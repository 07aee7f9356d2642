"""LayerNorm over the last dimension: y = (x - mean) / sqrt(var + eps) * weight + bias, or RMSNorm (rms):
y = x / sqrt(mean(x^2) + eps) * weight + bias, no mean subtracted; either without bias (None). Optionally
after adding to x the K-slice partial sums of a split GEMM (add_layer_norm); optionally with a table of rows added
to y after the norm, repeating every R rows (layer_norm's post_add: the same R rows for each of M / R groups).

Layout: x [M, D] with unit stride along D (any row stride); weight, bias [D]; y [M, D] contiguous;
parts [S, M, D] fp32 contiguous; post_add [R, D] contiguous.
Each program normalises BLOCK_M rows held whole in registers: one read of x, one write of y;
mean and variance (or mean square) are computed in fp32 from the registers (two-pass, no E[x^2] - E[x]^2).
Programs take the last rows first: the GEMM that wrote x wrote them last, so they are the ones still in L2.
add_layer_norm first forms x + parts[0] + ... + parts[S-1] in fp32, rounds it once to x's dtype,
writes it (the updated residual stream) and normalises that: the residual add of a split GEMM
(linear_partials) costs no kernel of its own.

Cost: about 8*M*D FLOPs (RMSNorm about 5*M*D); (2*M*D + 2*D) elements moved (D fewer without bias), so always
memory-bound; add_layer_norm moves another M*D elements and S*M*D fp32 partial sums; post_add another R*D.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    cast, check_device, check_dtype, check_float, check_shape, input_precision, pdl, start_next_kernel, to_tf32,
    wait_for_previous_kernel,
)


@triton.jit(do_not_specialize=["y_tf32"])
def _layer_norm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    parts_ptr, sum_ptr,   # add_layer_norm only: the partial sums [NUM_PARTS, M, D], x + their sum [M, D]
    add_ptr, add_rows,   # HAS_ADD: the table [add_rows, D] whose row m % add_rows is added to y's row m
    M, D, stride_xm, stride_ym, eps,
    y_tf32,   # 1: a float32 y stored rounded to tf32
    HAS_BIAS: tl.constexpr, RMS: tl.constexpr,   # RMS: x / sqrt(mean(x^2) + eps), no mean subtracted
    HAS_ADD: tl.constexpr,
    NUM_PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    # Last rows first: the GEMM before wrote them last, so at large batch they are the ones still in L2.
    rows = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    mask_d = cols < D
    mask = (rows < M)[:, None] & mask_d[None, :]
    rows = rows.to(tl.int64)[:, None]
    x = tl.load(x_ptr + rows * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if NUM_PARTS:
        for s in tl.static_range(NUM_PARTS):
            x += tl.load(parts_ptr + (s * M + rows) * D + cols[None, :], mask=mask, other=0.0)
        x = cast(x, sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + rows * D + cols[None, :], x, mask=mask)
        x = x.to(tl.float32)   # normalise the stream as stored, as the unsplit model does
    if RMS:
        diff = x   # zero past D already
    else:
        mean = tl.sum(x, axis=1) / D
        diff = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=1) / D + eps)
    w = tl.load(w_ptr + cols, mask=mask_d, other=0.0).to(tl.float32)
    y = diff * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + cols, mask=mask_d, other=0.0).to(tl.float32)[None, :]
    if HAS_ADD:
        y += tl.load(add_ptr + rows % add_rows * D + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if y_ptr.dtype.element_ty == tl.float32:
        # y_tf32 is read at run time, so that the rounded y is the unrounded one's rounding bit for bit. Two
        # builds of this kernel may fuse different products of the sum of squares into FMAs (d0*d0 + d1*d1
        # as fma(d0, d0, d1*d1) or fma(d1, d1, d0*d0)), and one y in about 10^5 then rounds the other way.
        y = tl.where(y_tf32 != 0, to_tf32(y), y)
    start_next_kernel(PDL)
    tl.store(y_ptr + rows * stride_ym + cols[None, :], cast(y, y_ptr.dtype.element_ty), mask=mask)


def layer_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    *,
    rms: bool = False,
    tf32_output: bool = False,
    post_add: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """LayerNorm of each row of a 2-D x [M, D] (unit stride along D) with weight, bias [D] (bias None: none added);
    rms: RMSNorm instead, x / sqrt(mean(x^2) + eps) * weight (+ bias), as F.rms_norm but in fp32 throughout.
    post_add [R, D] (R dividing M, x's dtype): added to the normalised rows, row m getting post_add[m % R], in
    fp32 before the one rounding (a table of R rows shared by each group of R rows of x).
    tf32_output: the result is read only as a matmul operand; with float32 matmuls on tf32 it is stored
    rounded to tf32 (tf32.py)."""
    check_device(x, weight, bias, post_add, out)
    _check(x, weight, bias)
    M, D = x.shape
    if post_add is not None:
        check_dtype("post_add", post_add, x.dtype)
        if post_add.dim() != 2 or post_add.shape[1] != D or post_add.shape[0] == 0 or M % post_add.shape[0]:
            raise ValueError(f"post_add must be [R, {D}] with R dividing the {M} rows of x, got shape "
                             f"{tuple(post_add.shape)}")
    if out is None:
        out = torch.empty((M, D), device=x.device, dtype=x.dtype)
    else:
        check_shape("out", out, (M, D))
        check_dtype("out", out, x.dtype)
        if out.stride(1) != 1:
            raise ValueError(f"out must have unit stride along D, got strides {out.stride()}")
    _launch(x, weight, bias, out, eps, rms, None, None, tf32_output, post_add)
    return out


def add_layer_norm(
    x: torch.Tensor,
    parts: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    eps: float,
    *,
    rms: bool = False,
    tf32_output: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(s, LayerNorm(s)) for s = x + parts.sum(0), summed in fp32 and rounded once to x's dtype; x [M, D]
    (unit stride along D), parts [S, M, D] float32 (linear_partials' output), weight, bias [D] or None.
    rms, tf32_output: as layer_norm's, for the norm (s is stored as summed)."""
    check_device(x, parts, weight, bias)
    _check(x, weight, bias)
    M, D = x.shape
    if parts.dim() != 3 or tuple(parts.shape[1:]) != (M, D):
        raise ValueError(f"parts must have shape [S, {M}, {D}], got {tuple(parts.shape)}")
    check_dtype("parts", parts, torch.float32)
    total = torch.empty((M, D), device=x.device, dtype=x.dtype)
    out = torch.empty_like(total)
    _launch(x, weight, bias, out, eps, rms, parts.contiguous(), total, tf32_output)
    return total, out


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_float("x", x)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D [M, D] with unit stride along D, got shape {tuple(x.shape)} "
                         f"and strides {x.stride()}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_shape(name, t, (x.shape[1],))
            check_dtype(name, t, x.dtype)


def _launch(x, weight, bias, out, eps: float, rms: bool, parts: torch.Tensor | None, total: torch.Tensor | None,
            tf32_output: bool, post_add: torch.Tensor | None = None) -> None:
    M, D = x.shape
    block_d = triton.next_power_of_2(D)
    # About 2K elements a program: several rows when D is small, two at ViT-B's 768 (one image's 197 rows
    # then spread over 99 programs, not 50: 1.03x the forward at 1-2 images).
    block_m = max(1, min(2048 // block_d, triton.next_power_of_2(M)))
    num_warps = min(16, max(1, block_m * block_d // 512))
    _layer_norm_kernel[(triton.cdiv(M, block_m),)](
        x, weight.contiguous(), None if bias is None else bias.contiguous(), out, parts, total,
        None if post_add is None else post_add.contiguous(), 1 if post_add is None else post_add.shape[0],
        M, D, x.stride(0), out.stride(0), eps, int(tf32_output and input_precision(x.dtype, None) == "tf32"),
        HAS_BIAS=bias is not None, RMS=rms, HAS_ADD=post_add is not None,
        NUM_PARTS=0 if parts is None else parts.shape[0],
        BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps, **pdl(x.device, triton.cdiv(M, block_m)),
    )
