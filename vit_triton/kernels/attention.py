"""Fused multi-head attention: o = softmax(q k^T * scale) v, per batch and head, unmasked.

Layouts: q [B, Tq, H, Dh], k and v [B, Tk, H, Dh], any batch/token/head strides (0 too: one learned
query expanded over the batch) and unit stride along Dh, so they are read straight out of the QKV
GEMM's [B*T, 3*H*Dh] output (qkv.view(B, T, 3, H, Dh)[:, :, i]). o [B, Tq, H, Dh] contiguous, which is
the [B*Tq, H*Dh] row-major input of the out-projection. In a transformer block Tq = Tk = T; an
attention-pool head attends from a few learned queries (Tq = 1) to all tokens.

One launch covers all batches and heads. Each program owns one query block of one head; a head's
blocks are neighbours in launch order, so they run together and read that head's K and V from HBM
once, from L2 after, and the last heads launch first (the QKV GEMM wrote them last: still in L2).
A program streams K and V in BLOCK_N tiles and keeps a running max and sum (online softmax, base 2
with the scale folded into log2(e)), so the Tq x Tk scores never leave on-chip memory. Only the last keys are
masked, in blocks of 16, so a sequence of 197 costs 208 keys of work, not 256. A head dim that is not a
power of two is taken in two pieces that are, each piece its own products (72 and 80: 64 + 16 columns, 96: 64 + 32;
head_pieces), so that 72 costs 80 columns of work, not 128; one pass and the backward pad it to one power of two
in registers by masked loads.

One pass (up to 256 keys, launches of at most two waves): a program takes all of its head's keys
at once, in up to three power-of-two pieces (197: 128 + 64 + 16), and holds every score of its query
block, so the softmax is one max, one exponential and one sum a score with no rescaling in between.
Its loads are not pipelined and it needs about twice the registers, 1.5-1.8x slower than streaming
where the launch is many waves deep; where the GPU is latency-bound (ViT-B/16, 1-5 images) its one
dependent chain (scores, max, exponentials, P V) instead of one a key block wins in the forward.

Cost: 4*B*H*Tq*Tk*Dh FLOPs (two GEMMs) + B*H*Tq*Tk exponentials, 4*B*H*Tq*Tk*D as computed (D: the head
dim's columns of work, head_pieces' sum where keys are streamed, 80 for 72, else block_d, 128 for 72); at least
2*B*(Tq + Tk)*H*Dh elements moved (q, k, v read, o written; a query expanded over the batch is read once).

Training. With lse= the forward also stores each query row's log-sum-exp, lse [B, H, Tq] float32, in base 2 (the
natural one times log2(e), the units of both passes' exponentials, so neither rounds a conversion), and
attention_backward gives dq, dk, dv from q, k, v, o, lse and dO = dL/do [B, Tq, H, Dh] (any strides, unit
stride along Dh) the FlashAttention-2 way, P recomputed from the scores and lse, never stored:
    delta = rowsum(dO * O) (a small first kernel), P = exp2(log2(e) scale q k^T - lse), dV = P^T dO, dP = dO V^T,
    dS = P * (dP - delta), dK = scale dS^T Q, dQ = scale dS K.
One launch holds two kinds of programs a head: a dK/dV program owns BLOCK_M keys and streams every query past
them, a dQ program owns BLOCK_M queries and streams every key; each accumulates its rows in fp32 registers and
stores them once, so no program adds into another's output (no atomics: the same bits on every run). The price is
that both recompute P and dP: 7 tile products where the math needs 5. P and dS are rounded to the inputs' dtype
before their products, as FA2 does. Ragged ends as in the forward: the last T % BLOCK_M rows are owned by programs
of TAIL_N rows, and a stream's last keys or queries come in masked blocks of TAIL_N (197 tokens: 208 rows of
work, not 256). dq of a query expanded over the batch is each image's dq in fp32, summed over the batch afterwards.

Backward cost: 10*B*H*Tq*Tk*Dh FLOPs in the math (5 products, 2.5x the forward's), 14*B*H*Tq*Tk*Dh as computed
here, + 2*B*H*Tq*Tk exponentials; at least 4*B*(Tq + Tk)*H*Dh elements moved (q, o, dO, k, v read, dq, dk, dv
written) and 3*B*H*Tq floats (lse read, delta written and read). A bias adds H*Tq*Tk elements read by each pass
(from L2 after the first image), and its gradient 2*B*H*Tq*Tk floats (each image's dS written, then summed).
"""

from __future__ import annotations

from pathlib import Path

import torch
import triton
import triton.language as tl

from .common import (
    INTERPRET, LOG2E, cast, cdiv, check_device, check_dtype, check_float, check_shape, exp2, input_precision, mma,
    next_power_of_2, sm_count, pdl, start_next_kernel, to_tf32, tune, wait_for_previous_kernel,
)
from .tuning import Config, Tuner, size_bucket

TAIL_N = tl.constexpr(16)  # the smallest key block a 16-bit tensor-core product takes (k = 16)
ONE_PASS_MAX_T = 256       # one pass holds BLOCK_M x 256 fp32 scores at most
ONE_PASS_WAVES = 2         # ... in launches of at most this many programs an SM
# The one-pass launch: 64 query rows (one warpgroup's wgmma), 4 warps; 32 rows under the interpreter.
ONE_PASS_BLOCK_M, ONE_PASS_WARPS = (32, 4) if INTERPRET else (64, 4)
ONE_PASS = Config(ONE_PASS_BLOCK_M, TAIL_N.value, 0, ONE_PASS_WARPS, 1)
# The streaming kernel's candidates: query rows, keys a step, (no K tile: the head dim is one), warps, stages.
CANDIDATES = tune([Config(128, 64, 0, 8, 3), Config(128, 128, 0, 8, 2), Config(64, 64, 0, 4, 3),
                   Config(128, 32, 0, 4, 3), Config(128, 32, 0, 4, 4), Config(64, 128, 0, 4, 2)],
                  Config(32, 32, 0, 4, 1))
