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

For training, layer_norm(..., stats=) also stores each row's mean and rstd = 1 / sqrt(var + eps) as used (fp32
[2, M]), and layer_norm_backward takes dy back to dx, dweight, dbias and the post_add table's gradient in one pass
over dy and x, whole rows in registers as in the forward. A row's dx needs two means over its own row; dweight
and dbias are sums over all rows, taken in two stages, as in Triton's layer-norm tutorial but without its locks:
each program (about 4 an SM) adds its rows into fp32 registers and stores them once as a row of partial sums
[programs, D], which torch then sums. No atomics, so the same inputs give the same bits on every run.

Cost: about 8*M*D FLOPs (RMSNorm about 5*M*D); (2*M*D + 2*D) elements moved (D fewer without bias), so always
memory-bound; add_layer_norm moves another M*D elements and S*M*D fp32 partial sums; post_add another R*D; stats
2*M fp32. Backward: about 12*M*D FLOPs; 3*M*D elements (dy, x read, dx written) + 2*M fp32 stats + D weights
moved, and 2 fp32 partial sums [programs, D] (post_add: [S, R, D], S the programs along a row of groups).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import (
    cast, cdiv, check_device, check_dtype, check_float, check_shape, input_precision, next_power_of_2, pdl, sm_count,
    start_next_kernel, to_tf32, wait_for_previous_kernel,
)


@triton.jit(do_not_specialize=["y_tf32"])
def _layer_norm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr,
    parts_ptr, sum_ptr,   # add_layer_norm only: the partial sums [NUM_PARTS, M, D], x + their sum [M, D]
    add_ptr, add_rows,   # HAS_ADD: the table [add_rows, D] whose row m % add_rows is added to y's row m
    stats_ptr,   # HAS_STATS: [2, M] fp32, each row's mean (0 for RMS) and rstd as used, for the backward
    M, D, stride_xm, stride_ym, eps,
    y_tf32,   # 1: a float32 y stored rounded to tf32
    HAS_BIAS: tl.constexpr, RMS: tl.constexpr,   # RMS: x / sqrt(mean(x^2) + eps), no mean subtracted
    HAS_ADD: tl.constexpr, HAS_STATS: tl.constexpr,
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
    if HAS_STATS:
        if RMS:
            mean = tl.zeros_like(rstd)
        tl.store(stats_ptr + rows, mean[:, None], mask=rows < M)
        tl.store(stats_ptr + M + rows, rstd[:, None], mask=rows < M)


