"""Linear layer with a fused epilogue: y = scale * (act(x @ W^T + b) [+ residual]).

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

Cost: 2*M*N*K FLOPs; at least (M*K + N*K + M*N [+ M*N residual]) elements moved (+ N bias); with swiglu, N is W's
rows, 2 * y's width, and y moves M*N/2 elements; rope reads a cos and a sin a rotated pair (fp32, 2/3 * M*N/2 pairs,
from tables of T*Dh values each, a head each for RoPE-mixed: cached in L2) and adds 3 FLOPs an element; split K
writes S*M*N fp32 partial sums instead of M*N outputs; a product launched in two parts of rows reads W twice (+ N*K).

The file, in reading order:

- _tile_coords, _rotate and _epilogue, shared by both kernels: the grouped order of output tiles, the rotary
  embedding of a QKV tile, and what a finished fp32 tile goes through before its one store (bias, then the
  rotation or the activation of activation.py, then the residual add, then the scale, so no elementwise kernel
  follows the GEMM). swiglu's activation halves the tile's width.
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

float32 on tf32 tensor cores: operands are rounded to nearest tf32 as cuBLAS does, but not in the K loop where
avoidable (tf32.py): W is read as a rounded copy kept with the weight (W_TF32), an x that its producer stored
rounded is taken as it is (X_TF32), and y is stored rounded for a consumer that reads it as a matmul operand
(Y_TF32).
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .activation import ACTIVATIONS, apply_activation, gelu_fit_degree
from .common import (
    INTERPRET, cast, check_device, check_dtype, check_float, check_shape, input_precision, mma, sm_count, pdl,
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
def _rotate(x, m0, n0, M, cos_ptr, sin_ptr, s_head, tokens, prefix, heads, row0, HEAD_DIM: tl.constexpr,
            ROPE_HALF: tl.constexpr):
    """The QKV tile x [BM, BN] at (m0, n0) (columns [3, H, HEAD_DIM]) with its q and k channels of the rotated
    tokens turned by their angles: a' = a cos - b sin, b' = b cos + a sin for each pair (a, b) of channels, (2i,
    2i + 1), or (i, i + HEAD_DIM / 2) if ROPE_HALF (the tile's width then a multiple of HEAD_DIM). Row r is token
    (row0 + r) % tokens, rotated from token `prefix` on with table row token - prefix of its head's tables (head
    stride s_head, 0: shared); the tables' entry of a pair is that of its first channel."""
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
    a, b = tl.where(mask, a * cos - b * sin, a), tl.where(mask, b * cos + a * sin, b)
    if ROPE_HALF:
        pairs = tl.join(tl.reshape(a, [BM, PAIRS // HALF, HALF]), tl.reshape(b, [BM, PAIRS // HALF, HALF]))
        return tl.reshape(tl.permute(pairs, (0, 1, 3, 2)), [BM, 2 * PAIRS])
    return tl.reshape(tl.join(a, b), [BM, 2 * PAIRS])


@triton.jit
def _epilogue(acc, m0, n0, split, M, N, b_ptr, r, y, stride_rm, stride_ym, scale,
              cos_ptr, sin_ptr, s_rope_h, rope_tokens, rope_prefix, rope_heads, rope_row0,
              HAS_BIAS: tl.constexpr, ACT: tl.constexpr, GELU_FIT_DEGREE: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
              HAS_SCALE: tl.constexpr, Y_TF32: tl.constexpr, R_TMA: tl.constexpr, Y_TMA: tl.constexpr,
              ROPE: tl.constexpr, ROPE_HALF: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Bias, activation or rotation (ROPE: _rotate, on the product rounded to y's dtype as a library's QKV layer
    gives it), residual, scale (and tf32 rounding, Y_TF32) on the fp32 tile acc of the product at (m0, n0) (N: W's
    rows), then its one store. The residual and y go through TMA descriptors where R_TMA, Y_TMA (clipped to y's
    shape), else through pointers; slice `split` of split K's partial sums is rows split*M... of y viewed as
    [SPLIT_K*M, N]. "swiglu" halves the tile: its y tile is at (m0, n0 / 2), of y [M, N / 2]."""
    offs_n = n0 + tl.arange(0, acc.shape[1])
    if HAS_BIAS:  # once: slice 0 adds it. tl.where, not `mask_n & (split == 0)`: Triton 3.9's interpreter
        # broadcasts a scalar comparison as int32, which a mask refuses (and 3.6's cannot branch on one).
        first = tl.where(split == 0, offs_n < N, False)
        acc += tl.load(b_ptr + offs_n, mask=first, other=0.0).to(tl.float32)[None, :]
    if ROPE:
        y_dtype: tl.constexpr = y.dtype if Y_TMA else y.dtype.element_ty
        acc = _rotate(cast(acc, y_dtype).to(tl.float32), m0, n0, M, cos_ptr, sin_ptr, s_rope_h, rope_tokens,
                      rope_prefix, rope_heads, rope_row0, HEAD_DIM, ROPE_HALF)
    acc = apply_activation(acc, ACT, GELU_FIT_DEGREE)
    if ACT == "swiglu":   # a gate and a value column of the product make one column of y
        n0 = n0 // 2
        N = N // 2
        offs_n = n0 + tl.arange(0, acc.shape[1])
    offs_m = m0 + tl.arange(0, acc.shape[0])
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    rows = offs_m[:, None].to(tl.int64)
    if HAS_RESIDUAL:
        if R_TMA:
            acc += r.load([m0, n0]).to(tl.float32)
        else:
            acc += tl.load(r + rows * stride_rm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        acc *= scale
    if Y_TF32:
        acc = to_tf32(acc)
    if Y_TMA:
        y.store([m0, n0], cast(acc, y.dtype))
    else:
        tl.store(y + (rows + split * M) * stride_ym + offs_n[None, :], cast(acc, y.dtype.element_ty), mask=mask)


@triton.jit
def _linear_plain_kernel(
    x_ptr, w_ptr, b_ptr, r_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_rm, stride_ym, scale,
    cos_ptr, sin_ptr, s_rope_h, rope_tokens, rope_prefix, rope_heads, rope_row0,   # _rotate's, with ROPE
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, GELU_FIT_DEGREE: tl.constexpr,   # apply_activation's
    HAS_RESIDUAL: tl.constexpr, HAS_SCALE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, X_TF32: tl.constexpr, W_TF32: tl.constexpr,   # x, W hold tf32 values already
    Y_TF32: tl.constexpr,   # y is stored rounded to tf32
    ROPE: tl.constexpr, ROPE_HALF: tl.constexpr, HEAD_DIM: tl.constexpr,   # y is a QKV projection to rotate
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
              HAS_BIAS, ACT, GELU_FIT_DEGREE, HAS_RESIDUAL, HAS_SCALE, Y_TF32, False, False, ROPE, ROPE_HALF, HEAD_DIM)


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
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, GELU_FIT_DEGREE: tl.constexpr,   # apply_activation's
    HAS_RESIDUAL: tl.constexpr, HAS_SCALE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, X_TF32: tl.constexpr, W_TF32: tl.constexpr,   # x, W hold tf32 values already
    Y_TF32: tl.constexpr,   # y is stored rounded to tf32
    ROPE: tl.constexpr, ROPE_HALF: tl.constexpr, HEAD_DIM: tl.constexpr,   # y is a QKV projection to rotate
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
        tile = item % num_tiles
        if SPLIT_K > 1:
            split = item // num_tiles
        else:
            split = 0
        pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
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
                  HAS_BIAS, ACT, GELU_FIT_DEGREE, HAS_RESIDUAL, HAS_SCALE, Y_TF32, True, Y_TMA, ROPE, ROPE_HALF,
                  HEAD_DIM)


# 128 x 256 tiles in 4 stages of 32-deep steps: the residual GEMMs' pick before their y went through
# pointers, still some shapes' pick since.
WIDE_RESIDUAL = Config(128, 256, 32, 8, 4)
# The TMA kernel's candidates by dtype and row count, from sweeps on an H100 and an H200 at ViT-S/B/L shapes
# (scripts/sweep_kernels.py). Each list is short: every candidate of a new shape is compiled and timed once.
LARGE_M = [
    Config(128, 256, 64, 8, 3), Config(128, 128, 64, 8, 5), Config(128, 128, 64, 4, 4),
    Config(128, 128, 128, 8, 3), Config(256, 128, 64, 8, 3), Config(128, 128, 64, 8, 4), WIDE_RESIDUAL,
]
SMALL_M = [   # a few thousand rows (ViT-B/16, 8 images): 128-row tiles, about one wave
    Config(128, 256, 64, 8, 3), Config(128, 128, 64, 8, 4), Config(128, 128, 64, 4, 4),
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
    tiles = triton.cdiv(M, SPLIT_TILE) * triton.cdiv(N, SPLIT_TILE)
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
    num_n = triton.cdiv(N, config.block_n)
    waves, last = divmod(triton.cdiv(M, config.block_m) * num_n, slots)
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
) -> torch.Tensor:
    """y = scale * (activation(x @ weight.T + bias) + residual) for 2-D x [M, K] and weight [N, K].

    activation: "none", "gelu" (exact erf), "gelu_tanh" or "quick_gelu" (x * sigmoid(1.702 x)); a bf16 or fp16 y
    gets them from one tanh an element, to within its rounding (activation.py). "swiglu": weight [2N, K] and bias
    [2N] hold a gate's and a value's rows interleaved (row 2j the gate's row j, 2j + 1 the value's), and
    y [M, N] = scale * (silu(x @ Wg.T + bg) * (x @ Wv.T + bv) + residual), Wg = weight[0::2], Wv = weight[1::2].
    allow_tf32: for float32 inputs; None follows torch.get_float32_matmul_precision().
    tf32_input, tf32_output: see tf32.py; they act only where the matmuls run on tf32.
    out must not alias x or residual.

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
    weight, bias = _checked(x, weight, bias, residual, out, *(rope or ()))
    M, N = x.shape[0], weight.shape[0]
    if activation == "swiglu":
        if N % 2:
            raise ValueError(f"swiglu's weight must have shape [2N, {x.shape[1]}], the gate's and the value's rows "
                             f"interleaved, got {tuple(weight.shape)}")
        N //= 2
    for name, t in (("residual", residual), ("out", out)):
        if t is not None:
            check_shape(name, t, (M, N))
            check_dtype(name, t, x.dtype)
            if t.stride(1) != 1:
                raise ValueError(f"{name} must have unit stride along N, got strides {t.stride()}")
    if out is None:
        out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    rotation = NO_ROPE if rope is None else check_rope(rope, M, N, rope_half, rope_prefix, activation, residual,
                                                         scale)
    weight, precision = _precision(x, weight, allow_tf32, tf32_input)
    flags = dict(HAS_BIAS=bias is not None, ACT=activation, GELU_FIT_DEGREE=gelu_fit_degree(x.dtype, activation),
                 HAS_RESIDUAL=residual is not None,
                 HAS_SCALE=scale != 1.0, **precision, Y_TF32=precision["INPUT_PRECISION"] == "tf32" and tf32_output,
                 ROPE=rope is not None, ROPE_HALF=rope is not None and rope_half,
                 HEAD_DIM=0 if rope is None else rope[0].shape[-1], SPLIT_K=1)
    _tuned_launch(x, weight, bias, residual, out, scale, flags, rotation)
    return out


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
                 **precision, Y_TF32=False, ROPE=False, ROPE_HALF=False, HEAD_DIM=0, SPLIT_K=splits)
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
_TUNER = Tuner("linear", "".join(Path(__file__).with_name(name).read_text() for name in ("linear.py", "activation.py")))


def _tuned_launch(x, weight, bias, residual, out, scale: float, flags: dict, rope: Rope = NO_ROPE,
                  split_waves: bool = True) -> None:
    """Launches the TMA kernel where every matrix is tma_ready, else the plain one, with the fastest of its
    candidate configs for this shape (its rows in size_bucket) and these flags. A config whose last wave would
    leave most SMs idle runs (and is timed) as the rows of its whole waves, then the rest with a config tuned for
    them alone (whole_wave_rows; split_waves=False for that rest)."""
    M, K = x.shape
    N = weight.shape[0]
    tma = tma_ready(x, weight, residual, out)   # and so is every range of their rows

    def rows_of(part: slice) -> tuple:
        """The arguments of a launch over these rows of x, residual and out, but the rotation's."""
        return x[part], weight, bias, None if residual is None else residual[part], out[part], scale, flags

    def launch(config: Config) -> None:
        rows = whole_wave_rows(M, N, config, x.device) if split_waves and flags["SPLIT_K"] == 1 else M
        if rows == M:
            return launch_linear(config, x, weight, bias, residual, out, scale, flags, tma, rope)
        launch_linear(config, *rows_of(slice(0, rows)), tma, rope)
        _tuned_launch(*rows_of(slice(rows, None)), rope._replace(row0=rope.row0 + rows), split_waves=False)

    # Nearby row counts share a pick (size_bucket); N and K are the weight's. The launches take the exact M.
    key = (size_bucket(M), N, K, str(x.dtype), *flags.values(), tma, split_waves)
    candidates = (_tma_candidates if tma else _plain_candidates)(M, x.dtype)
    if flags["ROPE_HALF"]:   # a tile holds whole heads, so that each channel's partner is in it
        candidates = list(dict.fromkeys(c._replace(block_n=max(c.block_n, flags["HEAD_DIM"])) for c in candidates))
    launch(_TUNER.pick(key, candidates, launch, x.device))


def launch_linear(config: Config, x, weight, bias, residual, out, scale: float, flags: dict, tma: bool,
                  rope: Rope = NO_ROPE) -> None:
    """One launch with this config (checked inputs, flags as linear or linear_partials make them, rope as check_rope
    makes it): of the TMA kernel where tma (every matrix tma_ready), persistent as config.persistent says, else of
    the plain kernel, one program per tile and slice whatever config.persistent says."""
    M, K = x.shape
    N = weight.shape[0]
    bm, bn, bk, warps, stages, persistent = config
    tiles, splits = triton.cdiv(M, bm) * triton.cdiv(N, bn), flags["SPLIT_K"]
    launch_pdl = pdl(x.device, tiles * splits)
    tile = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    if not tma:
        _linear_plain_kernel[(tiles, splits)](
            x, weight, bias, residual, out, M, N, K,
            x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), scale,
            *rope, **flags, **launch_pdl, **tile,
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
        **flags, **launch_pdl, PREFETCH=launch_pdl["PDL"] != PDL_OFF, **tile,
    )