SMALLEST_BLOCK_M = min(c.block_m for c in CANDIDATES)   # the launch with the most programs
# The backward's candidates: rows a program owns (keys for dK/dV, queries for dQ), rows of the other side a
# step, (no K tile), warps, stages.
BACKWARD_CANDIDATES = tune([Config(64, 64, 0, 4, 2), Config(128, 64, 0, 8, 2), Config(128, 32, 0, 8, 2),
                            Config(64, 32, 0, 4, 3), Config(32, 64, 0, 4, 2)],
                           Config(32, 32, 0, 4, 1))
DELTA_BLOCK_M = 64   # query rows a program of the backward's rowsum(dO * O)
# The tuners' disk caches are keyed by this source: a change to the kernels or the candidates starts afresh.
_TUNER = Tuner("attention", Path(__file__).read_text())
_BACKWARD_TUNER = Tuner("attention_backward", Path(__file__).read_text())


@triton.jit
def _bias(s, bias_base, rows, cols, T_Q, T_K, bias_mult, HAS_BIAS: tl.constexpr):
    """s plus, where HAS_BIAS, bias [T_Q, T_K] (row-major at bias_base) at query `rows` and key `cols` (index tiles
    broadcast to s's shape) times bias_mult; zero past T_Q or T_K."""
    if HAS_BIAS:
        bias = tl.load(bias_base + rows * T_K + cols, mask=(rows < T_Q) & (cols < T_K), other=0.0)
        s += bias.to(tl.float32) * bias_mult
    return s


@triton.jit
def _head(ptr, b, h, s_b, s_h, ALIGN: tl.constexpr):
    """ptr's slice of image b and head h. ALIGN, a power of two, divides both strides: Triton cannot see it in a
    head stride that is no multiple of 16 (head dim 72), and without it a row's loads go element by element
    instead of in 16-byte vectors, with no copies ahead (twice the time at 729 tokens)."""
    return ptr + tl.multiple_of(b * s_b + h * s_h, ALIGN)