@triton.jit
def _layer_norm_backward_kernel(
    dy_ptr, x_ptr, w_ptr, stats_ptr, dx_ptr,
    dw_ptr,   # NEED_DW: each program's fp32 sum over its rows of dy * xhat, [programs, D]
    dsum_ptr,   # SUM_DY: each program's fp32 sum over its rows of dy, [programs, D]; PER_ROW: [S, R, D]
    M, D, R, stride_dym, stride_xm, stride_dxm,
    RMS: tl.constexpr, NEED_DX: tl.constexpr, NEED_DW: tl.constexpr, SUM_DY: tl.constexpr, PER_ROW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    # The rows as cdiv(M, R) groups of R: program (i, s) takes rows i*BLOCK_M .. i*BLOCK_M + BLOCK_M - 1 of groups
    # s, s + S, s + 2S, ... (S programs along axis 1), so a row r of every group it visits stays in one place of its
    # accumulators: summed over the rows at the end for weight and bias, or kept per row (PER_ROW) for the table
    # that the forward added to row r of each group (post_add).
    wait_for_previous_kernel(PDL)
    r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    mask_d = cols < D
    if NEED_DX:
        w = tl.load(w_ptr + cols, mask=mask_d, other=0.0).to(tl.float32)
    dw_acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    dsum_acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for g in range(tl.program_id(1), tl.cdiv(M, R), tl.num_programs(1)):
        rows = (g * R + r).to(tl.int64)
        mask_m = (r < R) & (rows < M)
        mask = mask_m[:, None] & mask_d[None, :]
        dy = tl.load(dy_ptr + rows[:, None] * stride_dym + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if NEED_DX or NEED_DW:
            x = tl.load(x_ptr + rows[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            rstd = tl.load(stats_ptr + M + rows, mask=mask_m, other=0.0)[:, None]
            if RMS:
                xhat = x * rstd
            else:
                mean = tl.load(stats_ptr + rows, mask=mask_m, other=0.0)[:, None]
                xhat = tl.where(mask, (x - mean) * rstd, 0.0)
            if NEED_DX:
                wdy = dy * w[None, :]
                dx = wdy - xhat * (tl.sum(wdy * xhat, axis=1) / D)[:, None]
                if not RMS:
                    dx -= (tl.sum(wdy, axis=1) / D)[:, None]
                tl.store(dx_ptr + rows[:, None] * stride_dxm + cols[None, :], cast(dx * rstd, dx_ptr.dtype.element_ty),
                         mask=mask)
            if NEED_DW:
                dw_acc += dy * xhat
        if SUM_DY:
            dsum_acc += dy
    start_next_kernel(PDL)
    program = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    if NEED_DW:
        tl.store(dw_ptr + program * D + cols, tl.sum(dw_acc, axis=0), mask=mask_d)
    if SUM_DY:
        if PER_ROW:
            rows = (tl.program_id(1) * R + r).to(tl.int64)
            tl.store(dsum_ptr + rows[:, None] * D + cols[None, :], dsum_acc, mask=(r < R)[:, None] & mask_d[None, :])
        else:
            tl.store(dsum_ptr + program * D + cols, tl.sum(dsum_acc, axis=0), mask=mask_d)


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
    stats: torch.Tensor | None = None,
) -> torch.Tensor:
    """LayerNorm of each row of a 2-D x [M, D] (unit stride along D) with weight, bias [D] (bias None: none added);
    rms: RMSNorm instead, x / sqrt(mean(x^2) + eps) * weight (+ bias), as F.rms_norm but in fp32 throughout.
    post_add [R, D] (R dividing M, x's dtype): added to the normalised rows, row m getting post_add[m % R], in
    fp32 before the one rounding (a table of R rows shared by each group of R rows of x).
    tf32_output: the result is read only as a matmul operand; with float32 matmuls on tf32 it is stored
    rounded to tf32 (tf32.py).
    stats: a float32 contiguous [2, M] tensor that also receives each row's mean (row 0; 0 for RMSNorm) and
    1 / sqrt(var + eps) (row 1) as the norm used them, for layer_norm_backward."""
    check_device(x, weight, bias, post_add, out, stats)
    _check(x, weight, bias)
    M, D = x.shape
    if stats is not None:
        _check_stats(stats, M)
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
    _launch(x, weight, bias, out, eps, rms, None, None, tf32_output, post_add, stats)
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


def layer_norm_backward(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    stats: torch.Tensor,
    *,
    rms: bool = False,
    has_bias: bool = True,
    post_add_rows: int = 0,
    need_dx: bool = True,
    need_dweight: bool = True,
    need_dbias: bool = True,
    dx: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dweight, dbias, dpost_add): the gradients of layer_norm(x, weight, bias, eps, rms=rms, post_add=...)
    from the gradient dy [M, D] of its output (unit stride along D), x [M, D] as the forward read it, weight [D],
    and the forward's stats [2, M]. With xhat = (x - mean) * rstd (mean 0 for RMSNorm) and g = weight * dy:

        dx = rstd * (g - mean_D(g) - xhat * mean_D(g * xhat))    (RMSNorm: without mean_D(g))
        dweight = sum over rows of dy * xhat,   dbias = sum over rows of dy,
        dpost_add [R, D] (post_add_rows = R > 0): row r the sum of dy over the rows m with m % R == r.

    dx in x's dtype (into `dx` when given: [M, D] with unit stride along D; it may be dy itself, each row of dy is
    read before its dx is written); the others in weight's dtype, summed in fp32 by each program over its rows, then
    over the programs (deterministic: no atomics). None for what need_* does not ask for (dbias also without
    has_bias), and no work is done for it; dpost_add is None without post_add_rows."""
    check_device(dy, x, weight, stats, dx)
    _check(x, weight, None)
    M, D = x.shape
    check_dtype("dy", dy, x.dtype)
    check_shape("dy", dy, (M, D))
    if dy.stride(1) != 1:
        raise ValueError(f"dy must have unit stride along D, got strides {dy.stride()}")
    _check_stats(stats, M)
    if post_add_rows < 0 or (post_add_rows and M % post_add_rows):
        raise ValueError(f"post_add_rows must be 0 or divide the {M} rows of x, got {post_add_rows}")
    need_dbias = need_dbias and has_bias
    if dx is not None:
        check_shape("dx", dx, (M, D))
        check_dtype("dx", dx, x.dtype)
        if dx.stride(1) != 1:
            raise ValueError(f"dx must have unit stride along D, got strides {dx.stride()}")
    elif need_dx:
        dx = torch.empty((M, D), device=x.device, dtype=x.dtype)
    if not (need_dx or need_dweight or need_dbias or post_add_rows):
        return None, None, None, None
    block_d = next_power_of_2(D)
    # As the forward: about 2K elements a row block. The groups of rows (the kernel's R) are the post_add table's
    # when there is one; else a group is as many row blocks as there are programs, so that each program walks the
    # rows with a stride of the launch's width and all get the same number of row blocks, give or take one.
    block_m = max(1, min(2048 // block_d, next_power_of_2(post_add_rows or M)))
    most = 4 * sm_count(x.device)   # programs: enough loads in flight to stream dy and x at full bandwidth
    if post_add_rows:
        row_blocks = cdiv(post_add_rows, block_m)
        splits = max(1, min(M // post_add_rows, most // row_blocks))
    else:
        row_blocks, splits = min(cdiv(M, block_m), most), 1
    period = post_add_rows or row_blocks * block_m
    programs = row_blocks * splits
    dw_parts = torch.empty((programs, D), device=x.device, dtype=torch.float32) if need_dweight else None
    dy_parts = None
    if need_dbias or post_add_rows:
        dy_parts = torch.empty((splits * post_add_rows or programs, D), device=x.device, dtype=torch.float32)
    _layer_norm_backward_kernel[(row_blocks, splits)](
        dy, x, weight.contiguous(), stats, dx if need_dx else None, dw_parts, dy_parts,
        M, D, period, dy.stride(0), x.stride(0), dx.stride(0) if need_dx else 0,
        RMS=rms, NEED_DX=need_dx, NEED_DW=need_dweight, SUM_DY=dy_parts is not None, PER_ROW=post_add_rows > 0,
        BLOCK_M=block_m, BLOCK_D=block_d, num_warps=min(16, max(1, block_m * block_d // 512)),
        **pdl(x.device, programs),
    )
    dweight = dw_parts.sum(0).to(weight.dtype) if need_dweight else None
    dbias = dpost_add = None
    if post_add_rows:
        dpost_add = dy_parts.view(splits, post_add_rows, D).sum(0)
        dbias = dpost_add.sum(0).to(weight.dtype) if need_dbias else None
        dpost_add = dpost_add.to(weight.dtype)
    elif need_dbias:
        dbias = dy_parts.sum(0).to(weight.dtype)
    return dx if need_dx else None, dweight, dbias, dpost_add


def _check(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_float("x", x)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D [M, D] with unit stride along D, got shape {tuple(x.shape)} "
                         f"and strides {x.stride()}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            check_shape(name, t, (x.shape[1],))
            check_dtype(name, t, x.dtype)


def _check_stats(stats: torch.Tensor, M: int) -> None:
    check_dtype("stats", stats, torch.float32)
    check_shape("stats", stats, (2, M))
    if not stats.is_contiguous():
        raise ValueError(f"stats must be contiguous, got strides {stats.stride()}")


def _launch(x, weight, bias, out, eps: float, rms: bool, parts: torch.Tensor | None, total: torch.Tensor | None,
            tf32_output: bool, post_add: torch.Tensor | None = None, stats: torch.Tensor | None = None) -> None:
    M, D = x.shape
    block_d = next_power_of_2(D)
    # About 2K elements a program: several rows when D is small, two at ViT-B's 768 (one image's 197 rows
    # then spread over 99 programs, not 50: 1.03x the forward at 1-2 images).
    block_m = max(1, min(2048 // block_d, next_power_of_2(M)))
    num_warps = min(16, max(1, block_m * block_d // 512))
    _layer_norm_kernel[(cdiv(M, block_m),)](
        x, weight.contiguous(), None if bias is None else bias.contiguous(), out, parts, total,
        None if post_add is None else post_add.contiguous(), 1 if post_add is None else post_add.shape[0], stats,
        M, D, x.stride(0), out.stride(0), eps, int(tf32_output and input_precision(x.dtype, None) == "tf32"),
        HAS_BIAS=bias is not None, RMS=rms, HAS_ADD=post_add is not None, HAS_STATS=stats is not None,
        NUM_PARTS=0 if parts is None else parts.shape[0],
        BLOCK_M=block_m, BLOCK_D=block_d, num_warps=num_warps, **pdl(x.device, cdiv(M, block_m)),
    )
