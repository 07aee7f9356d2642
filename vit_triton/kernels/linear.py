"""Linear layer with a fused epilogue, y = scale * (row_scale * col_scale * act(x @ W^T + b) [+ residual]), and its
backward.

Layouts: x [M, K] with unit stride along K (any row stride, so a view such as tokens[:, 0] is read in place);
W [N, K] row-major, the nn.Linear layout, read K-major as the tensor cores want it (no transposed copy); b [N];
residual and y [M, N] with unit stride along N. A gated MLP's fc1 (activation "swiglu") is one product of
W [2N, K] and b [2N] whose rows interleave the gate's and the value's (row 2j the gate's row j, 2j + 1 the
value's), so that each output tile of the product holds both halves of its columns: the epilogue makes
y [M, N] = silu(gate) * value from it, and the [M, 2N] product is never stored.

A QKV projection with rotary position embeddings (rope): y's columns are [3, H, Dh] (q, k, v) and its rows [B, T]
(tokens); the epilogue rotates the q and k columns of the patch tokens (from token rope_prefix on) with the cos and
sin tables, in fp32, after rounding the product to y's dtype as a library's QKV layer does, so attention reads q and
k ready. A rotated pair is within one tile: channels (2i, 2i + 1), or (i, i + Dh/2) when the tile's width is a
multiple of Dh (the launcher widens narrower candidates for such a head dim).

Training adds to the epilogue (each a constexpr, so inference compiles as before): pre_out, z = x @ W^T + b stored
before the activation (for its derivative), col_scale (LayerScale's gamma [N]) and row_scale (stochastic depth's
[M]), both applied before the residual.

Cost: 2*M*N*K FLOPs; at least (M*K + N*K + M*N [+ M*N residual]) elements moved (+ N bias); with swiglu, N is W's
rows, 2 * y's width, and y moves M*N/2 elements; rope reads a cos and a sin a rotated pair (fp32, 2/3 * M*N/2 pairs,
from tables of T*Dh values each, a head each for RoPE-mixed: cached in L2) and adds 3 FLOPs an element; split K
writes S*M*N fp32 partial sums instead of M*N outputs; a product launched in two parts of rows reads W twice (+ N*K);
pre_out writes M*N more (N: W's rows).

The backward (linear_backward), from dy [M, N]:

- dz, the gradient at z: act'(pre) * (scale * row_scale * dy) (swiglu: [M, 2N], interleaved as W's rows), or dy
  turned back by the inverse rotation, made by _grad_kernel (reads dy and pre, writes dz: 2-3 M*N elements); where
  there is nothing to apply, dz is dy itself. gamma goes to the products instead: dx = (dz * gamma) W =
  dz (diag(gamma) W), an N x K copy of W scaled once, and dW's epilogue.
- The dX product, dx [M, K] = dz [M, N] @ W [N, K]: W is read row-major as it lies, its rows the reduction. Its
  epilogue, for fc2 of the fused MLP (x = act2(x_pre), x_pre fc1's pre_out): d x_pre = dx * act2'(x_pre) ([M, 2K]
  with swiglu), and x recomputed from x_pre for the dW product, so the forward keeps only x_pre.
- The dW product, dW [N, K] = dz^T @ x: dz read transposed (the TMA kernel's blocks [BLOCK_K, BLOCK_M], transposed
  in shared memory), x row-major. Its reduction runs over M, tens of thousands of rows in training, and its output
  has few tiles (ViT-B/16's proj: 36 of 128 x 128 on 132 SMs), so M is cut into slices (dweight_splits) whose fp32
  partial sums _sum_kernel adds in a fixed order (the same bits every run: no atomics). dbias is dz's column sums s,
  from a pass of their own (column_sums: M*N reads; summed from the A tiles inside the dW product, the tiles leave
  the tensor cores' pipeline, and the product ran 3-4x slower on an H200). With gamma: dW = gamma G and
  dbias = gamma s for G = dz^T x (dz without gamma), and d gamma = sum_m dz z = sum_k W G + b s, W's tile read where
  G's tile is made (its parts a column of tiles, summed by _sum_kernel): no z kept, no second pass over W.
- Cost: 4*M*N*K FLOPs (2*M*N*K each product); the dX product moves M*N + N*K + M*K elements (+ M*K x_pre and M*K
  recomputed x, 2 M*K each with swiglu); the dW product M*N + M*K + N*K (+ N*K of W with d gamma, + 2 S*N*K fp32
  partial sums in S slices).

The file, in reading order:

- _tile_coords, _rotate and _epilogue, shared by both kernels: the grouped order of output tiles, the rotary
  embedding of a QKV tile, and what a finished fp32 tile goes through before its one store (bias, then the
  rotation or the activation of activation.py, then the residual add, then the scale, so no elementwise kernel
  follows the GEMM). swiglu's activation halves the tile's width. _store_tile, that store, through a TMA
  descriptor or a pointer (the backward's epilogues share it).
- _linear_plain_kernel, the kernel to read first (Triton's matrix-multiplication tutorial): masked pointer loads,
  one program per output tile and K slice. It runs where a matrix is not 16-byte aligned (common.tma_ready), and
  its candidate configs follow it.
- _linear_tma_kernel, the fast path (Triton's persistent-matmul tutorial): tiles through TMA descriptors built on
  the host, persistent programs walking their tiles in one flattened loop, the weights prefetched into L2 before
  the wait for the previous kernel. Its candidate configs, by dtype and row count, follow it.
- Split K: a product too small to give every SM a tile (ViT-B/16's fc2 at one image: 48 tiles of 64 x 64 on 132
  SMs, each a 3072-deep loop) is cut into S slices along K (split_k), one program (or loop item) per tile and
  slice, each writing its fp32 partial sum to parts [S, M, N]; slice 0 adds the bias. No program waits for
  another: the reader of the product (layer_norm's add_layer_norm, which also adds the residual) sums the slices.
  linear_partials launches it, through either kernel.
- The launchers: linear and linear_partials check their inputs; _tuned_launch picks the kernel by tma_ready and
  its config per shape by timing the candidates (tuning.py), launching a product whose last wave of tiles would
  leave most SMs idle in two parts of rows (whole_wave_rows); launch_linear makes one launch.
- The backward: _grad_kernel (dz); _dx_epilogue and _dw_epilogue; _linear_backward_plain_kernel and
  _linear_backward_tma_kernel, the forward kernels' loops for C = A @ B with B row-major [K, N] and A read as it
  lies or transposed, one kernel for both products (DW); _sum_kernel for the partial sums; the candidates and
  dweight_splits; then linear_backward, which checks its inputs and orders the launches, and _tuned_backward and
  launch_linear_backward, the backward's _tuned_launch and launch_linear (its own Tuner and keys).

float32 on tf32 tensor cores: operands are rounded to nearest tf32 as cuBLAS does, but not in the K loop where
avoidable (tf32.py): W is read as a rounded copy kept with the weight (W_TF32), an x that its producer stored
rounded is taken as it is (X_TF32), and y is stored rounded for a consumer that reads it as a matmul operand
(Y_TF32). The backward's products take W's rounded copy as the forward does; dz and x are rounded in their loops.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .activation import ACTIVATIONS, activation_grad, apply_activation, gelu_fit_degree
from .common import (
    INTERPRET, cast, cdiv, check_device, check_dtype, check_float, check_shape, input_precision, mma, sm_count, pdl,
    PDL_OFF, prefetch_l2, start_next_kernel, tma_ready, to_tf32, wait_for_previous_kernel,
)
from .tuning import Config, Tuner, size_bucket
from .tf32 import tf32_weight


@triton.jit
def _tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row-tiles share each column-tile of W while it sits in L2."""
    group = tile // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_size = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % (GROUP_M * num_n)) % group_size
    pid_n = (tile % (GROUP_M * num_n)) // group_size
    return pid_m, pid_n


