"""Patch embedding: the token tensor of a ViT in one launch.

tokens[b, j]        = prefix[j] (+ pos[j] when pos covers the prefix)      for j < P0
tokens[b, P0 + p]   = sum_k A[b*Np + p, k] * W[:, k] + bias + pos[p (+ P0)] for the Np patches

A is the im2col matrix of pixels [B, C, H, W] (Hp x Wp = floor(H / S) x floor(W / S) patches, as a strided
convolution takes them: pixels past the last whole patch are not read; patch p at row py = p // Wp, column px = p % Wp;
k = (c, ky, kx) in conv-weight order), gathered tile by tile from the image and never written
out. W is the conv weight [D, C, S, S] read as [D, C*S*S]. The P0 prefix rows (class,
distillation, register tokens) are written by extra programs of the same launch. With tf32 matmuls
W is read as a rounded copy kept with the weight (tf32.py), not rounded in every program.

Backward (patch_embed_backward), with dP the patch rows of dtokens [B*Np, D]: dW = dP^T @ A, an implicit-im2col
GEMM of few output tiles (D x C*S*S) and a long sum over the B*Np rows, cut into slices whose fp32 partial sums are
added after (no atomics: the same bits on every run); dpixels = dP @ W, each element of A's tile stored straight to
its pixel (patches do not overlap); dbias, dpos and dprefix: sums of dtokens' rows over the batch, in one small
kernel that reads each token row of the batch once.

Cost: 2*B*Np*D*C*S*S FLOPs; at least B*C*H*W + D*C*S*S + B*T*D (+ T*D pos) elements moved. Backward: as much again
for dW (B*C*H*W + B*Np*D read, D*C*S*S written, + 2*splits*D*C*S*S fp32 partial sums) and for dpixels (B*Np*D +
D*C*S*S read, B*C*H*W written); the sums read B*T*D elements and write (T + P0)*D.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import (
    INTERPRET, cast, cdiv, check_device, check_dtype, check_float, check_shape, input_precision, mma, next_power_of_2,
    pdl, sm_count, start_next_kernel, tune, wait_for_previous_kernel,
)
from .tf32 import tf32_weight
from .tuning import size_bucket


def _config(bm, bn, bk, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages)


@triton.jit
def _patch_origin(b, p, GRID_W, s_pb, s_ph, s_pw, PATCH: tl.constexpr):
    """Offsets of the top-left pixels of patches p of images b (the rows b * NUM_PATCHES + p of A)."""
    return b.to(tl.int64) * s_pb + (p // GRID_W * PATCH) * s_ph + (p % GRID_W * PATCH) * s_pw


@triton.jit
def _pixel_offset(k, s_pc, s_ph, s_pw, PATCH: tl.constexpr):
    """Offsets of the pixels of columns k = (c, ky, kx) of A from their patch's top-left pixel."""
    c = k // (PATCH * PATCH)
    ky = k // PATCH % PATCH
    kx = k % PATCH
    return c * s_pc + ky * s_ph + kx * s_pw


@triton.jit
def _token_row(b, p, NUM_PREFIX, s_b, s_t):
    """Offsets of the token rows of patches p of images b (after the NUM_PREFIX prefix tokens)."""
    return b.to(tl.int64) * s_b + (p + NUM_PREFIX) * s_t


# The forward's and the pixel gradient's tiles: BLOCK_M rows of A by BLOCK_N output columns, BLOCK_K deep a step.
GEMM_CONFIGS = tune(
    [
        _config(128, 128, 64, 8, 3),
        _config(128, 64, 64, 4, 3),
        _config(64, 128, 64, 4, 3),
        _config(64, 64, 64, 4, 3),
    ],
    _config(32, 32, 32, 4, 1),
)


