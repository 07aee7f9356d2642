"""Patch embedding: the token tensor of a ViT in one launch.

tokens[b, j]        = prefix[j] (+ pos[j] when pos covers the prefix)      for j < P0
tokens[b, P0 + p]   = sum_k A[b*Np + p, k] * W[:, k] + bias + pos[p (+ P0)] for the Np patches

A is the im2col matrix of pixels [B, C, H, W] (Hp x Wp = floor(H / S) x floor(W / S) patches, as a strided
convolution takes them: pixels past the last whole patch are not read; patch p at row py = p // Wp, column px = p % Wp;
k = (c, ky, kx) in conv-weight order), gathered tile by tile from the image and never written
out. W is the conv weight [D, C, S, S] read as [D, C*S*S]. The P0 prefix rows (class,
distillation, register tokens) are written by extra programs of the same launch. With tf32 matmuls
W is read as a rounded copy kept with the weight (tf32.py), not rounded in every program.

Cost: 2*B*Np*D*C*S*S FLOPs; at least B*C*H*W + D*C*S*S + B*T*D (+ T*D pos) elements moved.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import (
    cast, check_device, check_dtype, check_float, check_shape, input_precision, mma, pdl, start_next_kernel, tune,
    wait_for_previous_kernel,
)
from .tf32 import tf32_weight
from .tuning import size_bucket


def _config(bm, bn, bk, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk}, num_warps=warps, num_stages=stages)


@triton.autotune(
    configs=tune(
        [
            _config(128, 128, 64, 8, 3),
            _config(128, 64, 64, 4, 3),
            _config(64, 128, 64, 4, 3),
            _config(64, 64, 64, 4, 3),
        ],
        _config(32, 32, 32, 4, 1),
    ),
    key=["patches_bucket", "D", "K", "NUM_PREFIX", "INPUT_PRECISION", "W_TF32"],
)
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
        row_base = b.to(tl.int64) * s_pb + (p // GRID_W * PATCH) * s_ph + (p % GRID_W * PATCH) * s_pw
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            c = k // (PATCH * PATCH)
            ky = k // PATCH % PATCH
            kx = k % PATCH
            col_off = c * s_pc + ky * s_ph + kx * s_pw
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
        out_row = b.to(tl.int64) * s_ob + (p + NUM_PREFIX) * s_ot
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
    check_float("weight", weight)
    if weight.dim() != 4 or weight.shape[2] != weight.shape[3]:
        raise ValueError(f"weight must be [D, C, S, S], got shape {tuple(weight.shape)}")
    weight = weight.contiguous()
    D, C, S, _ = weight.shape
    if pixels.dim() != 4 or pixels.shape[1] != C:
        raise ValueError(f"pixels must be [B, {C}, H, W], got shape {tuple(pixels.shape)}")
    if pixels.dtype not in (weight.dtype, torch.float32):
        raise ValueError(f"pixels must be float32 or {weight.dtype}, got {pixels.dtype}")
    B, _, H, W = pixels.shape
    if H < S or W < S:
        raise ValueError(f"image size {H}x{W} must be at least the patch size {S} (pixels past the last whole patch "
                         f"are not read)")
    num_patches = (H // S) * (W // S)
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
        rows = triton.cdiv(B * num_patches, meta["BLOCK_M"]) + triton.cdiv(B * num_prefix, meta["BLOCK_M"])
        return (rows, triton.cdiv(D, meta["BLOCK_N"]))

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