@triton.jit
def _persistent_item(item, num_tiles, num_m, num_n, SPLIT: tl.constexpr, GROUP_M: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(split, pid_n, m0, n0) of item `item` of a persistent program's (tile, K slice) items: its K slice, its
    tile's column index, first row and first column (the tiles in _tile_coords' order, slice by slice)."""
    if SPLIT > 1:
        split = item // num_tiles
    else:
        split = 0
    pid_m, pid_n = _tile_coords(item % num_tiles, num_m, num_n, GROUP_M)
    return split, pid_n, pid_m * BLOCK_M, pid_n * BLOCK_N


@triton.jit
def _rotate(x, m0, n0, M, cos_ptr, sin_ptr, s_head, tokens, prefix, heads, row0, HEAD_DIM: tl.constexpr,
            ROPE_HALF: tl.constexpr, INVERSE: tl.constexpr):
    """The QKV tile x [BM, BN] at (m0, n0) (columns [3, H, HEAD_DIM]) with its q and k channels of the rotated
    tokens turned by their angles: a' = a cos - b sin, b' = b cos + a sin for each pair (a, b) of channels, (2i,
    2i + 1), or (i, i + HEAD_DIM / 2) if ROPE_HALF (the tile's width then a multiple of HEAD_DIM); INVERSE turns
    them back (the backward: sin negated). Row r is token (row0 + r) % tokens, rotated from token `prefix` on with
    table row token - prefix of its head's tables (head stride s_head, 0: shared); the tables' entry of a pair is that
    of its first channel."""
    BM: tl.constexpr = x.shape[0]
    PAIRS: tl.constexpr = x.shape[1] // 2
    HALF: tl.constexpr = HEAD_DIM // 2
    pair = tl.arange(0, PAIRS)
    if ROPE_HALF:   # [BM, BN / Dh, 2, Dh / 2] -> the two halves of each head, as [BM, BN / 2] each
        a, b = tl.split(tl.permute(tl.reshape(x, [BM, PAIRS // HALF, 2, HALF]), (0, 1, 3, 2)))
        a, b = tl.reshape(a, [BM, PAIRS]), tl.reshape(b, [BM, PAIRS])
        first = n0 + pair // HALF * HEAD_DIM + pair % HALF
    else:
        a, b = tl.split(tl.reshape(x, [BM, PAIRS, 2]))
        first = n0 + 2 * pair
    offs_m = m0 + tl.arange(0, BM)
    token = (row0 + offs_m) % tokens - prefix
    mask = ((offs_m < M) & (token >= 0))[:, None] & (first < 2 * heads * HEAD_DIM)[None, :]   # q and k only
    table = (first // HEAD_DIM % heads * s_head + first % HEAD_DIM)[None, :] + token[:, None] * HEAD_DIM
    cos = tl.load(cos_ptr + table, mask=mask, other=1.0)
    sin = tl.load(sin_ptr + table, mask=mask, other=0.0)
    if INVERSE:
        sin = -sin
    a, b = tl.where(mask, a * cos - b * sin, a), tl.where(mask, b * cos + a * sin, b)
    if ROPE_HALF:
        pairs = tl.join(tl.reshape(a, [BM, PAIRS // HALF, HALF]), tl.reshape(b, [BM, PAIRS // HALF, HALF]))
        return tl.reshape(tl.permute(pairs, (0, 1, 3, 2)), [BM, 2 * PAIRS])
    return tl.reshape(tl.join(a, b), [BM, 2 * PAIRS])


@triton.jit
def _epilogue(acc, m0, n0, split, M, N, b_ptr, r, y, stride_rm, stride_ym, scale,
              cos_ptr, sin_ptr, s_rope_h, rope_tokens, rope_prefix, rope_heads, rope_row0,
              pre_ptr, stride_pm, col_scale_ptr, row_scale_ptr,
              HAS_BIAS: tl.constexpr, ACT: tl.constexpr, GELU_FIT_DEGREE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
              HAS_SCALE: tl.constexpr, Y_TF32: tl.constexpr, R_TMA: tl.constexpr, Y_TMA: tl.constexpr,
              ROPE: tl.constexpr, ROPE_HALF: tl.constexpr, HEAD_DIM: tl.constexpr,
              PRE_OUT: tl.constexpr, HAS_COL_SCALE: tl.constexpr, HAS_ROW_SCALE: tl.constexpr):
    """Bias, activation or rotation (ROPE: _rotate, on the product rounded to y's dtype as a library's QKV layer
    gives it), column and row scales, residual, scale (and tf32 rounding, Y_TF32) on the fp32 tile acc of the
    product at (m0, n0) (N: W's rows), then its one store. PRE_OUT: the product with its bias (z, before the
    activation or rotation) is stored to pre [M, N] too, for the backward. The residual and y go through TMA
    descriptors where R_TMA, Y_TMA (clipped to y's shape), else through pointers; slice `split` of split K's partial
    sums is rows split*M... of y viewed as [SPLIT_K*M, N]. "swiglu" halves the tile: its y tile is at (m0, n0 / 2),
    of y [M, N / 2]."""
    offs_m = m0 + tl.arange(0, acc.shape[0])
    offs_n = n0 + tl.arange(0, acc.shape[1])
    rows = offs_m[:, None].to(tl.int64)
    if HAS_BIAS:  # once: slice 0 adds it. tl.where, not `mask_n & (split == 0)`: Triton 3.9's interpreter
        # broadcasts a scalar comparison as int32, which a mask refuses (and 3.6's cannot branch on one).
        first = tl.where(split == 0, offs_n < N, False)
        acc += tl.load(b_ptr + offs_n, mask=first, other=0.0).to(tl.float32)[None, :]
    if PRE_OUT:
        tl.store(pre_ptr + rows * stride_pm + offs_n[None, :], cast(acc, pre_ptr.dtype.element_ty),
                 mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])
    if ROPE:
        y_dtype: tl.constexpr = y.dtype if Y_TMA else y.dtype.element_ty
        acc = _rotate(cast(acc, y_dtype).to(tl.float32), m0, n0, M, cos_ptr, sin_ptr, s_rope_h, rope_tokens,
                      rope_prefix, rope_heads, rope_row0, HEAD_DIM, ROPE_HALF, False)
    acc = apply_activation(acc, ACT, GELU_FIT_DEGREE)
    if ACT == "swiglu":   # a gate and a value column of the product make one column of y
        n0 = n0 // 2
        N = N // 2
        offs_n = n0 + tl.arange(0, acc.shape[1])
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if HAS_COL_SCALE:
        acc *= tl.load(col_scale_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
    if HAS_ROW_SCALE:
        acc *= tl.load(row_scale_ptr + offs_m, mask=offs_m < M, other=0.0)[:, None]
    if HAS_RESIDUAL:
        if R_TMA:
            acc += r.load([m0, n0]).to(tl.float32)
        else:
            acc += tl.load(r + rows * stride_rm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        acc *= scale
    if Y_TF32:
        acc = to_tf32(acc)
    _store_tile(y, acc, m0, n0, (rows + split * M) * stride_ym + offs_n[None, :], mask, Y_TMA)


@triton.jit
def _store_tile(out, acc, r0, c0, offsets, mask, TMA: tl.constexpr):
    """The fp32 tile acc in out's dtype, stored at (r0, c0) through out's TMA descriptor (clipped to its shape), or
    at the pointer out + offsets where mask holds."""
    if TMA:
        out.store([r0, c0], cast(acc, out.dtype))
    else:
        tl.store(out + offsets, cast(acc, out.dtype.element_ty), mask=mask)


@triton.jit
def _linear_plain_kernel(
    x_ptr, w_ptr, b_ptr, r_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_rm, stride_ym, scale,
    cos_ptr, sin_ptr, s_rope_h, rope_tokens, rope_prefix, rope_heads, rope_row0,   # _rotate's, with ROPE
    pre_ptr, stride_pm, col_scale_ptr, row_scale_ptr,   # with PRE_OUT, HAS_COL_SCALE, HAS_ROW_SCALE
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, GELU_FIT_DEGREE: tl.constexpr,   # apply_activation's
    HAS_RESIDUAL: tl.constexpr, HAS_SCALE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, X_TF32: tl.constexpr, W_TF32: tl.constexpr,   # x, W hold tf32 values already
    Y_TF32: tl.constexpr,   # y is stored rounded to tf32
    ROPE: tl.constexpr, ROPE_HALF: tl.constexpr, HEAD_DIM: tl.constexpr,   # y is a QKV projection to rotate
    PRE_OUT: tl.constexpr, HAS_COL_SCALE: tl.constexpr, HAS_ROW_SCALE: tl.constexpr,   # training's (linear)
    PDL: tl.constexpr,
    SPLIT_K: tl.constexpr,   # > 1: y is a pointer to fp32 partial sums [SPLIT_K, M, N], no epilogue but the bias
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """The BLOCK_M x BLOCK_N tile of y that program (tile, slice) owns, tiles in grouped order along grid axis 0,
    K slices along axis 1: the sum over its K slice of x's row tiles times W^T's column tiles, from masked pointer
    loads (zeros past M, N and K), then the epilogue. A program of split K's slice s > 0 writes its partial sum
    without the bias.

    Per program: 2 * BLOCK_M * BLOCK_N * K / SPLIT_K FLOPs, (BLOCK_M + BLOCK_N) * K / SPLIT_K elements read, one
    tile written (and one of the residual read), BLOCK_N / 2 wide with swiglu."""
    wait_for_previous_kernel(PDL)
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    split = tl.program_id(1)
    # Every slice runs the same number of K steps; the last one's past K read zeros.
    slice_steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = split * slice_steps * BLOCK_K + tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]    # x: [BLOCK_M, BLOCK_K]
    wt_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]   # W^T: [BLOCK_K, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, slice_steps):
        a = tl.load(x_ptrs, mask=(offs_m < M)[:, None] & (offs_k[None, :] < K), other=0.0)
        bt = tl.load(wt_ptrs, mask=(offs_n < N)[None, :] & (offs_k[:, None] < K), other=0.0)
        acc = mma(a, bt, acc, INPUT_PRECISION, X_TF32, W_TF32)
        x_ptrs += BLOCK_K
        wt_ptrs += BLOCK_K
        offs_k += BLOCK_K
    start_next_kernel(PDL)
    _epilogue(acc, pid_m * BLOCK_M, pid_n * BLOCK_N, split, M, N, b_ptr, r_ptr, y_ptr, stride_rm, stride_ym, scale,
              cos_ptr, sin_ptr, s_rope_h, rope_tokens, rope_prefix, rope_heads, rope_row0,
              pre_ptr, stride_pm, col_scale_ptr, row_scale_ptr,
              HAS_BIAS, ACT, GELU_FIT_DEGREE, HAS_RESIDUAL, HAS_SCALE, Y_TF32, False, False, ROPE, ROPE_HALF, HEAD_DIM,
              PRE_OUT, HAS_COL_SCALE, HAS_ROW_SCALE)


# The plain kernel's candidates, for the matrices that are not 16-byte aligned: a few general tiles, one program
# per tile and slice (persistent 0).
PLAIN = [Config(128, 128, 64, 8, 4, 0), Config(128, 64, 64, 4, 4, 0), Config(64, 64, 64, 4, 4, 0)]
PLAIN_FLOAT32 = [Config(128, 128, 32, 8, 3, 0), Config(64, 64, 32, 4, 4, 0)]
# Under the interpreter both kernels run one small tile. Persistent 1: the TMA kernel runs a program an SM (4),
# so that each walks several tiles; the plain kernel one a tile, whatever persistent says.
INTERPRETER = Config(32, 32, 32, 4, 1)


def _plain_candidates(M: int, dtype: torch.dtype) -> list[Config]:
    """The plain kernel's list for this dtype (any row count)."""
    if INTERPRET:
        return [INTERPRETER]
    return PLAIN_FLOAT32 if dtype == torch.float32 else PLAIN


PREFETCH_LINES = tl.constexpr(256)


@triton.jit
def _linear_tma_kernel(
    x_desc, w_desc, b_ptr, r_desc, y,   # y: a TMA descriptor where Y_TMA below, else a pointer
    w_ptr,               # W's first element, for the prefetch
    M, N, K,
    stride_wn, stride_ym, scale,
    cos_ptr, sin_ptr, s_rope_h, rope_tokens, rope_prefix, rope_heads, rope_row0,   # _rotate's, with ROPE
    pre_ptr, stride_pm, col_scale_ptr, row_scale_ptr,   # with PRE_OUT, HAS_COL_SCALE, HAS_ROW_SCALE
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, GELU_FIT_DEGREE: tl.constexpr,   # apply_activation's
    HAS_RESIDUAL: tl.constexpr, HAS_SCALE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, X_TF32: tl.constexpr, W_TF32: tl.constexpr,   # x, W hold tf32 values already
    Y_TF32: tl.constexpr,   # y is stored rounded to tf32
    ROPE: tl.constexpr, ROPE_HALF: tl.constexpr, HEAD_DIM: tl.constexpr,   # y is a QKV projection to rotate
    PRE_OUT: tl.constexpr, HAS_COL_SCALE: tl.constexpr, HAS_ROW_SCALE: tl.constexpr,   # training's (linear)
    PDL: tl.constexpr, PREFETCH: tl.constexpr,
    SPLIT_K: tl.constexpr,   # > 1: y is a pointer to fp32 partial sums [SPLIT_K, M, N], no epilogue but the bias
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """The plain kernel's tiles, moved by the TMA, which zero-fills and clips at the edges. x, W and the residual
    come through descriptors built on the host (built in the kernel, they cost each program 2-3 us before its
    first load, a third of a GEMM's time at one image); y goes out through one too, but for split K's partial
    sums and a residual product: the TMA store is asynchronous, so its output tile cannot reuse the residual
    tile's shared memory, and without that second 64 KB a 128 x 256 tile has room for three stages of 64-deep
    steps. A launch of fewer programs than (tile, slice) items is persistent: each program walks several.
    PREFETCH (with PDL): W asked into L2 before the wait for the previous kernel; ViT-B/16 at one image runs
    1.13x faster on an H100.

    Per item: 2 * BLOCK_M * BLOCK_N * K / SPLIT_K FLOPs, (BLOCK_M + BLOCK_N) * K / SPLIT_K elements read, one tile
    written (and one of the residual read), BLOCK_N / 2 wide with swiglu; the prefetch reads W once more, into L2."""
    if PREFETCH:
        # Launched before the previous kernel has finished (PDL), each program asks L2 for its share
        # of W, which no kernel writes; its loads after the wait then hit L2 instead of HBM.
        per_line: tl.constexpr = 1024 // w_ptr.dtype.element_ty.primitive_bitwidth   # elements in 128 bytes
        lines = tl.cdiv(N * stride_wn, per_line)
        share = tl.cdiv(lines, tl.num_programs(0))
        for i in range(tl.program_id(0) * share, (tl.program_id(0) + 1) * share, PREFETCH_LINES):
            offs = i + tl.arange(0, PREFETCH_LINES)
            prefetch_l2(w_ptr + offs.to(tl.int64) * per_line, offs < lines)
    wait_for_previous_kernel(PDL)
    # A residual product's y and split K's partial sums go through pointers (docstring).
    Y_TMA: tl.constexpr = SPLIT_K == 1 and not HAS_RESIDUAL
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_m * num_n
    # Every slice runs the same number of K steps (the last one's past K read zeros): a loop-invariant
    # trip count keeps the two loops one flat pipeline.
    slice_steps = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    # Each program walks (tile, slice) items pid, pid + grid, ...; flattening the two loops lets the
    # pipeliner issue the next tile's first loads while this tile's epilogue runs.
    for item in tl.range(tl.program_id(0), num_tiles * SPLIT_K, tl.num_programs(0), flatten=True):
        split, _, m0, n0 = _persistent_item(item, num_tiles, num_m, num_n, SPLIT_K, GROUP_M, BLOCK_M, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(0, slice_steps):
            k = split * slice_steps + step
            a = x_desc.load([m0, k * BLOCK_K])
            bt = w_desc.load([n0, k * BLOCK_K]).T
            acc = mma(a, bt, acc, INPUT_PRECISION, X_TF32, W_TF32)

        if item + tl.num_programs(0) >= num_tiles * SPLIT_K:  # this program's last tile
            start_next_kernel(PDL)
        _epilogue(acc, m0, n0, split, M, N, b_ptr, r_desc, y, 0, stride_ym, scale,
                  cos_ptr, sin_ptr, s_rope_h, rope_tokens, rope_prefix, rope_heads, rope_row0,
                  pre_ptr, stride_pm, col_scale_ptr, row_scale_ptr,
                  HAS_BIAS, ACT, GELU_FIT_DEGREE, HAS_RESIDUAL, HAS_SCALE, Y_TF32, True, Y_TMA, ROPE, ROPE_HALF,
                  HEAD_DIM, PRE_OUT, HAS_COL_SCALE, HAS_ROW_SCALE)


# 128 x 256 tiles in 4 stages of 32-deep steps: the residual GEMMs' pick before their y went through
# pointers, still some shapes' pick since.
WIDE_RESIDUAL = Config(128, 256, 32, 8, 4)
# The TMA kernel's candidates by dtype and row count, from sweeps on an H100 and an H200 at ViT-S/B/L shapes
# (scripts/sweep_kernels.py). Each list is short: every candidate of a new shape is compiled and timed once. A list's
# first config is what a tuner takes unseen inside a CUDA-graph capture: it fits every epilogue in an H100's 227 KB
# of shared memory (192 KB at most), where the 128 x 256 and 256 x 128 tiles in 3 stages need 240 KB with training's
# pre-activation and 272 KB with the rotation (the tuner skips them there).
LARGE_M = [
    Config(128, 128, 64, 8, 4), Config(128, 256, 64, 8, 3), Config(128, 128, 64, 8, 5), Config(128, 128, 64, 4, 4),
    Config(128, 128, 128, 8, 3), Config(256, 128, 64, 8, 3), WIDE_RESIDUAL,
]
SMALL_M = [   # a few thousand rows (ViT-B/16, 8 images): 128-row tiles, about one wave
    Config(128, 128, 64, 8, 4), Config(128, 256, 64, 8, 3), Config(128, 128, 64, 4, 4),
    Config(128, 128, 64, 4, 4, 0), Config(64, 256, 64, 4, 4),
]
TINY_M = [    # one or two images: 64-row tiles, narrow enough to give most SMs a tile
    Config(64, 128, 64, 4, 4), Config(64, 64, 128, 4, 4, 0), Config(64, 32, 128, 4, 4),
]
FLOAT32 = [Config(128, 128, 32, 8, 3), Config(128, 128, 64, 8, 3), Config(128, 128, 32, 4, 4),
           Config(64, 128, 32, 4, 4), Config(64, 64, 32, 4, 4, 0)]
# Between 512 and 1024 rows both tiny and small tiles compete. Powers of two, so that all the rows of one
# size_bucket (the tuning key) get one list.
TINY_M_ROWS, SMALL_M_ROWS = 1024, 2048


def _tma_candidates(M: int, dtype: torch.dtype) -> list[Config]:
    """The TMA kernel's list for this dtype and row count."""
    if INTERPRET:
        return [INTERPRETER]
    if dtype == torch.float32:
        return FLOAT32
    if M <= TINY_M_ROWS:
        return TINY_M if M <= TINY_M_ROWS // 2 else TINY_M + SMALL_M
    return SMALL_M if M <= SMALL_M_ROWS else LARGE_M


# split_k's rule (ViT-S/B/L on an H100): products of at most SPLIT_MAX_TILES
# 64 x 64 tiles an SM (32 x 32 under the interpreter) are cut into the most slices, up to MAX_SPLITS, that
# keep the launch at most SPLIT_PROGRAMS programs an SM, each slice at least SPLIT_MIN_DEPTH deep.
MAX_SPLITS = 4
SPLIT_MAX_TILES, SPLIT_PROGRAMS = 1, 2
SPLIT_TILE, SPLIT_MIN_DEPTH = (INTERPRETER.block_m, INTERPRETER.block_k) if INTERPRET else (64, 384)


def split_k(M: int, N: int, K: int, device: torch.device) -> int:
    """How many K slices to cut x [M, K] @ W^T [K, N] into (linear_partials): for a product of at most
    SPLIT_MAX_TILES tiles an SM (one wave or less, leaving SMs idle or each with one long K loop), the
    largest count up to MAX_SPLITS with at most SPLIT_PROGRAMS programs an SM and slices at least
    SPLIT_MIN_DEPTH deep; else 1 (no split). ViT-B/16 at one image: fc2 in 4 slices, proj in 2."""
    tiles = cdiv(M, SPLIT_TILE) * cdiv(N, SPLIT_TILE)
    sms = sm_count(device)
    if tiles > SPLIT_MAX_TILES * sms:
        return 1
    return next((s for s in range(MAX_SPLITS, 1, -1)
                 if tiles * s <= SPLIT_PROGRAMS * sms and K >= s * SPLIT_MIN_DEPTH), 1)


# whole_wave_rows' rule (ViT-B/L on an H100): a last wave at most this full, in a
# launch that would leave at least this share of its program slots idle (deep launches lost).
WAVE_SPLIT_FILL, WAVE_SPLIT_IDLE = 0.3, 0.125


def whole_wave_rows(M: int, N: int, config: Config, device: torch.device) -> int:
    """The rows of x [M, K] whose output tiles fill this config's whole waves (programs a wave: one or
    `persistent` a SM), when its last wave would be at most WAVE_SPLIT_FILL full and leave at least
    WAVE_SPLIT_IDLE of the launch's program slots empty; else M. ViT-B/16's proj and fc2 at 16 images:
    150 tiles of 128 x 128 on 132 SMs, so 2816 rows in one wave, then 336 rows in smaller tiles
    instead of 18 tiles on 18 SMs."""
    slots = sm_count(device) * max(config.persistent, 1)
    num_n = cdiv(N, config.block_n)
    waves, last = divmod(cdiv(M, config.block_m) * num_n, slots)
    rows = waves * slots // num_n * config.block_m
    idle = (slots - last) / ((waves + 1) * slots)
    return rows if 0 < last <= WAVE_SPLIT_FILL * slots and idle >= WAVE_SPLIT_IDLE and 0 < rows < M else M


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str = "none",
    residual: torch.Tensor | None = None,
    scale: float = 1.0,
    allow_tf32: bool | None = None,
    tf32_input: bool = False,
    tf32_output: bool = False,
    out: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    rope_half: bool = False,
    rope_prefix: int = 0,
    pre_out: torch.Tensor | None = None,
    col_scale: torch.Tensor | None = None,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = scale * (row_scale * col_scale * activation(x @ weight.T + bias) + residual) for 2-D x [M, K] and
    weight [N, K].

    activation: "none", "gelu" (exact erf), "gelu_tanh" or "quick_gelu" (x * sigmoid(1.702 x)); a bf16 or fp16 y
    gets them from one tanh an element, to within its rounding (activation.py). "swiglu": weight [2N, K] and bias
    [2N] hold a gate's and a value's rows interleaved (row 2j the gate's row j, 2j + 1 the value's), and
    y [M, N] = scale * (silu(x @ Wg.T + bg) * (x @ Wv.T + bv) + residual), Wg = weight[0::2], Wv = weight[1::2].
    allow_tf32: for float32 inputs; None follows torch.get_float32_matmul_precision().
    tf32_input, tf32_output: see tf32.py; they act only where the matmuls run on tf32.
    out must not alias x or residual.

    For training (linear_backward): pre_out [M, N] (N: weight's rows, 2N with swiglu), of x's dtype with unit stride
    along N, receives z = x @ weight.T + bias, rounded to the dtype, before the activation or rotation.
    col_scale [N] (x's dtype; LayerScale's gamma) multiplies each column of y's product before the residual is added,
    without activation or rope; row_scale [M] (float32; stochastic depth's 0 or 1 / keep_prob, repeated over an
    image's rows) each row, without rope.

    rope = (cos, sin): y = x @ weight.T + bias is a QKV projection, rows [B, T] and columns [3, H, Dh] (q, k, v),
    whose q and k of tokens t >= rope_prefix (the class and register tokens before them stay as they are) are
    rotated after y is rounded to its dtype, in fp32:

        y[t, d] -> y[t, d] cos[t', d] + sign(d) y[t, partner(d)] sin[t', d],   t' = t - rope_prefix

    interleaved pairs (rope_half False): partner(2i) = 2i + 1 with sign -1, partner(2i + 1) = 2i with sign +1;
    rope_half (rotate_half): partner(d) = d + Dh/2 with sign -1 for d < Dh/2, d - Dh/2 with sign +1 after, for a
    Dh that is a power of two up to ROPE_HALF_MAX_DIM. cos and sin: float32, contiguous, [T - rope_prefix, Dh] for
    all heads or [H, T - rope_prefix, Dh] a head each, each angle's value at both channels of its pair
    (interleaved: [a0, a0, a1, a1, ...]; half: [a0, a1, ..., a0, a1, ...]). No activation, residual or scale.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    weight, bias = _checked(x, weight, bias, residual, out, pre_out, col_scale, row_scale, *(rope or ()))
    M, N = x.shape[0], weight.shape[0]
    if activation == "swiglu":
        if N % 2:
            raise ValueError(f"swiglu's weight must have shape [2N, {x.shape[1]}], the gate's and the value's rows "
                             f"interleaved, got {tuple(weight.shape)}")
        N //= 2
    for name, t, shape in (("residual", residual, (M, N)), ("out", out, (M, N)),
                           ("pre_out", pre_out, (M, weight.shape[0]))):
        if t is not None:
            check_matrix(name, t, shape, x.dtype)
    if col_scale is not None:
        if activation != "none" or rope is not None:
            raise ValueError(f"col_scale scales a product without activation or rope, got activation {activation!r}"
                             f" and {'a' if rope is not None else 'no'} rope")
        check_shape("col_scale", col_scale, (N,))
        check_dtype("col_scale", col_scale, x.dtype)
        col_scale = col_scale.contiguous()
    if row_scale is not None:
        if rope is not None:
            raise ValueError("row_scale scales a product without rope")
        check_shape("row_scale", row_scale, (M,))
        check_dtype("row_scale", row_scale, torch.float32)
        row_scale = row_scale.contiguous()
    if out is None:
        out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    rotation = NO_ROPE if rope is None else check_rope(rope, M, N, rope_half, rope_prefix, activation, residual,
                                                         scale)
    weight, precision = _precision(x, weight, allow_tf32, tf32_input)
    flags = dict(HAS_BIAS=bias is not None, ACT=activation, GELU_FIT_DEGREE=gelu_fit_degree(x.dtype, activation),
                 HAS_RESIDUAL=residual is not None,
                 HAS_SCALE=scale != 1.0, **precision, Y_TF32=precision["INPUT_PRECISION"] == "tf32" and tf32_output,
                 ROPE=rope is not None, ROPE_HALF=rope is not None and rope_half,
                 HEAD_DIM=0 if rope is None else rope[0].shape[-1], PRE_OUT=pre_out is not None,
                 HAS_COL_SCALE=col_scale is not None, HAS_ROW_SCALE=row_scale is not None, SPLIT_K=1)
    _tuned_launch(x, weight, bias, residual, out, scale, flags, rotation, Extras(pre_out, col_scale, row_scale))
    return out


def check_matrix(name: str, t: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype, along: str = "N") -> None:
    """t of this shape [rows, `along`] and dtype, with unit stride along its rows."""
    check_shape(name, t, shape)
    check_dtype(name, t, dtype)
    if t.stride(1) != 1:
        raise ValueError(f"{name} must have unit stride along {along}, got strides {t.stride()}")


class Extras(NamedTuple):
    """linear's training arguments, as the kernels take them: pre_out, col_scale, row_scale (or None)."""

    pre: torch.Tensor | None = None
    col_scale: torch.Tensor | None = None
    row_scale: torch.Tensor | None = None

    def rows(self, part: slice) -> Extras:
        """The same for a launch over these rows of x."""
        return self._replace(pre=None if self.pre is None else self.pre[part],
                             row_scale=None if self.row_scale is None else self.row_scale[part])

    def launch_args(self) -> tuple:
        return self.pre, 0 if self.pre is None else self.pre.stride(0), self.col_scale, self.row_scale


NO_EXTRAS = Extras()


class Rope(NamedTuple):
    """The rotation's launch arguments (_rotate's): the tables, their head stride (0: shared by the heads), the
    tokens of an image, the unrotated prefix, the heads, and the image row of x's first row."""

    cos: torch.Tensor | None
    sin: torch.Tensor | None
    head_stride: int
    tokens: int
    prefix: int
    heads: int
    row0: int = 0


NO_ROPE = Rope(None, None, 0, 1, 0, 1)
ROPE_HALF_MAX_DIM = 128   # pairs a half apart need a whole head in a tile: tiles at most 256 wide hold one


def check_rope(rope, M: int, N: int, half: bool, prefix: int, activation: str, residual, scale: float) -> Rope:
    """linear's rope = (cos, sin) checked against y [M, N]; returns the kernels' Rope."""
    if activation != "none" or residual is not None or scale != 1.0:
        raise ValueError(f"rope rotates a QKV projection: it takes no activation, residual or scale, got activation "
                         f"{activation!r}, {'a' if residual is not None else 'no'} residual and scale {scale}")
    cos, sin = rope
    if cos.dim() not in (2, 3) or cos.shape != sin.shape:
        raise ValueError(f"rope cos and sin must have one shape [(H,) T - rope_prefix, Dh], got {tuple(cos.shape)} "
                         f"and {tuple(sin.shape)}")
    rows, dh = cos.shape[-2:]
    heads = N // (3 * dh) if dh else 0
    for name, t in (("cos", cos), ("sin", sin)):
        check_dtype(f"rope {name}", t, torch.float32)
        if not t.is_contiguous():
            raise ValueError(f"rope {name} must be contiguous, got strides {t.stride()}")
    if dh % 2 or not heads or N != 3 * heads * dh or (cos.dim() == 3 and cos.shape[0] != heads):
        raise ValueError(f"rope needs y's {N} columns as [3, H, Dh] (q, k, v) with an even Dh, cos.shape[-1], and "
                         f"H tables a head if any, got tables of shape {tuple(cos.shape)}")
    if half and (dh & (dh - 1) or dh > ROPE_HALF_MAX_DIM):
        raise ValueError(f"rope_half needs a head dim that is a power of two up to {ROPE_HALF_MAX_DIM}, got {dh}")
    tokens = prefix + rows
    if prefix < 0 or M % tokens:
        raise ValueError(f"rope needs x's {M} rows as [B, T] with T = rope_prefix + cos.shape[-2] = {prefix} + {rows}"
                         f" and rope_prefix >= 0")
    return Rope(cos, sin, cos.stride(0) if cos.dim() == 3 else 0, tokens, prefix, heads)


def linear_partials(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    splits: int,
    *,
    allow_tf32: bool | None = None,
    tf32_input: bool = False,
) -> torch.Tensor:
    """x @ weight.T + bias as `splits` fp32 partial sums parts [splits, M, N] over consecutive slices of
    K (parts[0] holds the bias): parts.sum(0) is the product. For products too small to fill the GPU
    (split_k); layer_norm's add_layer_norm adds the parts to the residual stream. tf32_input: as linear's."""
    if not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be between 1 and {MAX_SPLITS}, got {splits}")
    weight, bias = _checked(x, weight, bias)
    M, N = x.shape[0], weight.shape[0]
    parts = torch.empty((splits * M, N), device=x.device, dtype=torch.float32)   # the slices one above the other
    weight, precision = _precision(x, weight, allow_tf32, tf32_input)
    flags = dict(HAS_BIAS=bias is not None, ACT="none", GELU_FIT_DEGREE=0, HAS_RESIDUAL=False, HAS_SCALE=False,
                 **precision, Y_TF32=False, ROPE=False, ROPE_HALF=False, HEAD_DIM=0, PRE_OUT=False,
                 HAS_COL_SCALE=False, HAS_ROW_SCALE=False, SPLIT_K=splits)
    _tuned_launch(x, weight, bias, None, parts, 1.0, flags)
    return parts.view(splits, M, N)


def _checked(x, weight, bias, *others):
    """Checks x [M, K], weight [N, K], bias [N] (and that others share their device); returns weight
    and bias as the kernel reads them."""
    check_device(x, weight, bias, *others)
    check_float("x", x)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D [M, K] with unit stride along K, got shape {tuple(x.shape)} "
                         f"and strides {x.stride()}")
    M, K = x.shape
    N = weight.shape[0]
    check_shape("weight", weight, (N, K))
    check_dtype("weight", weight, x.dtype)
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    if bias is not None:
        check_shape("bias", bias, (N,))
        check_dtype("bias", bias, x.dtype)
        bias = bias.contiguous()
    return weight, bias


def _precision(x, weight, allow_tf32: bool | None, tf32_input: bool) -> tuple[torch.Tensor, dict]:
    """(weight as the kernel reads it, the INPUT_PRECISION, X_TF32 and W_TF32 flags): with tf32 matmuls,
    W as tf32_weight gives it (its kept rounded copy, tf32.py), and x taken as it is when its producer
    stored it rounded."""
    precision = input_precision(x.dtype, allow_tf32)
    weight, w_tf32 = tf32_weight(weight, x.shape[0], precision)
    return weight, dict(INPUT_PRECISION=precision, X_TF32=precision == "tf32" and tf32_input, W_TF32=w_tf32)


# The tuner's disk cache is keyed by the kernels' source: a change to them or the candidates starts afresh.
_TUNER_SOURCE = "".join(Path(__file__).with_name(name).read_text() for name in ("linear.py", "activation.py"))
_TUNER = Tuner("linear", _TUNER_SOURCE)


def _tuned_launch(x, weight, bias, residual, out, scale: float, flags: dict, rope: Rope = NO_ROPE,
                  extras: Extras = NO_EXTRAS, split_waves: bool = True) -> None:
    """Launches the TMA kernel where every matrix is tma_ready, else the plain one, with the fastest of its
    candidate configs for this shape (its rows in size_bucket) and these flags. A config whose last wave would
    leave most SMs idle runs (and is timed) as the rows of its whole waves, then the rest with a config tuned for
    them alone (whole_wave_rows; split_waves=False for that rest)."""
    M, K = x.shape
    N = weight.shape[0]
    tma = tma_ready(x, weight, residual, out)   # and so is every range of their rows

    def rows_of(part: slice) -> tuple:
        """The arguments of a launch over these rows of x, residual and out, but the rotation's and the extras'."""
        return x[part], weight, bias, None if residual is None else residual[part], out[part], scale, flags

    def launch(config: Config) -> None:
        rows = whole_wave_rows(M, N, config, x.device) if split_waves and flags["SPLIT_K"] == 1 else M
        if rows == M:
            return launch_linear(config, x, weight, bias, residual, out, scale, flags, tma, rope, extras)
        head, rest = slice(0, rows), slice(rows, None)
        launch_linear(config, *rows_of(head), tma, rope, extras.rows(head))
        _tuned_launch(*rows_of(rest), rope._replace(row0=rope.row0 + rows), extras.rows(rest), split_waves=False)

    # Nearby row counts share a pick (size_bucket); N and K are the weight's. The launches take the exact M.
    key = (size_bucket(M), N, K, str(x.dtype), *flags.values(), tma, split_waves)
    candidates = (_tma_candidates if tma else _plain_candidates)(M, x.dtype)
    if flags["ROPE_HALF"]:   # a tile holds whole heads, so that each channel's partner is in it
        candidates = list(dict.fromkeys(c._replace(block_n=max(c.block_n, flags["HEAD_DIM"])) for c in candidates))
    launch(_TUNER.pick(key, candidates, launch, x.device))


def launch_linear(config: Config, x, weight, bias, residual, out, scale: float, flags: dict, tma: bool,
                  rope: Rope = NO_ROPE, extras: Extras = NO_EXTRAS) -> None:
    """One launch with this config (checked inputs, flags as linear or linear_partials make them, rope as check_rope
    makes it, extras as linear's): of the TMA kernel where tma (every matrix tma_ready), persistent as
    config.persistent says, else of the plain kernel, one program per tile and slice whatever config.persistent
    says."""
    M, K = x.shape
    N = weight.shape[0]
    bm, bn, bk, warps, stages, persistent = config
    tiles, splits = cdiv(M, bm) * cdiv(N, bn), flags["SPLIT_K"]
    launch_pdl = pdl(x.device, tiles * splits)
    tile = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    if not tma:
        _linear_plain_kernel[(tiles, splits)](
            x, weight, bias, residual, out, M, N, K,
            x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), scale,
            *rope, *extras.launch_args(), **flags, **launch_pdl, **tile,
        )
        return
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(weight, [bn, bk])
    out_bn = bn // 2 if flags["ACT"] == "swiglu" else bn   # swiglu: a y tile is half the product's
    r_desc = TensorDescriptor.from_tensor(residual, [bm, out_bn]) if residual is not None else None
    # y through a descriptor but for a residual product and split K's partial sums (_linear_tma_kernel)
    y = out if residual is not None or splits > 1 else TensorDescriptor.from_tensor(out, [bm, out_bn])
    items = tiles * splits
    grid = (min(items, sm_count(x.device) * persistent) if persistent else items,)
    _linear_tma_kernel[grid](
        x_desc, w_desc, bias, r_desc, y, weight, M, N, K, weight.stride(0), out.stride(0), scale, *rope,
        *extras.launch_args(), **flags, **launch_pdl, PREFETCH=launch_pdl["PDL"] != PDL_OFF, **tile,
    )


# ------------------------------------------------------------------------------------------------------ backward


@triton.jit
def _grad_kernel(dy_ptr, pre_ptr, row_scale_ptr, dz_ptr, M, N, stride_dym, stride_pm, stride_dzm, scale,
                 cos_ptr, sin_ptr, s_rope_h, rope_tokens, rope_prefix, rope_heads, rope_row0,   # _rotate's, with ROPE
                 ACT: tl.constexpr, HAS_ROW_SCALE: tl.constexpr, HAS_SCALE: tl.constexpr, ROPE: tl.constexpr,
                 ROPE_HALF: tl.constexpr, HEAD_DIM: tl.constexpr, PDL: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dz, the gradient at z = x W^T + b, from dy [M, N], the gradient at y, for the BLOCK_M x BLOCK_N tile of dy
    that this program owns: g = scale * row_scale[m] * dy, then g * act'(pre) (pre and dz [M, N]; swiglu: [M, 2N],
    gate and value columns interleaved, two for each column of dy), or g turned back by the inverse rotation (ROPE).
    Any float row_scale [M] (linear_backward also makes diag(gamma) W with it). In fp32, rounded once to dz's dtype.

    Per element of dy: a few FLOPs (the activation's derivative: an exp2 and a reciprocal); dy read, pre read and dz
    written (2x with swiglu)."""
    wait_for_previous_kernel(PDL)
    m0 = tl.program_id(0) * BLOCK_M
    n0 = tl.program_id(1) * BLOCK_N
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    rows = offs_m[:, None].to(tl.int64)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    g = tl.load(dy_ptr + rows * stride_dym + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g *= scale
    if HAS_ROW_SCALE:
        g *= tl.load(row_scale_ptr + offs_m, mask=offs_m < M, other=0.0).to(tl.float32)[:, None]
    if ROPE:
        g = _rotate(g, m0, n0, M, cos_ptr, sin_ptr, s_rope_h, rope_tokens, rope_prefix, rope_heads, rope_row0,
                    HEAD_DIM, ROPE_HALF, True)
    if ACT == "swiglu":   # a column of dy is a gate's and a value's column of pre and dz
        offs_n = 2 * n0 + tl.arange(0, 2 * BLOCK_N)
        mask = (offs_m < M)[:, None] & (offs_n < 2 * N)[None, :]
    if ACT != "none":
        pre = tl.load(pre_ptr + rows * stride_pm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        g = activation_grad(pre, g, ACT)
    start_next_kernel(PDL)
    tl.store(dz_ptr + rows * stride_dzm + offs_n[None, :], cast(g, dz_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dx_epilogue(acc, m0, k0, M, K, out, stride_om, x_pre_ptr, stride_xpm, x_ptr, stride_xm,
                 STORE_OUT: tl.constexpr, X_ACT: tl.constexpr, GELU_FIT_DEGREE: tl.constexpr, STORE_X: tl.constexpr,
                 OUT_TMA: tl.constexpr):
    """The dX product's tile acc of dz @ W at (m0, k0), of dx [M, K]: stored as it is, or, where x was X_ACT(x_pre)
    (the fused MLP backward), as d x_pre = acc * X_ACT'(x_pre) (swiglu: [BM, 2 BK] at (m0, 2 k0), of [M, 2K]), and x
    recomputed from x_pre as the forward's epilogue made it (STORE_X), for the dW product."""
    offs_m = m0 + tl.arange(0, acc.shape[0])
    offs_k = k0 + tl.arange(0, acc.shape[1])
    rows = offs_m[:, None].to(tl.int64)
    mask = (offs_m < M)[:, None] & (offs_k < K)[None, :]
    if X_ACT != "none":
        if X_ACT == "swiglu":   # a column of x is a gate's and a value's column of x_pre
            k0 = 2 * k0
            K = 2 * K
            offs_pre = k0 + tl.arange(0, 2 * acc.shape[1])
        else:
            offs_pre = offs_k
        mask_pre = (offs_m < M)[:, None] & (offs_pre < K)[None, :]
        pre = tl.load(x_pre_ptr + rows * stride_xpm + offs_pre[None, :], mask=mask_pre, other=0.0).to(tl.float32)
        if STORE_X:
            x = apply_activation(pre, X_ACT, GELU_FIT_DEGREE)
            tl.store(x_ptr + rows * stride_xm + offs_k[None, :], cast(x, x_ptr.dtype.element_ty), mask=mask)
        acc = activation_grad(pre, acc, X_ACT)
        offs_k = offs_pre
        mask = mask_pre
    if STORE_OUT:
        _store_tile(out, acc, m0, k0, rows * stride_om + offs_k[None, :], mask, OUT_TMA)


@triton.jit
def _dw_epilogue(acc, n0, k0, split, pid_k, num_k, N, K, out, stride_on, gamma_ptr, w_ptr, stride_wn, dgamma_ptr,
                 STORE_OUT: tl.constexpr, HAS_GAMMA: tl.constexpr, DGAMMA: tl.constexpr, OUT_TMA: tl.constexpr):
    """The dW product's tile acc of G = dz^T x at (n0, k0), of G [N, K] (over split `split`'s rows of dz and x
    where SPLIT > 1). With gamma (HAS_GAMMA, linear's col_scale: dz was scale * dy * row_scale, before gamma),
    dW = gamma G; DGAMMA: d gamma_n's part sum_k W_nk G_nk to dgamma [SPLIT * num_k, N] (its bias term b_n times dz's
    column sums is added by linear_backward). dW is stored in its dtype where SPLIT is 1, else as fp32 partial sums
    out [SPLIT * N, K]."""
    offs_n = n0 + tl.arange(0, acc.shape[0])
    offs_k = k0 + tl.arange(0, acc.shape[1])
    rows = offs_n[:, None].to(tl.int64)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    if DGAMMA:   # W's tile meets G's here: no second pass over W
        w = tl.load(w_ptr + rows * stride_wn + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(dgamma_ptr + (split * num_k + pid_k) * N + offs_n, tl.sum(w * acc, 1), mask=offs_n < N)
    if HAS_GAMMA:
        acc *= tl.load(gamma_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[:, None]
    if STORE_OUT:
        _store_tile(out, acc, n0, k0, (rows + split * N) * stride_on + offs_k[None, :], mask, OUT_TMA)


@triton.jit
def _linear_backward_plain_kernel(
    a_ptr, b_ptr, out_ptr,
    P, Q, R,
    stride_ap, stride_ar, stride_br, stride_op,   # A [P, R] at a_ptr + p * stride_ap + r * stride_ar
    x_pre_ptr, stride_xpm, x_ptr, stride_xm,   # the dX epilogue's, with X_ACT
    gamma_ptr, w_ptr, stride_wn, dgamma_ptr,   # the dW epilogue's
    DW: tl.constexpr,   # False: dx = dz @ W, A = dz [M, N], B = W [N, K]; True: dW = dz^T @ x, A = dz^T, B = x [M, K]
    STORE_OUT: tl.constexpr,   # the product's tile is stored (dX: else only x is recomputed)
    X_ACT: tl.constexpr, GELU_FIT_DEGREE: tl.constexpr, STORE_X: tl.constexpr,   # _dx_epilogue's
    HAS_GAMMA: tl.constexpr, DGAMMA: tl.constexpr,   # _dw_epilogue's
    INPUT_PRECISION: tl.constexpr, A_TF32: tl.constexpr, B_TF32: tl.constexpr,   # A, B hold tf32 values already
    PDL: tl.constexpr,
    SPLIT: tl.constexpr,   # > 1 (dW): the rows of dz and x cut into SPLIT slices, their sums fp32 partials
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """The forward plain kernel's loop for the backward's two products, C [P, Q] = A [P, R] @ B [R, Q] (BLOCK_M x
    BLOCK_N tiles of C, BLOCK_K-deep steps along R): B is row-major [R, Q] in both, so read as it lies (no
    transposed copy of W or x), and A's strides say whether it is dz or dz^T. dX: P = M, Q = K, R = N (W's rows);
    dW: P = N, Q = K, R = M.
    One program per tile of C and split; masked pointer loads, zeros past P, Q, R.

    Per program: 2 * BLOCK_M * BLOCK_N * R / SPLIT FLOPs, (BLOCK_M + BLOCK_N) * R / SPLIT elements read, one tile
    written (twice as wide with swiglu's d x_pre, and x's tile when recomputed)."""
    PRODUCT: tl.constexpr = STORE_OUT or DGAMMA
    wait_for_previous_kernel(PDL)
    pid_m, pid_n = _tile_coords(tl.program_id(0), tl.cdiv(P, BLOCK_M), tl.cdiv(Q, BLOCK_N), GROUP_M)
    split = tl.program_id(1)
    slice_steps = tl.cdiv(tl.cdiv(R, BLOCK_K), SPLIT)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PRODUCT:
        for step in range(0, slice_steps):
            offs_k = (split * slice_steps + step) * BLOCK_K + tl.arange(0, BLOCK_K)
            a = tl.load(a_ptr + offs_m[:, None].to(tl.int64) * stride_ap + offs_k[None, :].to(tl.int64) * stride_ar,
                        mask=(offs_m < P)[:, None] & (offs_k < R)[None, :], other=0.0)
            b = tl.load(b_ptr + offs_k[:, None].to(tl.int64) * stride_br + offs_n[None, :],
                        mask=(offs_k < R)[:, None] & (offs_n < Q)[None, :], other=0.0)
            acc = mma(a, b, acc, INPUT_PRECISION, A_TF32, B_TF32)
    start_next_kernel(PDL)
    if DW:
        _dw_epilogue(acc, pid_m * BLOCK_M, pid_n * BLOCK_N, split, pid_n, tl.cdiv(Q, BLOCK_N), P, Q, out_ptr,
                     stride_op, gamma_ptr, w_ptr, stride_wn, dgamma_ptr, STORE_OUT, HAS_GAMMA, DGAMMA, False)
    else:
        _dx_epilogue(acc, pid_m * BLOCK_M, pid_n * BLOCK_N, P, Q, out_ptr, stride_op, x_pre_ptr, stride_xpm, x_ptr,
                     stride_xm, STORE_OUT, X_ACT, GELU_FIT_DEGREE, STORE_X, False)


@triton.jit
def _linear_backward_tma_kernel(
    a_desc, b_desc, out,   # out: a TMA descriptor where OUT_TMA, else a pointer
    P, Q, R, stride_op,
    x_pre_ptr, stride_xpm, x_ptr, stride_xm,   # the dX epilogue's, with X_ACT
    gamma_ptr, w_ptr, stride_wn, dgamma_ptr,   # the dW epilogue's
    DW: tl.constexpr, STORE_OUT: tl.constexpr,   # as the plain kernel's
    X_ACT: tl.constexpr, GELU_FIT_DEGREE: tl.constexpr, STORE_X: tl.constexpr,   # _dx_epilogue's
    HAS_GAMMA: tl.constexpr, DGAMMA: tl.constexpr,   # _dw_epilogue's
    INPUT_PRECISION: tl.constexpr, A_TF32: tl.constexpr, B_TF32: tl.constexpr,
    OUT_TMA: tl.constexpr, PDL: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """The plain backward kernel's products through TMA descriptors built on the host, in the forward TMA kernel's
    persistent loop over (tile, split) items. A's descriptor is over dz with [BLOCK_M, BLOCK_K] blocks (dX), or
    [BLOCK_K, BLOCK_M] blocks read transposed (dW: dz^T, the tensor cores take it from shared memory as it lies).
    Per item as the plain kernel's program."""
    PRODUCT: tl.constexpr = STORE_OUT or DGAMMA
    wait_for_previous_kernel(PDL)
    num_m = tl.cdiv(P, BLOCK_M)
    num_n = tl.cdiv(Q, BLOCK_N)
    num_tiles = num_m * num_n
    slice_steps = tl.cdiv(tl.cdiv(R, BLOCK_K), SPLIT)
    for item in tl.range(tl.program_id(0), num_tiles * SPLIT, tl.num_programs(0), flatten=True):
        split, pid_n, m0, n0 = _persistent_item(item, num_tiles, num_m, num_n, SPLIT, GROUP_M, BLOCK_M, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if PRODUCT:
            for step in range(0, slice_steps):
                k = (split * slice_steps + step) * BLOCK_K
                if DW:
                    a = a_desc.load([k, m0]).T
                else:
                    a = a_desc.load([m0, k])
                acc = mma(a, b_desc.load([k, n0]), acc, INPUT_PRECISION, A_TF32, B_TF32)
        if item + tl.num_programs(0) >= num_tiles * SPLIT:  # this program's last tile
            start_next_kernel(PDL)
        if DW:
            _dw_epilogue(acc, m0, n0, split, pid_n, num_n, P, Q, out, stride_op, gamma_ptr, w_ptr, stride_wn,
                         dgamma_ptr, STORE_OUT, HAS_GAMMA, DGAMMA, OUT_TMA)
        else:
            _dx_epilogue(acc, m0, n0, P, Q, out, stride_op, x_pre_ptr, stride_xpm, x_ptr, stride_xm, STORE_OUT, X_ACT,
                         GELU_FIT_DEGREE, STORE_X, OUT_TMA)


@triton.jit
def _sum_kernel(parts_ptr, out_ptr, S, numel, PDL: tl.constexpr, BLOCK: tl.constexpr):
    """out = the sum of the S fp32 slices parts [S, numel], in slice order (so the same bits every run), rounded
    once to out's dtype. numel * (S reads + 1 write)."""
    wait_for_previous_kernel(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(0, S):
        acc += tl.load(parts_ptr + s * numel + offs, mask=mask, other=0.0)
    start_next_kernel(PDL)
    tl.store(out_ptr + offs, cast(acc, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _column_sums_kernel(a_ptr, parts_ptr, M, N, stride_am, ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    """parts[i, n] = the fp32 sum of a[m, n] over program row i's ROWS rows (BLOCK_M at a time), for a [M, N] with
    unit stride along N; _sum_kernel adds the programs' rows. M*N reads, N writes a program."""
    wait_for_previous_kernel(PDL)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for m0 in range(tl.program_id(0) * ROWS, tl.minimum((tl.program_id(0) + 1) * ROWS, M), BLOCK_M):
        offs_m = m0 + tl.arange(0, BLOCK_M)
        acc += tl.load(a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_n[None, :],
                       mask=(offs_m < M)[:, None] & (offs_n < N)[None, :], other=0.0).to(tl.float32)
    start_next_kernel(PDL)
    tl.store(parts_ptr + tl.program_id(0) * N + offs_n, tl.sum(acc, 0), mask=offs_n < N)


COLUMN_TILE = (32, 32) if INTERPRET else (32, 128)   # _column_sums_kernel's BLOCK_M, BLOCK_N


def column_sums(a: torch.Tensor) -> torch.Tensor:
    """The column sums of a [M, N] (unit stride along N) in fp32, [N]: about four programs an SM each sum a run of
    rows, then one sum over the runs (in their order: the same bits every run)."""
    M, N = a.shape
    bm, bn = COLUMN_TILE
    columns = cdiv(N, bn)
    runs = max(1, min(cdiv(M, bm), 4 * sm_count(a.device) // columns))
    rows = cdiv(cdiv(M, runs), bm) * bm
    runs = cdiv(M, rows)
    parts = torch.empty((runs, N), device=a.device, dtype=torch.float32)
    _column_sums_kernel[(runs, columns)](a, parts, M, N, a.stride(0), ROWS=rows, BLOCK_M=bm, BLOCK_N=bn,
                                         num_warps=4, **pdl(a.device, runs * columns))
    out = torch.empty(N, device=a.device, dtype=torch.float32)
    _sum_slices(parts, out)
    return out


GRAD_TILE = (32, 128)   # _grad_kernel's BLOCK_M, BLOCK_N: elementwise, a 16 KB bf16 tile of dy a program
SUM_BLOCK = 1024
# The backward products' TMA candidates, for the dX product's [M, K] and the dW product's [N, K] (a few row tiles,
# split along M below): the forward's large-M tiles, until a GPU sweep says otherwise. The first fits every epilogue
# (192 KB at most); the 128 x 256 and 256 x 128 tiles do not with GELU's derivative (240 KB) or split dW's partial
# sums (272 KB).
BACKWARD = [Config(128, 128, 64, 8, 4), Config(128, 256, 64, 8, 3), Config(128, 128, 64, 4, 4),
            Config(256, 128, 64, 8, 3)]


def _backward_candidates(tma: bool, dtype: torch.dtype) -> list[Config]:
    """The backward kernel's list for this path and dtype."""
    if INTERPRET:
        return [INTERPRETER]
    if not tma:
        return PLAIN_FLOAT32 if dtype == torch.float32 else PLAIN
    return FLOAT32 if dtype == torch.float32 else BACKWARD


# dweight_splits' rule: the dW product's few tiles (ViT-B/16's proj: 36 of 128 x 128) brought up to about one
# program an SM by cutting its rows (tens of thousands in training) into slices, each at least this deep.
DW_MAX_SPLITS = 16
DW_SPLIT_MIN_ROWS = INTERPRETER.block_k if INTERPRET else 1024


def dweight_splits(N: int, K: int, M: int, config: Config, device: torch.device) -> int:
    """How many slices of its M rows the dW product dz^T x [N, K] is cut into with this config: the most, up to
    DW_MAX_SPLITS, that keep its tiles times slices within one program an SM, each slice at least DW_SPLIT_MIN_ROWS
    deep; 1 for a product of at least as many tiles as SMs."""
    tiles = cdiv(N, config.block_m) * cdiv(K, config.block_n)
    return max(1, min(sm_count(device) // tiles, DW_MAX_SPLITS, M // DW_SPLIT_MIN_ROWS))


class _Epilogue(NamedTuple):
    """The backward epilogues' tensors other than A, B and the product's output (None where unused): the dX
    product's x_pre and recomputed x; the dW product's gamma, W and d gamma's partial sums."""

    x_pre: torch.Tensor | None = None
    x: torch.Tensor | None = None
    gamma: torch.Tensor | None = None
    weight: torch.Tensor | None = None
    dgamma: torch.Tensor | None = None

    def launch_args(self) -> tuple:
        return (self.x_pre, _row_stride(self.x_pre), self.x, _row_stride(self.x), self.gamma, self.weight,
                _row_stride(self.weight), self.dgamma)


def _row_stride(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.stride(0)


def linear_backward(
    dy: torch.Tensor,
    x: torch.Tensor | None,
    weight: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str = "none",
    pre: torch.Tensor | None = None,
    scale: float = 1.0,
    col_scale: torch.Tensor | None = None,
    row_scale: torch.Tensor | None = None,
    rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    rope_half: bool = False,
    rope_prefix: int = 0,
    x_activation: str = "none",
    x_pre: torch.Tensor | None = None,
    need_dx: bool = True,
    need_dweight: bool = True,
    need_dbias: bool = True,
    need_col_scale: bool = False,
    allow_tf32: bool | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dweight, dbias, dcol_scale), the gradients of linear's y = scale * (row_scale * col_scale * act(z) +
    residual), z = x @ weight.T + bias (rotated by rope where given), from dy [M, N], the gradient at y (the
    residual's is scale * dy: no kernel here). The arguments are the forward's, and pre its pre_out (required with
    an activation). Each gradient is None where not needed (or where its tensor is: no bias, no col_scale), and
    costs no work then: a frozen weight costs no dW product.

    dz = act'(pre) * (scale * row_scale * col_scale * dy) (swiglu: [M, 2N], interleaved as weight's rows), or dy
    turned back by the inverse rotation; dx = dz @ weight [M, K]; dweight = dz^T @ x [N, K]; dbias = dz's column
    sums; dcol_scale = the column sums of scale * row_scale * dy * z, from z = x @ weight.T + bias in the dW
    product's epilogue (no z is kept). Accumulated in fp32, each rounded once to x's dtype.

    x_activation (the fused MLP backward, fc2's of fc1 -> act -> fc2): x was x_activation(x_pre), x_pre [M, K]
    ([M, 2K] with swiglu) being fc1's pre_out; dx is then d x_pre = (dz @ weight) * x_activation'(x_pre), in the
    same shape as x_pre, and x may be None: it is recomputed from x_pre as fc1's epilogue made it.
    allow_tf32: as linear's."""
    for name, act in (("activation", activation), ("x_activation", x_activation)):
        if act not in ACTIVATIONS:
            raise ValueError(f"{name} must be one of {ACTIVATIONS}, got {act!r}")
    check_device(dy, x, weight, bias, pre, col_scale, row_scale, x_pre, *(rope or ()))
    check_float("dy", dy)
    if dy.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"dy and weight must be 2-D, got shapes {tuple(dy.shape)} and {tuple(weight.shape)}")
    (M, N), (rows, K) = dy.shape, weight.shape
    dtype = dy.dtype
    check_matrix("dy", dy, (M, N), dtype)
    check_shape("weight", weight, (2 * N if activation == "swiglu" else N, K))
    check_dtype("weight", weight, dtype)
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    if bias is not None:
        check_shape("bias", bias, (rows,))
        check_dtype("bias", bias, dtype)
        bias = bias.contiguous()
    if activation != "none":
        if pre is None:
            raise ValueError(f"activation {activation!r} needs pre, the forward's pre_out [{M}, {rows}]")
        check_matrix("pre", pre, (M, rows), dtype)
    if x_activation != "none":
        if x_pre is None:
            raise ValueError(f"x_activation {x_activation!r} needs x_pre, the input of x's activation")
        check_matrix("x_pre", x_pre, (M, 2 * K if x_activation == "swiglu" else K), dtype, along="its columns")
    if x is None and x_activation == "none":
        raise ValueError("x may be None only with an x_activation and x_pre, from which it is recomputed")
    if x is not None:
        check_matrix("x", x, (M, K), dtype, along="K")
    if col_scale is not None:
        if activation != "none" or rope is not None:
            raise ValueError(f"col_scale scales a product without activation or rope, got activation {activation!r}"
                             f" and {'a' if rope is not None else 'no'} rope")
        check_shape("col_scale", col_scale, (N,))
        check_dtype("col_scale", col_scale, dtype)
        col_scale = col_scale.contiguous()
    if row_scale is not None:
        if rope is not None:
            raise ValueError("row_scale scales a product without rope")
        check_shape("row_scale", row_scale, (M,))
        check_dtype("row_scale", row_scale, torch.float32)
        row_scale = row_scale.contiguous()
    rotation = NO_ROPE if rope is None else check_rope(rope, M, N, rope_half, rope_prefix, activation, None, scale)

    need_dbias = need_dbias and bias is not None
    need_col_scale = need_col_scale and col_scale is not None
    precision = input_precision(dtype, allow_tf32)

    def empty(*shape: int) -> torch.Tensor:
        return torch.empty(shape, device=dy.device, dtype=dtype)

    dz = _output_grad(dy, pre, row_scale, scale, activation, rotation, rope_half)
    dx = x_out = dweight = dbias = dgamma = None
    product_dw = need_dweight or need_col_scale
    if need_dx or (x is None and product_dw):
        if need_dx:
            dx = empty(M, K) if x_activation == "none" else empty(*x_pre.shape)
        x_out = empty(M, K) if x is None and product_dw else None
        if not need_dx:   # x alone is recomputed: W is not read
            w, w_tf32 = weight, False
        elif col_scale is None:
            w, w_tf32 = tf32_weight(weight, M, precision)
        else:   # gamma on dz's columns is gamma on W's rows: diag(gamma) W, N x K, made once
            w, w_tf32 = _output_grad(weight, None, col_scale, 1.0, "none", NO_ROPE, False), False
        flags = dict(DW=False, STORE_OUT=need_dx, X_ACT=x_activation,
                     GELU_FIT_DEGREE=gelu_fit_degree(dtype, x_activation), STORE_X=x_out is not None,
                     HAS_GAMMA=False, DGAMMA=False, INPUT_PRECISION=precision, A_TF32=False, B_TF32=w_tf32)
        _tuned_backward(dz, w, dx, flags, _Epilogue(x_pre=x_pre, x=x_out))
        x = x if x is not None else x_out
    # dz's column sums, for dbias and for d gamma's bias term: a pass of their own, since summing the A tiles in the
    # dW product takes them out of the tensor cores' pipeline (3-4x slower products on an H200)
    colsum = column_sums(dz) if need_dbias or (need_col_scale and bias is not None) else None
    if need_dbias:
        dbias = (colsum if col_scale is None else colsum * col_scale.float()).to(dtype)
    if product_dw:
        dweight = torch.empty_like(weight, memory_format=torch.contiguous_format) if need_dweight else None
        flags = dict(DW=True, STORE_OUT=need_dweight, X_ACT="none", GELU_FIT_DEGREE=0, STORE_X=False,
                     HAS_GAMMA=col_scale is not None, DGAMMA=need_col_scale, INPUT_PRECISION=precision, A_TF32=False,
                     B_TF32=False)
        parts = torch.empty(N, device=dy.device, dtype=torch.float32) if need_col_scale else None
        _tuned_backward(dz, x, dweight, flags, _Epilogue(gamma=col_scale, weight=weight, dgamma=parts))
        if need_col_scale:
            dgamma = (parts if bias is None else parts + bias.float() * colsum).to(dtype)
    return dx, dweight, dbias, dgamma


def _output_grad(dy, pre, row_scale, scale: float, activation: str, rope: Rope, rope_half: bool) -> torch.Tensor:
    """dz from dy (_grad_kernel), or dy itself where there is nothing to apply."""
    if activation == "none" and rope.cos is None and row_scale is None and scale == 1.0:
        return dy
    M, N = dy.shape
    dz = torch.empty((M, 2 * N if activation == "swiglu" else N), device=dy.device, dtype=dy.dtype)
    block_m, block_n = GRAD_TILE
    if rope.cos is not None:   # whole heads in a tile for pairs a half apart
        block_n = max(block_n, rope.cos.shape[-1])
    grid = (cdiv(M, block_m), cdiv(N, block_n))
    _grad_kernel[grid](
        dy, pre, row_scale, dz, M, N, dy.stride(0), 0 if pre is None else pre.stride(0), dz.stride(0), scale, *rope,
        ACT=activation, HAS_ROW_SCALE=row_scale is not None, HAS_SCALE=scale != 1.0, ROPE=rope.cos is not None,
        ROPE_HALF=rope_half, HEAD_DIM=0 if rope.cos is None else rope.cos.shape[-1],
        **pdl(dy.device, grid[0] * grid[1]), BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
    )
    return dz


# The tuner's disk cache is keyed by the kernels' source, as the forward's; the backward's picks are their own.
_BACKWARD_TUNER = Tuner("linear_backward", _TUNER_SOURCE)


def _tuned_backward(dz, b, out, flags: dict, epilogue: _Epilogue) -> None:
    """Launches the dX product dz @ b (flags["DW"] False) or the dW product dz^T @ b (True) through the TMA kernel
    where dz, b and out are tma_ready, else the plain one, with the fastest of its candidate configs for this shape
    (dz's rows in size_bucket) and these flags."""
    M, N = dz.shape
    tma = tma_ready(dz, b, out)
    key = (size_bucket(M), N, None if b is None else b.shape[1], str(dz.dtype), *flags.values(), tma)
    candidates = _backward_candidates(tma, dz.dtype)
    if flags["X_ACT"] == "swiglu":   # d x_pre's tile is twice the product's width: keep its size
        candidates = list(dict.fromkeys(c._replace(block_n=c.block_n // 2) for c in candidates))

    def launch(config: Config) -> None:
        launch_linear_backward(config, dz, b, out, flags, epilogue, tma)

    launch(_BACKWARD_TUNER.pick(key, candidates, launch, dz.device))


def launch_linear_backward(config: Config, dz, b, out, flags: dict, epilogue: _Epilogue, tma: bool) -> None:
    """One backward product with this config (_tuned_backward's arguments): the dW product cut into
    dweight_splits slices of rows, its fp32 partial sums (and d gamma's, one a column of tiles) then summed by
    _sum_kernel into out and dgamma."""
    M, N = dz.shape
    dw = flags["DW"]
    P, Q, R = (N, 1 if b is None else b.shape[1], M) if dw else (M, b.shape[1], N)
    bm, bn, bk, warps, stages, persistent = config
    tiles = cdiv(P, bm) * cdiv(Q, bn)
    splits = dweight_splits(P, Q, R, config, dz.device) if dw else 1

    def partial(*shape: int) -> torch.Tensor:
        return torch.empty(shape, device=dz.device, dtype=torch.float32)

    kernel_out = out
    if splits > 1:
        kernel_out = None if out is None else partial(splits * P, Q)
    dgamma = partial(splits * cdiv(Q, bn), P) if flags["DGAMMA"] else None
    args = epilogue._replace(dgamma=dgamma).launch_args()
    launch_pdl = pdl(dz.device, tiles * splits)
    tile = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    stride_out = 0 if kernel_out is None else kernel_out.stride(0)
    if not tma:
        stride_ap, stride_ar = (1, dz.stride(0)) if dw else (dz.stride(0), 1)
        _linear_backward_plain_kernel[(tiles, splits)](
            dz, b, kernel_out, P, Q, R, stride_ap, stride_ar, 0 if b is None else b.stride(0), stride_out, *args,
            **flags, **launch_pdl, SPLIT=splits, **tile,
        )
    else:
        a_desc = TensorDescriptor.from_tensor(dz, [bk, bm] if dw else [bm, bk])
        b_desc = None if b is None else TensorDescriptor.from_tensor(b, [bk, bn])
        out_tma = splits == 1 and out is not None   # split partial sums go through pointers, as the forward's
        if out_tma:   # swiglu's d x_pre: two columns for each of the product's
            kernel_out = TensorDescriptor.from_tensor(out, [bm, 2 * bn if flags["X_ACT"] == "swiglu" else bn])
        items = tiles * splits
        grid = (min(items, sm_count(dz.device) * persistent) if persistent else items,)
        _linear_backward_tma_kernel[grid](
            a_desc, b_desc, kernel_out, P, Q, R, stride_out, *args, **flags, OUT_TMA=out_tma, **launch_pdl,
            SPLIT=splits, **tile,
        )
    if splits > 1 and out is not None:
        _sum_slices(kernel_out, out)
    if dgamma is not None:
        _sum_slices(dgamma, epilogue.dgamma)


def _sum_slices(parts: torch.Tensor, out: torch.Tensor) -> None:
    """out = the sum of parts' slices along its first dimension (_sum_kernel): parts contiguous fp32, out
    contiguous."""
    numel = out.numel()
    programs = cdiv(numel, SUM_BLOCK)
    _sum_kernel[(programs,)](parts, out, parts.numel() // numel, numel, **pdl(out.device, programs),
                             BLOCK=SUM_BLOCK, num_warps=4)