@triton.autotune(configs=GEMM_CONFIGS, key=["patches_bucket", "D", "K", "NUM_PREFIX", "INPUT_PRECISION", "W_TF32"])
@triton.jit(do_not_specialize=["patches_bucket"])
def _patch_embed_kernel(
    px_ptr, w_ptr, b_ptr, pos_ptr, pre_ptr, out_ptr,
    B, C, D, K, NUM_PATCHES, GRID_W, NUM_PREFIX,
    s_pb, s_pc, s_ph, s_pw, stride_wd, s_ob, s_ot,
    patches_bucket,   # size_bucket(NUM_PATCHES), a tuning key only: nearby image sizes share one pick
    PATCH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_PREFIX: tl.constexpr, HAS_POS: tl.constexpr, POS_HAS_PREFIX: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, W_TF32: tl.constexpr,   # W_TF32: W holds tf32 values already
    PDL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    pid_m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < D
    num_patch_tiles = tl.cdiv(B * NUM_PATCHES, BLOCK_M)

    if pid_m < num_patch_tiles:
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < B * NUM_PATCHES
        b = offs_m // NUM_PATCHES
        p = offs_m % NUM_PATCHES
        row_base = _patch_origin(b, p, GRID_W, s_pb, s_ph, s_pw, PATCH)
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            col_off = _pixel_offset(k, s_pc, s_ph, s_pw, PATCH)
            a = tl.load(px_ptr + row_base[:, None] + col_off[None, :],
                        mask=mask_m[:, None] & (k < K)[None, :], other=0.0)
            w = tl.load(w_ptr + offs_n[None, :] * stride_wd + k[:, None],
                        mask=mask_n[None, :] & (k < K)[:, None], other=0.0)
            acc = mma(cast(a, w.dtype), w, acc, INPUT_PRECISION, False, W_TF32)
        mask = mask_m[:, None] & mask_n[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if HAS_POS:
            pos_row = p + NUM_PREFIX if POS_HAS_PREFIX else p
            acc += tl.load(pos_ptr + pos_row[:, None] * D + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        out_row = _token_row(b, p, NUM_PREFIX, s_ob, s_ot)
        tl.store(out_ptr + out_row[:, None] + offs_n[None, :], cast(acc, out_ptr.dtype.element_ty), mask=mask)
    elif HAS_PREFIX:
        # Prefix rows r = b * NUM_PREFIX + j of every image, after the patch tiles.
        offs_m = (pid_m - num_patch_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < B * NUM_PREFIX
        b = offs_m // NUM_PREFIX
        j = offs_m % NUM_PREFIX
        mask = mask_m[:, None] & mask_n[None, :]
        acc = tl.load(pre_ptr + j[:, None] * D + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_POS and POS_HAS_PREFIX:
            acc += tl.load(pos_ptr + j[:, None] * D + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        out_row = b.to(tl.int64) * s_ob + j * s_ot
        tl.store(out_ptr + out_row[:, None] + offs_n[None, :], cast(acc, out_ptr.dtype.element_ty), mask=mask)
    start_next_kernel(PDL)


# The weight gradient's tile: BLOCK_N rows of dW (D) by BLOCK_K columns (K = C*S*S), BLOCK_M rows of A (patches) a
# step. Its configs vary only warps and stages, never the tile: the tile fixes the order of the sums, so the
# gradient is the same bits whichever config the tuning picks; and dweight_splits counts the tiles before the launch.
DW_TILE, DW_STEP = (32, 32) if INTERPRET else (128, 64)
DW_CONFIGS = tune([_config(DW_STEP, DW_TILE, DW_TILE, warps, stages) for warps, stages in ((8, 3), (4, 3), (8, 2))],
                  _config(DW_STEP, DW_TILE, DW_TILE, 4, 1))


@triton.autotune(configs=DW_CONFIGS, key=["rows_bucket", "D", "K", "INPUT_PRECISION"])
@triton.jit(do_not_specialize=["rows_bucket"])
def _patch_embed_dweight_kernel(
    px_ptr, dt_ptr,
    dw_ptr,   # [splits, D, K] fp32 partial sums, or with one split the gradient [D, K] itself
    D, K, NUM_PATCHES, GRID_W, NUM_PREFIX, rows, split_rows,
    s_pb, s_pc, s_ph, s_pw, s_tb, s_tt,
    rows_bucket,   # size_bucket(rows), a tuning key only
    PATCH: tl.constexpr, INPUT_PRECISION: tl.constexpr, PDL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # dW[n, k] = sum over the patch rows m of dP[m, n] * A[m, k], dP the patch rows of dtokens: program (i, j, s)
    # sums the rows of split s into tile (i, j), gathering A from the image as the forward does.
    wait_for_previous_kernel(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask_n = offs_n < D
    mask_k = offs_k < K
    col_off = _pixel_offset(offs_k, s_pc, s_ph, s_pw, PATCH)
    first = tl.program_id(2) * split_rows
    last = tl.minimum(first + split_rows, rows)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for m0 in range(first, last, BLOCK_M):
        m = m0 + tl.arange(0, BLOCK_M)
        mask_m = m < last
        b = m // NUM_PATCHES
        p = m % NUM_PATCHES
        dp = tl.load(dt_ptr + _token_row(b, p, NUM_PREFIX, s_tb, s_tt)[:, None] + offs_n[None, :],
                     mask=mask_m[:, None] & mask_n[None, :], other=0.0)
        a = tl.load(px_ptr + _patch_origin(b, p, GRID_W, s_pb, s_ph, s_pw, PATCH)[:, None] + col_off[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        acc = mma(tl.trans(dp), cast(a, dp.dtype), acc, INPUT_PRECISION, False, False)
    start_next_kernel(PDL)
    out = dw_ptr + tl.program_id(2).to(tl.int64) * D * K + offs_n[:, None] * K + offs_k[None, :]
    tl.store(out, cast(acc, dw_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_k[None, :])


@triton.autotune(configs=GEMM_CONFIGS, key=["rows_bucket", "D", "K", "INPUT_PRECISION", "W_TF32"])
@triton.jit(do_not_specialize=["rows_bucket"])
def _patch_embed_dpixels_kernel(
    dt_ptr, w_ptr, dpx_ptr,
    D, K, NUM_PATCHES, GRID_W, NUM_PREFIX, rows,
    s_tb, s_tt, stride_wd, s_xb, s_xc, s_xh, s_xw,
    rows_bucket,   # size_bucket(rows), a tuning key only
    PATCH: tl.constexpr, INPUT_PRECISION: tl.constexpr, W_TF32: tl.constexpr, PDL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # dA = dP @ W: BLOCK_M patch rows by BLOCK_N columns (c, ky, kx) of A, BLOCK_K of the D outputs a step, stored
    # straight to the pixels A's elements came from (patches do not overlap: each pixel is written once at most).
    wait_for_previous_kernel(PDL)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < rows
    mask_n = offs_n < K
    b = offs_m // NUM_PATCHES
    p = offs_m % NUM_PATCHES
    dp_row = _token_row(b, p, NUM_PREFIX, s_tb, s_tt)
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        k = k0 + offs_k
        dp = tl.load(dt_ptr + dp_row[:, None] + k[None, :], mask=mask_m[:, None] & (k < D)[None, :], other=0.0)
        w = tl.load(w_ptr + k[:, None] * stride_wd + offs_n[None, :], mask=(k < D)[:, None] & mask_n[None, :],
                    other=0.0)
        acc = mma(dp, w, acc, INPUT_PRECISION, False, W_TF32)
    start_next_kernel(PDL)
    origin = _patch_origin(b, p, GRID_W, s_xb, s_xh, s_xw, PATCH)
    pixel = origin[:, None] + _pixel_offset(offs_n, s_xc, s_xh, s_xw, PATCH)[None, :]
    tl.store(dpx_ptr + pixel, cast(acc, dpx_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _patch_embed_token_sums_kernel(
    dt_ptr,
    dpos_ptr,   # HAS_POS: [T - pos_first, D], row t - pos_first the sum over the batch of token t's gradient
    dpre_ptr,   # HAS_PREFIX: [NUM_PREFIX, D], the same for the prefix tokens
    bias_ptr,   # HAS_BIAS: [programs along axis 0, D] fp32, each program's sum over its patch tokens
    B, D, NUM_PREFIX, first, last, pos_first, s_tb, s_tt,
    HAS_POS: tl.constexpr, HAS_PREFIX: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    # Program (i, j) sums tokens first + i*BLOCK_T ... (below last) of columns j*BLOCK_D ... over the batch in fp32.
    wait_for_previous_kernel(PDL)
    t = first + tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = cols < D
    mask = (t < last)[:, None] & mask_d[None, :]
    ptrs = dt_ptr + t[:, None] * s_tt + cols[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for _ in range(B):
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        ptrs += s_tb
    start_next_kernel(PDL)
    if HAS_POS:
        tl.store(dpos_ptr + (t - pos_first)[:, None] * D + cols[None, :], cast(acc, dpos_ptr.dtype.element_ty),
                 mask=mask & (t >= pos_first)[:, None])
    if HAS_PREFIX:
        tl.store(dpre_ptr + t[:, None] * D + cols[None, :], cast(acc, dpre_ptr.dtype.element_ty),
                 mask=mask & (t < NUM_PREFIX)[:, None])
    if HAS_BIAS:
        patch_sum = tl.sum(tl.where((t >= NUM_PREFIX)[:, None], acc, 0.0), axis=0)
        tl.store(bias_ptr + tl.program_id(0) * D + cols, patch_sum, mask=mask_d)


def patch_embed(
    pixels: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    pos_embed: torch.Tensor | None = None,
    prefix_tokens: torch.Tensor | None = None,
    *,
    allow_tf32: bool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tokens [B, P0 + Np, D] from pixels [B, C, H, W] and a conv weight [D, C, S, S].

    prefix_tokens [P0, D] go first (class, distillation, registers). pos_embed is [Np, D] (patches
    only) or [P0 + Np, D] (prefix too). Pixels may be float32 or the weight's dtype; they are
    converted as they are loaded.
    """
    check_device(pixels, weight, bias, pos_embed, prefix_tokens, out)
    num_patches = _check_images(pixels, weight)
    weight = weight.contiguous()
    D, C, S, _ = weight.shape
    B, _, H, W = pixels.shape
    num_prefix = 0 if prefix_tokens is None else prefix_tokens.shape[0]
    T = num_prefix + num_patches
    if prefix_tokens is not None:
        check_shape("prefix_tokens", prefix_tokens, (num_prefix, D))
        check_dtype("prefix_tokens", prefix_tokens, weight.dtype)
    if bias is not None:
        check_shape("bias", bias, (D,))
        check_dtype("bias", bias, weight.dtype)
    if pos_embed is not None:
        check_dtype("pos_embed", pos_embed, weight.dtype)
        if tuple(pos_embed.shape) not in ((num_patches, D), (T, D)):
            raise ValueError(f"pos_embed must have shape ({num_patches}, {D}) or ({T}, {D}) for a "
                             f"{H}x{W} image, got {tuple(pos_embed.shape)}")
    if out is None:
        out = torch.empty((B, T, D), device=weight.device, dtype=weight.dtype)
    else:
        check_shape("out", out, (B, T, D))
        check_dtype("out", out, weight.dtype)
        if out.stride(2) != 1:
            raise ValueError(f"out must have unit stride along D, got strides {out.stride()}")

    def grid(meta):
        rows = cdiv(B * num_patches, meta["BLOCK_M"]) + cdiv(B * num_prefix, meta["BLOCK_M"])
        return (rows, cdiv(D, meta["BLOCK_N"]))

    most_programs = math.prod(grid({"BLOCK_M": 64, "BLOCK_N": 64}))   # the smallest tiles of the configs
    precision = input_precision(weight.dtype, allow_tf32)
    weight, w_tf32 = tf32_weight(weight, B * num_patches, precision)
    _patch_embed_kernel[grid](
        pixels, weight, bias, None if pos_embed is None else pos_embed.contiguous(),
        None if prefix_tokens is None else prefix_tokens.contiguous(), out,
        B, C, D, C * S * S, num_patches, W // S, num_prefix,
        pixels.stride(0), pixels.stride(1), pixels.stride(2), pixels.stride(3),
        weight.stride(0), out.stride(0), out.stride(1), patches_bucket=size_bucket(num_patches),
        PATCH=S, HAS_BIAS=bias is not None, HAS_PREFIX=num_prefix > 0, HAS_POS=pos_embed is not None,
        POS_HAS_PREFIX=pos_embed is not None and pos_embed.shape[0] == T and num_prefix > 0,
        INPUT_PRECISION=precision, W_TF32=w_tf32, **pdl(weight.device, most_programs),
    )
    return out


def patch_embed_backward(
    dtokens: torch.Tensor,
    pixels: torch.Tensor,
    weight: torch.Tensor,
    *,
    num_prefix: int,
    has_bias: bool,
    pos_rows: int,
    need_pixels: bool = False,
    need_weight: bool = True,
    need_bias: bool = True,
    need_pos: bool = True,
    need_prefix: bool = True,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dpixels, dweight, dbias, dpos, dprefix): the gradients of patch_embed(pixels, weight, bias, pos_embed,
    prefix_tokens) from dtokens [B, P0 + Np, D] (unit stride along D), with P0 = num_prefix, bias present or not
    (has_bias) and pos_embed of pos_rows rows (0: none, Np: the patches', P0 + Np: the prefix's too).

    dweight [D, C, S, S] = dP^T @ A, dP the patch rows of dtokens [B*Np, D] and A the im2col matrix of the pixels as
    the forward read them (rounded to weight's dtype), gathered from the image tile by tile; its sum over the B*Np rows
    is cut into slices (dweight_splits) whose fp32 partial sums are then added. dbias: the sum of dP's rows. dpos:
    the sum over the batch of the token rows each row of pos was added to; dprefix [P0, D]: the same for the prefix
    rows. dpixels [B, C, H, W] (need_pixels) = dP @ W scattered back to the pixels of each patch, 0 for the pixels past
    the last whole patch, which the forward does not read. dpixels in pixels' dtype, the others in weight's, all
    summed in fp32 and deterministic (no atomics). None for what need_* does not ask for or the forward did not have,
    with no work done for it. Float32 products run on tf32 as torch.get_float32_matmul_precision() says."""
    check_device(dtokens, pixels, weight)
    num_patches = _check_images(pixels, weight)
    D, C, S, _ = weight.shape
    B, _, H, W = pixels.shape
    if num_prefix < 0:
        raise ValueError(f"num_prefix must be at least 0, got {num_prefix}")
    T, rows, K = num_prefix + num_patches, B * num_patches, C * S * S
    check_dtype("dtokens", dtokens, weight.dtype)
    check_shape("dtokens", dtokens, (B, T, D))
    if dtokens.stride(2) != 1:
        raise ValueError(f"dtokens must have unit stride along D, got strides {dtokens.stride()}")
    if pos_rows not in (0, num_patches, T):
        raise ValueError(f"pos_rows must be 0, {num_patches} or {T} for a {H}x{W} image with {num_prefix} prefix "
                         f"tokens, got {pos_rows}")
    weight = weight.contiguous()
    precision = input_precision(weight.dtype, None)
    dpixels = dweight = None
    if need_pixels:
        # The pixels past the last whole patch get no gradient: zeros, written before the kernel.
        dpixels = (torch.zeros_like if H % S or W % S else torch.empty_like)(pixels)
        w, w_tf32 = tf32_weight(weight, rows, precision)

        def grid(meta):
            return cdiv(rows, meta["BLOCK_M"]), cdiv(K, meta["BLOCK_N"])

        _patch_embed_dpixels_kernel[grid](
            dtokens, w, dpixels, D, K, num_patches, W // S, num_prefix, rows,
            dtokens.stride(0), dtokens.stride(1), w.stride(0), *dpixels.stride(), rows_bucket=size_bucket(rows),
            PATCH=S, INPUT_PRECISION=precision, W_TF32=w_tf32,
            **pdl(weight.device, math.prod(grid({"BLOCK_M": 64, "BLOCK_N": 64}))),
        )
    if need_weight:
        splits = dweight_splits(rows, D, K, weight.device)
        dweight = torch.empty_like(weight)
        out = dweight if splits == 1 else torch.empty((splits, D, K), device=weight.device, dtype=torch.float32)
        grid = (cdiv(D, DW_TILE), cdiv(K, DW_TILE), splits)
        _patch_embed_dweight_kernel[grid](
            pixels, dtokens, out, D, K, num_patches, W // S, num_prefix, rows, cdiv(rows, splits),
            *pixels.stride(), dtokens.stride(0), dtokens.stride(1), rows_bucket=size_bucket(rows),
            PATCH=S, INPUT_PRECISION=precision, **pdl(weight.device, math.prod(grid)),
        )
        if splits > 1:
            dweight = out.sum(0).to(weight.dtype).view(weight.shape)
    return (dpixels, dweight, *_token_sums(dtokens, num_prefix, pos_rows, need_bias and has_bias,
                                           need_pos and pos_rows > 0, need_prefix and num_prefix > 0))


def _token_sums(dtokens: torch.Tensor, num_prefix: int, pos_rows: int, need_bias: bool, need_pos: bool,
                need_prefix: bool) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dbias, dpos, dprefix) from one launch that sums dtokens over the batch, on the token rows they need only."""
    B, T, D = dtokens.shape
    first = 0 if need_prefix or (need_pos and pos_rows == T) else num_prefix
    last = T if need_pos or need_bias else num_prefix
    if first == last:
        return None, None, None
    block_d = min(128, next_power_of_2(D))
    block_t = min(16, next_power_of_2(last - first))
    grid = (cdiv(last - first, block_t), cdiv(D, block_d))
    dpos = dtokens.new_empty((pos_rows, D)) if need_pos else None
    dprefix = dtokens.new_empty((num_prefix, D)) if need_prefix else None
    bias_parts = dtokens.new_empty((grid[0], D), dtype=torch.float32) if need_bias else None
    _patch_embed_token_sums_kernel[grid](
        dtokens, dpos, dprefix, bias_parts, B, D, num_prefix, first, last, T - pos_rows,
        dtokens.stride(0), dtokens.stride(1), HAS_POS=need_pos, HAS_PREFIX=need_prefix, HAS_BIAS=need_bias,
        BLOCK_T=block_t, BLOCK_D=block_d, num_warps=4, **pdl(dtokens.device, math.prod(grid)),
    )
    return None if bias_parts is None else bias_parts.sum(0).to(dtokens.dtype), dpos, dprefix


# dweight_splits' rule: the weight gradient has few tiles (ViT-B/16: 36 of 128 x 128) and a long sum (ViT-B/16 at 256
# images: 50176 patch rows). Its rows are cut into the most slices that keep the launch at about SPLIT_PROGRAMS
# programs an SM, each slice at least SPLIT_MIN_ROWS rows (fewer under the interpreter, so tests split).
SPLIT_PROGRAMS = 2
SPLIT_MIN_ROWS = 16 if INTERPRET else 1024


def dweight_splits(rows: int, D: int, K: int, device: torch.device) -> int:
    """How many slices of the rows the weight gradient's sum is cut into (1: none). ViT-B/16 at 256 images on an
    H100: 7 slices of 7168 rows; at one image none."""
    tiles = cdiv(D, DW_TILE) * cdiv(K, DW_TILE)
    return max(1, min(SPLIT_PROGRAMS * sm_count(device) // tiles, rows // SPLIT_MIN_ROWS))


def _check_images(pixels: torch.Tensor, weight: torch.Tensor) -> int:
    """The number of patches of each image, after checking pixels [B, C, H, W] and the conv weight [D, C, S, S]."""
    check_float("weight", weight)
    if weight.dim() != 4 or weight.shape[2] != weight.shape[3]:
        raise ValueError(f"weight must be [D, C, S, S], got shape {tuple(weight.shape)}")
    _, C, S, _ = weight.shape
    if pixels.dim() != 4 or pixels.shape[1] != C:
        raise ValueError(f"pixels must be [B, {C}, H, W], got shape {tuple(pixels.shape)}")
    if pixels.dtype not in (weight.dtype, torch.float32):
        raise ValueError(f"pixels must be float32 or {weight.dtype}, got {pixels.dtype}")
    H, W = pixels.shape[2:]
    if H < S or W < S:
        raise ValueError(f"image size {H}x{W} must be at least the patch size {S} (pixels past the last whole patch "
                         f"are not read)")
    return (H // S) * (W // S)