@triton.jit
def _scores(q, q_e, k_base, start, T, sk_t, offs_d, mask_d, offs_e, mask_e, bias_base, offs_m, T_Q, bias_mult,
            INPUT_PRECISION: tl.constexpr, QKV_TF32: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
            BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """q k^T (+ the bias over the scale, where HAS_BIAS) for keys start .. start + BLOCK, -inf past T if MASKED;
    where SPLIT, over the head dim's two pieces (q at offs_d, q_e at offs_e), two products into one sum."""
    offs_n = start + tl.arange(0, BLOCK)
    k_mask = (offs_n < T)[None, :] & mask_d[:, None] if MASKED else mask_d[:, None]
    k = tl.load(k_base + offs_n[None, :] * sk_t + offs_d[:, None], mask=k_mask, other=0.0)
    s = mma(q, k, tl.zeros((q.shape[0], BLOCK), dtype=tl.float32), INPUT_PRECISION, QKV_TF32, QKV_TF32)
    if SPLIT:
        k_mask = (offs_n < T)[None, :] & mask_e[:, None] if MASKED else mask_e[:, None]
        k = tl.load(k_base + offs_n[None, :] * sk_t + offs_e[:, None], mask=k_mask, other=0.0)
        s = mma(q_e, k, s, INPUT_PRECISION, QKV_TF32, QKV_TF32)
    s = _bias(s, bias_base, offs_m[:, None], offs_n[None, :], T_Q, T, bias_mult, HAS_BIAS)
    if MASKED:
        s = tl.where((offs_n < T)[None, :], s, float("-inf"))
    return s


@triton.jit
def _add_pv(acc, acc_e, p, v_base, start, T, sv_t, offs_d, mask_d, offs_e, mask_e, INPUT_PRECISION: tl.constexpr,
            QKV_TF32: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """(acc, acc_e) + p v for keys start .. start + BLOCK (V read as zeros past T if MASKED): acc over the head
    dim's columns offs_d, acc_e over offs_e where SPLIT (else returned as it is)."""
    offs_n = start + tl.arange(0, BLOCK)
    v_mask = (offs_n < T)[:, None] & mask_d[None, :] if MASKED else mask_d[None, :]
    v = tl.load(v_base + offs_n[:, None] * sv_t + offs_d[None, :], mask=v_mask, other=0.0)
    p = cast(p, v.dtype)
    acc = mma(p, v, acc, INPUT_PRECISION, False, QKV_TF32)
    if SPLIT:
        v_mask = (offs_n < T)[:, None] & mask_e[None, :] if MASKED else mask_e[None, :]
        v = tl.load(v_base + offs_n[:, None] * sv_t + offs_e[None, :], mask=v_mask, other=0.0)
        acc_e = mma(p, v, acc_e, INPUT_PRECISION, False, QKV_TF32)
    return acc, acc_e


@triton.jit
def _attend(acc, acc_e, m_i, l_i, q, q_e, k_base, v_base, start, T, sk_t, sv_t, qk_scale, offs_d, mask_d, offs_e,
            mask_e, bias_base, offs_m, T_Q, bias_mult, INPUT_PRECISION: tl.constexpr, QKV_TF32: tl.constexpr,
            HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """One step of the online softmax over keys start .. start + BLOCK (masked past T if MASKED)."""
    s = _scores(q, q_e, k_base, start, T, sk_t, offs_d, mask_d, offs_e, mask_e, bias_base, offs_m, T_Q, bias_mult,
                INPUT_PRECISION, QKV_TF32, HAS_BIAS, SPLIT, BLOCK, MASKED)
    # The scale (> 0) is applied to the row max, and to each score inside the exponent's FMA.
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    p = exp2(s * qk_scale - m_new[:, None])
    alpha = exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if SPLIT:
        acc_e = acc_e * alpha[:, None]
    acc, acc_e = _add_pv(acc * alpha[:, None], acc_e, p, v_base, start, T, sv_t, offs_d, mask_d, offs_e, mask_e,
                         INPUT_PRECISION, QKV_TF32, SPLIT, BLOCK, MASKED)
    return acc, acc_e, m_new, l_i


@triton.jit
def _attend_once(q, q_e, k_base, v_base, T, sk_t, sv_t, qk_scale, offs_d, mask_d, offs_e, mask_e, acc, acc_e,
                 bias_base, offs_m, T_Q, bias_mult, INPUT_PRECISION: tl.constexpr, QKV_TF32: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                 KEYS0: tl.constexpr, KEYS1: tl.constexpr, KEYS2: tl.constexpr):
    """The one-pass softmax over all T keys, in pieces KEYS0 >= KEYS1 >= KEYS2 (0: absent; the last present one
    is masked past T). Returns the unnormalised P V (its two pieces), the row max (scaled, base 2) and the row sums
    of P."""
    s0 = _scores(q, q_e, k_base, 0, T, sk_t, offs_d, mask_d, offs_e, mask_e, bias_base, offs_m, T_Q, bias_mult,
                 INPUT_PRECISION, QKV_TF32, HAS_BIAS, SPLIT, KEYS0, KEYS1 == 0)
    m = tl.max(s0, axis=1)
    if KEYS1 > 0:
        s1 = _scores(q, q_e, k_base, KEYS0, T, sk_t, offs_d, mask_d, offs_e, mask_e, bias_base, offs_m, T_Q,
                     bias_mult, INPUT_PRECISION, QKV_TF32, HAS_BIAS, SPLIT, KEYS1, KEYS2 == 0)
        m = tl.maximum(m, tl.max(s1, axis=1))
    if KEYS2 > 0:
        s2 = _scores(q, q_e, k_base, KEYS0 + KEYS1, T, sk_t, offs_d, mask_d, offs_e, mask_e, bias_base, offs_m, T_Q,
                     bias_mult, INPUT_PRECISION, QKV_TF32, HAS_BIAS, SPLIT, KEYS2, True)
        m = tl.maximum(m, tl.max(s2, axis=1))
    m = m * qk_scale   # the scale (> 0) is applied to the row max, and to each score inside the exponent's FMA
    p = exp2(s0 * qk_scale - m[:, None])
    l_i = tl.sum(p, axis=1)
    acc, acc_e = _add_pv(acc, acc_e, p, v_base, 0, T, sv_t, offs_d, mask_d, offs_e, mask_e, INPUT_PRECISION,
                         QKV_TF32, SPLIT, KEYS0, KEYS1 == 0)
    if KEYS1 > 0:
        p = exp2(s1 * qk_scale - m[:, None])
        l_i += tl.sum(p, axis=1)
        acc, acc_e = _add_pv(acc, acc_e, p, v_base, KEYS0, T, sv_t, offs_d, mask_d, offs_e, mask_e, INPUT_PRECISION,
                             QKV_TF32, SPLIT, KEYS1, KEYS2 == 0)
    if KEYS2 > 0:
        p = exp2(s2 * qk_scale - m[:, None])
        l_i += tl.sum(p, axis=1)
        acc, acc_e = _add_pv(acc, acc_e, p, v_base, KEYS0 + KEYS1, T, sv_t, offs_d, mask_d, offs_e, mask_e,
                             INPUT_PRECISION, QKV_TF32, SPLIT, KEYS2, True)
    return acc, acc_e, m, l_i


@triton.jit
def _store_o(ptrs, o, mask, O_TF32: tl.constexpr):
    if O_TF32:
        o = to_tf32(o)
    tl.store(ptrs, cast(o, ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, bias_ptr,
    T_K, H, T_Q, qk_scale, bias_mult,   # keys, queries; the bias is added to the scores over the scale
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, so_b, so_t, so_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ALIGN: tl.constexpr,   # ALIGN: _head's
    SPLIT: tl.constexpr, BLOCK_E: tl.constexpr,   # the head dim's columns past BLOCK_D, a second piece (head_pieces)
    INPUT_PRECISION: tl.constexpr, PDL: tl.constexpr,
    QKV_TF32: tl.constexpr, O_TF32: tl.constexpr,   # q, k, v hold tf32 values already; o stored rounded to tf32
    STORE_LSE: tl.constexpr,   # also store each query row's log-sum-exp (training: the backward's softmax)
    HAS_BIAS: tl.constexpr,   # add each head's bias [T_Q, T_K] to its scores
    KEYS0: tl.constexpr, KEYS1: tl.constexpr, KEYS2: tl.constexpr,   # one pass over pieces of keys if KEYS0 > 0
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    # Program i owns query block p % q_blocks of head p // q_blocks, p = programs - 1 - i: a head's query
    # blocks run side by side, so its K and V come from HBM once and from L2 for the other blocks; and the
    # last heads go first, as the QKV GEMM wrote them last and at large batch they are the ones still in L2.
    q_blocks = tl.cdiv(T_Q, BLOCK_M)
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    bh = pid // q_blocks
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = (pid % q_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    offs_e = BLOCK_D + tl.arange(0, BLOCK_E)   # not SPLIT: 16 columns past the head dim, never read
    mask_e = offs_e < HEAD_DIM

    q_base = _head(q_ptr, b, h, sq_b, sq_h, ALIGN) + offs_m[:, None] * sq_t
    q = tl.load(q_base + offs_d[None, :], mask=(offs_m < T_Q)[:, None] & mask_d[None, :], other=0.0)
    q_e = q
    if SPLIT:
        q_e = tl.load(q_base + offs_e[None, :], mask=(offs_m < T_Q)[:, None] & mask_e[None, :], other=0.0)
    k_base = _head(k_ptr, b, h, sk_b, sk_h, ALIGN)
    v_base = _head(v_ptr, b, h, sv_b, sv_h, ALIGN)
    bias_base = bias_ptr + h * T_Q * T_K if HAS_BIAS else bias_ptr

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    acc_e = tl.zeros((BLOCK_M, BLOCK_E), dtype=tl.float32)
    if KEYS0 > 0:
        acc, acc_e, m_i, l_i = _attend_once(q, q_e, k_base, v_base, T_K, sk_t, sv_t, qk_scale, offs_d, mask_d, offs_e,
                                            mask_e, acc, acc_e, bias_base, offs_m, T_Q, bias_mult, INPUT_PRECISION,
                                            QKV_TF32, HAS_BIAS, SPLIT, KEYS0, KEYS1, KEYS2)
    else:
        # Whole key blocks without masks, then the last T_K % BLOCK_N keys in blocks of TAIL_N: at 197
        # tokens, 3 x 64 + 16 keys are multiplied instead of 4 x 64.
        whole = T_K - T_K % BLOCK_N
        for start in range(0, whole, BLOCK_N):
            acc, acc_e, m_i, l_i = _attend(acc, acc_e, m_i, l_i, q, q_e, k_base, v_base, start, T_K, sk_t, sv_t,
                                           qk_scale, offs_d, mask_d, offs_e, mask_e, bias_base, offs_m, T_Q,
                                           bias_mult, INPUT_PRECISION, QKV_TF32, HAS_BIAS, SPLIT, BLOCK_N, False)
        for start in range(whole, T_K, TAIL_N):
            acc, acc_e, m_i, l_i = _attend(acc, acc_e, m_i, l_i, q, q_e, k_base, v_base, start, T_K, sk_t, sv_t,
                                           qk_scale, offs_d, mask_d, offs_e, mask_e, bias_base, offs_m, T_Q,
                                           bias_mult, INPUT_PRECISION, QKV_TF32, HAS_BIAS, SPLIT, TAIL_N, True)

    start_next_kernel(PDL)
    o_base = _head(o_ptr, b, h, so_b, so_h, ALIGN) + offs_m[:, None] * so_t
    _store_o(o_base + offs_d[None, :], acc / l_i[:, None], (offs_m < T_Q)[:, None] & mask_d[None, :], O_TF32)
    if SPLIT:
        _store_o(o_base + offs_e[None, :], acc_e / l_i[:, None], (offs_m < T_Q)[:, None] & mask_e[None, :], O_TF32)
    if STORE_LSE:
        # m_i is the row max of the scaled scores in base-2 units: log2(sum) = m_i + log2(l_i).
        tl.store(lse_ptr + (b * H + h) * T_Q + offs_m, m_i + tl.log2(l_i), mask=offs_m < T_Q)


def fused_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float | None = None,
    allow_tf32: bool | None = None,
    tf32_input: bool = False,
    tf32_output: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q @ k^T * scale + bias) @ v for q [B, Tq, H, Dh] and k, v [B, Tk, H, Dh]; returns [B, Tq, H, Dh]
    contiguous. q may be one query expanded over the batch (batch stride 0).

    scale (positive) defaults to Dh ** -0.5. Head dims from 16 to 256 are accepted. tf32_input (q, k and
    v), tf32_output: see tf32.py; they act only where the matmuls run on tf32. lse: a contiguous float32
    [B, H, Tq] that receives log2(sum_j exp(scale * q k_j + bias_j)) of each query row, what attention_backward
    takes. bias: each head's scores' bias [H, Tq, Tk] (the same for every image; BEiT's relative position bias),
    contiguous, float32 or q's dtype; it adds H*Tq*Tk reads (from L2 after the first image) to the forward.
    """
    check_device(q, k, v, out, lse, bias)
    B, Tq, Tk, H, Dh = check_inputs(q, k, v, out=out)
    if lse is not None:
        check_float32("lse", lse, (B, H, Tq))
    check_bias(bias, (H, Tq, Tk), q.dtype)
    if out is None:
        out = torch.empty((B, Tq, H, Dh), device=q.device, dtype=q.dtype)
    scale = check_scale(scale, Dh)
    precision = input_precision(q.dtype, allow_tf32)

    flags = dict(HEAD_DIM=Dh, ALIGN=alignment(q, k, v, out), INPUT_PRECISION=precision,
                 QKV_TF32=precision == "tf32" and tf32_input, O_TF32=precision == "tf32" and tf32_output,
                 STORE_LSE=lse is not None, HAS_BIAS=bias is not None,
                 **pdl(q.device, B * H * cdiv(Tq, SMALLEST_BLOCK_M)))

    def launch(config: Config, keys: tuple[int, int, int] = (0, 0, 0)) -> None:
        # The head dim in two pieces where keys are streamed; one pass pads it to a power of two (split there, it
        # gave wrong results on sm90 under Triton 3.6 that the interpreter does not show).
        first, second = head_pieces(Dh) if keys[0] == 0 else (block_d(Dh), 0)
        # One axis of programs, which allows 2^31 - 1 (axis 1 allows 65535).
        _attention_kernel[(B * H * cdiv(Tq, config.block_m),)](
            q, k, v, out, lse, bias,
            Tk, H, Tq, scale * LOG2E, 1 / scale,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            **flags, BLOCK_D=first, SPLIT=second > 0, BLOCK_E=second or 16,
            **dict(zip(("KEYS0", "KEYS1", "KEYS2"), keys)), BLOCK_M=config.block_m,
            BLOCK_N=config.block_n, num_warps=config.warps, num_stages=config.stages,
        )

    # A short launch over at most ONE_PASS_MAX_T keys takes the one-pass path untuned.
    if Tk <= ONE_PASS_MAX_T and B * H * cdiv(Tq, ONE_PASS_BLOCK_M) <= ONE_PASS_WAVES * sm_count(q.device):
        launch(ONE_PASS, key_pieces(Tk))
    else:
        key = (*tuning_sizes(B, H, Tq, Tk), Dh, precision, flags["QKV_TF32"], flags["O_TF32"], flags["HAS_BIAS"])
        launch(_TUNER.pick(key, CANDIDATES, launch, q.device))
    return out


@triton.jit
def _delta_kernel(o_ptr, do_ptr, delta_ptr, T_Q, H, so_b, so_t, so_h, sdo_b, sdo_t, sdo_h,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ALIGN: tl.constexpr, BLOCK_M: tl.constexpr,
                  PDL: tl.constexpr):
    """delta [B, H, Tq] = rowsum(dO * O) in fp32: the row term of dS = P * (dP - delta), since
    sum_j P_ij dP_ij = dO_i . O_i. One program per BLOCK_M query rows of one head."""
    wait_for_previous_kernel(PDL)
    q_blocks = tl.cdiv(T_Q, BLOCK_M)
    bh = (tl.program_id(0) // q_blocks).to(tl.int64)
    b, h = bh // H, bh % H
    offs_m = (tl.program_id(0) % q_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_m < T_Q)[:, None] & (offs_d < HEAD_DIM)[None, :]
    o = tl.load(_head(o_ptr, b, h, so_b, so_h, ALIGN) + offs_m[:, None] * so_t + offs_d[None, :], mask=mask,
                other=0.0)
    do = tl.load(_head(do_ptr, b, h, sdo_b, sdo_h, ALIGN) + offs_m[:, None] * sdo_t + offs_d[None, :], mask=mask,
                 other=0.0)
    start_next_kernel(PDL)
    tl.store(delta_ptr + bh * T_Q + offs_m, tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1), mask=offs_m < T_Q)


@triton.jit
def _dk_dv_step(dk, dv, k, v, offs_n, T_K, q_base, do_base, lse_base, delta_base, start, T_Q, sq_t, sdo_t, qk_scale,
                offs_d, mask_d, bias_base, bias_mult, dbias_base, INPUT_PRECISION: tl.constexpr,
                HAS_BIAS: tl.constexpr, STORE_DBIAS: tl.constexpr, BLOCK: tl.constexpr, MASKED: tl.constexpr,
                KEYS_MASKED: tl.constexpr):
    """dk and dv plus the terms of queries start .. start + BLOCK (masked past T_Q if MASKED; keys offs_n past T_K
    if KEYS_MASKED): the program's keys are the rows, so P^T, dP^T and dS^T are computed transposed and no tile of
    them is transposed. STORE_DBIAS: dS^T stored into this image's bias gradient [T_Q, T_K] at dbias_base."""
    key_valid = offs_n < T_K
    offs_m = start + tl.arange(0, BLOCK)
    valid = offs_m < T_Q
    qt_mask = valid[None, :] & mask_d[:, None] if MASKED else mask_d[:, None]
    do_mask = valid[:, None] & mask_d[None, :] if MASKED else mask_d[None, :]
    qt = tl.load(q_base + offs_m[None, :] * sq_t + offs_d[:, None], mask=qt_mask, other=0.0)      # [BLOCK_D, BLOCK]
    do = tl.load(do_base + offs_m[:, None] * sdo_t + offs_d[None, :], mask=do_mask, other=0.0)    # [BLOCK, BLOCK_D]
    # A query past T_Q gets lse = inf, so P = 0 in its column.
    lse = tl.load(lse_base + offs_m, mask=valid, other=float("inf")) if MASKED else tl.load(lse_base + offs_m)
    delta = tl.load(delta_base + offs_m, mask=valid, other=0.0) if MASKED else tl.load(delta_base + offs_m)
    s_t = mma(k, qt, tl.zeros((k.shape[0], BLOCK), dtype=tl.float32), INPUT_PRECISION, False, False)
    s_t = _bias(s_t, bias_base, offs_m[None, :], offs_n[:, None], T_Q, T_K, bias_mult, HAS_BIAS)
    if KEYS_MASKED:   # P = 0 for a key past T_K: its zeros could give exp(-lse) = inf (a row never stored, but NaN)
        s_t = tl.where(key_valid[:, None], s_t, float("-inf"))
    p_t = exp2(s_t * qk_scale - lse[None, :])
    dv = mma(cast(p_t, do.dtype), do, dv, INPUT_PRECISION, False, False)
    dp_t = mma(v, tl.trans(do), tl.zeros((k.shape[0], BLOCK), dtype=tl.float32), INPUT_PRECISION, False, False)
    ds_t = p_t * (dp_t - delta[None, :])
    if STORE_DBIAS:
        tl.store(dbias_base + offs_m[None, :] * T_K + offs_n[:, None], ds_t, mask=valid[None, :] & key_valid[:, None])
    dk = mma(cast(ds_t, qt.dtype), tl.trans(qt), dk, INPUT_PRECISION, False, False)
    return dk, dv


@triton.jit
def _dk_dv(q_base, k_base, v_base, do_base, lse_base, delta_base, dk_base, dv_base, start, T_Q, T_K,
           sq_t, sk_t, sv_t, sdo_t, sdk_t, sdv_t, scale, qk_scale, offs_d, mask_d, bias_base, bias_mult, dbias_base,
           INPUT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr, STORE_DBIAS: tl.constexpr, PDL: tl.constexpr,
           ROWS: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """dK and dV of keys start .. start + ROWS (masked past T_K if MASKED) from every query: whole blocks of
    BLOCK_N queries, then the last T_Q % BLOCK_N in masked blocks of TAIL_N."""
    offs_n = start + tl.arange(0, ROWS)
    mask = (offs_n < T_K)[:, None] & mask_d[None, :] if MASKED else mask_d[None, :]
    k = tl.load(k_base + offs_n[:, None] * sk_t + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(v_base + offs_n[:, None] * sv_t + offs_d[None, :], mask=mask, other=0.0)
    dk = tl.zeros((ROWS, offs_d.shape[0]), dtype=tl.float32)
    dv = tl.zeros((ROWS, offs_d.shape[0]), dtype=tl.float32)
    whole = T_Q - T_Q % BLOCK_N
    for m in range(0, whole, BLOCK_N):
        dk, dv = _dk_dv_step(dk, dv, k, v, offs_n, T_K, q_base, do_base, lse_base, delta_base, m, T_Q, sq_t, sdo_t,
                             qk_scale, offs_d, mask_d, bias_base, bias_mult, dbias_base, INPUT_PRECISION, HAS_BIAS,
                             STORE_DBIAS, BLOCK_N, False, MASKED)
    for m in range(whole, T_Q, TAIL_N):
        dk, dv = _dk_dv_step(dk, dv, k, v, offs_n, T_K, q_base, do_base, lse_base, delta_base, m, T_Q, sq_t, sdo_t,
                             qk_scale, offs_d, mask_d, bias_base, bias_mult, dbias_base, INPUT_PRECISION, HAS_BIAS,
                             STORE_DBIAS, TAIL_N, True, MASKED)
    start_next_kernel(PDL)
    tl.store(dk_base + offs_n[:, None] * sdk_t + offs_d[None, :], cast(dk * scale, dk_base.dtype.element_ty), mask=mask)
    tl.store(dv_base + offs_n[:, None] * sdv_t + offs_d[None, :], cast(dv, dv_base.dtype.element_ty), mask=mask)


@triton.jit
def _dq_step(dq, q, do, lse, delta, k_base, v_base, start, T_K, sk_t, sv_t, qk_scale, offs_d, mask_d, bias_base,
             offs_m, T_Q, bias_mult, INPUT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
             MASKED: tl.constexpr):
    """dq plus the terms of keys start .. start + BLOCK (masked past T_K if MASKED)."""
    offs_n = start + tl.arange(0, BLOCK)
    mask = (offs_n < T_K)[None, :] & mask_d[:, None] if MASKED else mask_d[:, None]
    k_t = tl.load(k_base + offs_n[None, :] * sk_t + offs_d[:, None], mask=mask, other=0.0)   # [BLOCK_D, BLOCK]
    v_t = tl.load(v_base + offs_n[None, :] * sv_t + offs_d[:, None], mask=mask, other=0.0)
    s = mma(q, k_t, tl.zeros((q.shape[0], BLOCK), dtype=tl.float32), INPUT_PRECISION, False, False)
    s = _bias(s, bias_base, offs_m[:, None], offs_n[None, :], T_Q, T_K, bias_mult, HAS_BIAS)
    if MASKED:   # P = 0 past T_K: a zero key's exp(-lse) could overflow, and inf * 0 is NaN in dS K
        s = tl.where((offs_n < T_K)[None, :], s, float("-inf"))
    p = exp2(s * qk_scale - lse[:, None])
    dp = mma(do, v_t, tl.zeros((q.shape[0], BLOCK), dtype=tl.float32), INPUT_PRECISION, False, False)
    ds = p * (dp - delta[:, None])
    return mma(cast(ds, k_t.dtype), tl.trans(k_t), dq, INPUT_PRECISION, False, False)


@triton.jit
def _dq(q_base, k_base, v_base, do_base, lse_base, delta_base, dq_base, start, T_Q, T_K,
        sq_t, sk_t, sv_t, sdo_t, sdq_t, scale, qk_scale, offs_d, mask_d, bias_base, bias_mult,
        INPUT_PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr, ROWS: tl.constexpr,
        BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """dQ of queries start .. start + ROWS (masked past T_Q if MASKED) from every key: whole blocks of BLOCK_N
    keys, then the last T_K % BLOCK_N in masked blocks of TAIL_N."""
    offs_m = start + tl.arange(0, ROWS)
    valid = offs_m < T_Q
    mask = valid[:, None] & mask_d[None, :] if MASKED else mask_d[None, :]
    q = tl.load(q_base + offs_m[:, None] * sq_t + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(do_base + offs_m[:, None] * sdo_t + offs_d[None, :], mask=mask, other=0.0)
    lse = tl.load(lse_base + offs_m, mask=valid, other=0.0) if MASKED else tl.load(lse_base + offs_m)
    delta = tl.load(delta_base + offs_m, mask=valid, other=0.0) if MASKED else tl.load(delta_base + offs_m)
    dq = tl.zeros((ROWS, offs_d.shape[0]), dtype=tl.float32)
    whole = T_K - T_K % BLOCK_N
    for n in range(0, whole, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, k_base, v_base, n, T_K, sk_t, sv_t, qk_scale, offs_d, mask_d, bias_base,
                      offs_m, T_Q, bias_mult, INPUT_PRECISION, HAS_BIAS, BLOCK_N, False)
    for n in range(whole, T_K, TAIL_N):
        dq = _dq_step(dq, q, do, lse, delta, k_base, v_base, n, T_K, sk_t, sv_t, qk_scale, offs_d, mask_d, bias_base,
                      offs_m, T_Q, bias_mult, INPUT_PRECISION, HAS_BIAS, TAIL_N, True)
    start_next_kernel(PDL)
    tl.store(dq_base + offs_m[:, None] * sdq_t + offs_d[None, :], cast(dq * scale, dq_base.dtype.element_ty), mask=mask)


@triton.jit
def _attention_backward_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dk_ptr, dv_ptr, bias_ptr, dbias_ptr,
    T_Q, T_K, H, scale, qk_scale, bias_mult,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sdo_b, sdo_t, sdo_h,
    sdq_b, sdq_t, sdq_h, sdk_b, sdk_t, sdk_h, sdv_b, sdv_t, sdv_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ALIGN: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    HAS_BIAS: tl.constexpr, STORE_DBIAS: tl.constexpr,   # the forward's bias; each image's dS stored as its gradient
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    wait_for_previous_kernel(PDL)
    # A head's programs are neighbours in launch order (its q, k, v and dO come from HBM once, from L2 after):
    # first its dK/dV programs, one per BLOCK_M keys and one per TAIL_N of the last T_K % BLOCK_M (197 keys,
    # BLOCK_M 64: 3 x 64 + 16 rows, not 4 x 64), then its dQ programs, split the same way over the queries.
    k_whole = T_K // BLOCK_M
    k_programs = k_whole + tl.cdiv(T_K % BLOCK_M, TAIL_N)
    q_whole = T_Q // BLOCK_M
    per_head = k_programs + q_whole + tl.cdiv(T_Q % BLOCK_M, TAIL_N)
    bh = tl.program_id(0) // per_head
    j = tl.program_id(0) % per_head
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    q_base = _head(q_ptr, b, h, sq_b, sq_h, ALIGN)
    k_base = _head(k_ptr, b, h, sk_b, sk_h, ALIGN)
    v_base = _head(v_ptr, b, h, sv_b, sv_h, ALIGN)
    do_base = _head(do_ptr, b, h, sdo_b, sdo_h, ALIGN)
    dq_base = _head(dq_ptr, b, h, sdq_b, sdq_h, ALIGN)
    dk_base = _head(dk_ptr, b, h, sdk_b, sdk_h, ALIGN)
    dv_base = _head(dv_ptr, b, h, sdv_b, sdv_h, ALIGN)
    lse_base = lse_ptr + (b * H + h) * T_Q
    delta_base = delta_ptr + (b * H + h) * T_Q
    bias_base = bias_ptr + h * T_Q * T_K if HAS_BIAS else bias_ptr
    dbias_base = dbias_ptr + (b * H + h) * T_Q * T_K if STORE_DBIAS else dbias_ptr
    if j < k_whole:
        _dk_dv(q_base, k_base, v_base, do_base, lse_base, delta_base, dk_base, dv_base, j * BLOCK_M, T_Q, T_K,
               sq_t, sk_t, sv_t, sdo_t, sdk_t, sdv_t, scale, qk_scale, offs_d, mask_d, bias_base, bias_mult,
               dbias_base, INPUT_PRECISION, HAS_BIAS, STORE_DBIAS, PDL, BLOCK_M, BLOCK_N, False)
    elif j < k_programs:
        _dk_dv(q_base, k_base, v_base, do_base, lse_base, delta_base, dk_base, dv_base,
               k_whole * BLOCK_M + (j - k_whole) * TAIL_N, T_Q, T_K, sq_t, sk_t, sv_t, sdo_t, sdk_t, sdv_t, scale,
               qk_scale, offs_d, mask_d, bias_base, bias_mult, dbias_base, INPUT_PRECISION, HAS_BIAS, STORE_DBIAS,
               PDL, TAIL_N, BLOCK_N, True)
    elif j < k_programs + q_whole:
        _dq(q_base, k_base, v_base, do_base, lse_base, delta_base, dq_base, (j - k_programs) * BLOCK_M, T_Q, T_K,
            sq_t, sk_t, sv_t, sdo_t, sdq_t, scale, qk_scale, offs_d, mask_d, bias_base, bias_mult, INPUT_PRECISION,
            HAS_BIAS, PDL, BLOCK_M, BLOCK_N, False)
    else:
        _dq(q_base, k_base, v_base, do_base, lse_base, delta_base, dq_base,
            q_whole * BLOCK_M + (j - k_programs - q_whole) * TAIL_N, T_Q, T_K, sq_t, sk_t, sv_t, sdo_t, sdq_t,
            scale, qk_scale, offs_d, mask_d, bias_base, bias_mult, INPUT_PRECISION, HAS_BIAS, PDL, TAIL_N, BLOCK_N,
            True)


def attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    *,
    scale: float | None = None,
    allow_tf32: bool | None = None,
    dq: torch.Tensor | None = None,
    dk: torch.Tensor | None = None,
    dv: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    dbias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients (dq, dk, dv) of o = softmax(q @ k^T * scale + bias) @ v given do = dL/do, from the
    forward's inputs (as fused_attention took them), its output o [B, Tq, H, Dh] and its lse [B, H, Tq]
    (fused_attention(..., lse=lse)). do: [B, Tq, H, Dh], unit stride along Dh.

    dq has q's shape, but [1, Tq, H, Dh] for a q of batch stride 0 (one set of queries expanded over the
    batch): then it is the gradient of that one set, the sum over the batch. dk and dv have k's and v's
    shape. dq, dk, dv may be given (any strides, unit stride along Dh: views of one packed [B, T, 3, H, Dh]
    buffer, say); every element of them is written. scale, allow_tf32 and bias as for fused_attention.
    dbias: a contiguous float32 [H, Tq, Tk] that receives the bias's gradient, dS summed over the batch (each
    image's dS stored by the kernel, B*H*Tq*Tk floats more written and read, then summed in one reduction).
    """
    check_device(q, k, v, o, lse, do, dq, dk, dv, bias, dbias)
    B, Tq, Tk, H, Dh = check_inputs(q, k, v, o=o, do=do)
    check_float32("lse", lse, (B, H, Tq))
    check_bias(bias, (H, Tq, Tk), q.dtype)
    if dbias is not None:
        if bias is None:
            raise ValueError("dbias is the gradient of a bias: give the forward's bias too")
        check_float32("dbias", dbias, (H, Tq, Tk))
    summed = q.stride(0) == 0 and B > 1   # dq: the sum over the batch of each image's gradient
    dq_shape = (1 if summed else B, Tq, H, Dh)
    for name, t, shape in (("dq", dq, dq_shape), ("dk", dk, k.shape), ("dv", dv, v.shape)):
        check_head_tensor(name, t, shape, q.dtype)
    scale = check_scale(scale, Dh)
    precision = input_precision(q.dtype, allow_tf32)
    dq = torch.empty(dq_shape, device=q.device, dtype=q.dtype) if dq is None else dq
    dk = torch.empty((B, Tk, H, Dh), device=q.device, dtype=q.dtype) if dk is None else dk
    dv = torch.empty((B, Tk, H, Dh), device=q.device, dtype=q.dtype) if dv is None else dv
    # Each image's dq in fp32, summed over the batch in one deterministic reduction after the kernel.
    dq_images = torch.empty((B, Tq, H, Dh), device=q.device, dtype=torch.float32) if summed else dq
    # Each image's bias gradient likewise: summed after the kernel, stored straight into dbias for one image.
    dbias_images = dbias if dbias is None or B == 1 else torch.empty((B, H, Tq, Tk), device=q.device,
                                                                     dtype=torch.float32)

    delta = torch.empty((B, H, Tq), device=q.device, dtype=torch.float32)
    delta_programs = B * H * cdiv(Tq, DELTA_BLOCK_M)
    _delta_kernel[(delta_programs,)](
        o, do, delta, Tq, H, o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1), do.stride(2),
        HEAD_DIM=Dh, BLOCK_D=block_d(Dh), ALIGN=alignment(o, do), BLOCK_M=DELTA_BLOCK_M, num_warps=4,
        **pdl(q.device, delta_programs),
    )

    def launch(config: Config) -> None:
        programs = B * H * (backward_programs(Tk, config.block_m) + backward_programs(Tq, config.block_m))
        _attention_backward_kernel[(programs,)](
            q, k, v, do, lse, delta, dq_images, dk, dv, bias, dbias_images,
            Tq, Tk, H, scale, scale * LOG2E, 1 / scale,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
            dq_images.stride(0), dq_images.stride(1), dq_images.stride(2),
            dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
            HEAD_DIM=Dh, BLOCK_D=block_d(Dh), ALIGN=alignment(q, k, v, do, dq_images, dk, dv),
            INPUT_PRECISION=precision, HAS_BIAS=bias is not None,
            STORE_DBIAS=dbias is not None, BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_warps=config.warps,
            num_stages=config.stages, **pdl(q.device, programs),
        )

    key = (*tuning_sizes(B, H, Tq, Tk), Dh, precision, bias is not None, dbias is not None)
    launch(_BACKWARD_TUNER.pick(key, BACKWARD_CANDIDATES, launch, q.device))
    if summed:
        dq.copy_(dq_images.sum(0, keepdim=True))
    if dbias_images is not dbias:
        torch.sum(dbias_images, 0, out=dbias)
    return dq, dk, dv


def backward_programs(T: int, block_m: int) -> int:
    """The backward's programs a head over T rows (keys for dK/dV, queries for dQ): one per block_m, then one
    per TAIL_N of the last T % block_m."""
    return T // block_m + cdiv(T % block_m, TAIL_N.value)


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **like_q: torch.Tensor | None
                 ) -> tuple[int, int, int, int, int]:
    """B, Tq, Tk, H, Dh of q [B, Tq, H, Dh] and k, v [B, Tk, H, Dh], each of them, and each tensor of like_q
    (None: absent) of q's shape, in q's dtype (float) with unit stride along Dh."""
    check_float("q", q)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, T, H, Dh], got shape {tuple(t.shape)}")
    (B, Tq, H, Dh), Tk = q.shape, v.shape[1]
    if not 16 <= Dh <= 256:
        raise ValueError(f"head dim must be between 16 and 256, got {Dh}")
    tensors = [("q", q, q.shape), ("k", k, (B, Tk, H, Dh)), ("v", v, (B, Tk, H, Dh))]
    tensors += [(name, t, (B, Tq, H, Dh)) for name, t in like_q.items()]
    for name, t, shape in tensors:
        check_head_tensor(name, t, shape, q.dtype)
    return B, Tq, Tk, H, Dh


def check_head_tensor(name: str, t: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    """t (None: absent) of this shape and dtype, with unit stride along its last (head) dim."""
    if t is None:
        return
    check_shape(name, t, shape)
    check_dtype(name, t, dtype)
    if t.stride(3) != 1:
        raise ValueError(f"{name} must have unit stride along the head dim, got strides {t.stride()}")


def check_float32(name: str, t: torch.Tensor, shape: tuple[int, int, int]) -> None:
    """t: a contiguous float32 tensor of this shape (lse [B, H, Tq], dbias [H, Tq, Tk])."""
    check_shape(name, t, shape)
    check_dtype(name, t, torch.float32)
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()}")


def check_bias(bias: torch.Tensor | None, shape: tuple[int, int, int], dtype: torch.dtype) -> None:
    """bias (None: absent): each head's scores' bias [H, Tq, Tk], contiguous, float32 or the inputs' dtype."""
    if bias is None:
        return
    check_shape("bias", bias, shape)
    allowed = dict.fromkeys((torch.float32, dtype))
    if bias.dtype not in allowed:
        raise ValueError(f"bias must be {' or '.join(map(str, allowed))}, got {bias.dtype}")
    if not bias.is_contiguous():
        raise ValueError(f"bias must be contiguous, got strides {bias.stride()}")


def check_scale(scale: float | None, head_dim: int) -> float:
    """The scores' scale: head_dim ** -0.5 by default, else the given one, which must be positive."""
    scale = head_dim ** -0.5 if scale is None else scale
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")
    return scale


def alignment(*tensors: torch.Tensor) -> int:
    """The largest power of two up to 16 that divides every batch and head stride of the [B, T, H, Dh] tensors
    (in elements; a stride of 0 divides by anything): the kernels' ALIGN."""
    strides = [t.stride(i) for t in tensors for i in (0, 2)]
    return next(a for a in (16, 8, 4, 2, 1) if all(s % a == 0 for s in strides))


def head_pieces(head_dim: int) -> tuple[int, int]:
    """The forward's head dim as (BLOCK_D, BLOCK_E): a power of two and, where the rest would otherwise pad the
    whole to the next power of two, a second one of at least 16 (a tensor-core product's least K), 0 for none:
    72 and 80 -> (64, 16), 96 -> (64, 32), 64 -> (64, 0), 20 -> (32, 0). The products pay for 80 columns of 72,
    not 128."""
    first = max(16, 1 << (head_dim.bit_length() - 1))
    rest = head_dim - first
    second = max(16, next_power_of_2(rest)) if rest > 0 else 0
    if second and first + second >= block_d(head_dim):
        return block_d(head_dim), 0
    return first, second


def block_d(head_dim: int) -> int:
    """The head dim padded in registers: a power of two, at least 16 (a tensor-core product's k)."""
    return max(16, next_power_of_2(head_dim))


def tuning_sizes(B: int, H: int, Tq: int, Tk: int) -> tuple[int, int, int]:
    """The sizes in the streaming kernel's tuning key: B*H's power of two, and the query and key lengths in
    size_bucket (nearby lengths share one pick). The best tile depends on how many programs fill the GPU (one
    image: 64-row tiles, every SM busy; 256 images: 128-row tiles, at 0.75x the time of 64-row ones)."""
    return next_power_of_2(B * H), size_bucket(Tq), size_bucket(Tk)


def key_pieces(T: int) -> tuple[int, int, int]:
    """T keys rounded up to 16 as at most three powers of two, largest first, 0 for an absent piece
    (197 -> 208 = 128 + 64 + 16); a fourth binary digit and below round up into the third piece."""
    bits = [1 << i for i in reversed(range(ONE_PASS_MAX_T.bit_length())) if cdiv(T, 16) * 16 & 1 << i]
    if len(bits) > 3:
        bits = bits[:2] + [next_power_of_2(sum(bits[2:]))]
    return tuple(bits + [0] * (3 - len(bits)))
