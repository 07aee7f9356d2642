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
masked, in blocks of 16, so a sequence of 197 costs 208 keys of work, not 256. Head dims that are not a
power of two (80, 96) are padded to one in registers by masked loads.

One pass (up to 256 keys, launches of at most two waves): a program takes all of its head's keys
at once, in up to three power-of-two pieces (197: 128 + 64 + 16), and holds every score of its query
block, so the softmax is one max, one exponential and one sum a score with no rescaling in between.
Its loads are not pipelined and it needs about twice the registers, 1.5-1.8x slower than streaming
where the launch is many waves deep; where the GPU is latency-bound (ViT-B/16, 1-5 images) its one
dependent chain (scores, max, exponentials, P V) instead of one a key block wins in the forward.

Cost: 4*B*H*Tq*Tk*Dh FLOPs (two GEMMs) + B*H*Tq*Tk exponentials; at least 2*B*(Tq + Tk)*H*Dh elements
moved (q, k, v read, o written; a query expanded over the batch is read once).
"""

from __future__ import annotations

from pathlib import Path

import torch
import triton
import triton.language as tl

from .common import (
    INTERPRET, LOG2E, cast, check_device, check_dtype, check_float, check_shape, exp2, input_precision, mma,
    sm_count, pdl, start_next_kernel, to_tf32, tune, wait_for_previous_kernel,
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
# The tuner's disk cache is keyed by this source: a change to the kernel or the candidates starts afresh.
_TUNER = Tuner("attention", Path(__file__).read_text())


@triton.jit
def _scores(q, k_base, start, T, sk_t, offs_d, mask_d, INPUT_PRECISION: tl.constexpr, QKV_TF32: tl.constexpr,
            BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """q k^T for keys start .. start + BLOCK, -inf past T if MASKED."""
    offs_n = start + tl.arange(0, BLOCK)
    k_mask = (offs_n < T)[None, :] & mask_d[:, None] if MASKED else mask_d[:, None]
    k = tl.load(k_base + offs_n[None, :] * sk_t + offs_d[:, None], mask=k_mask, other=0.0)
    s = mma(q, k, tl.zeros((q.shape[0], BLOCK), dtype=tl.float32), INPUT_PRECISION, QKV_TF32, QKV_TF32)
    if MASKED:
        s = tl.where((offs_n < T)[None, :], s, float("-inf"))
    return s


@triton.jit
def _add_pv(acc, p, v_base, start, T, sv_t, offs_d, mask_d, INPUT_PRECISION: tl.constexpr, QKV_TF32: tl.constexpr,
            BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """acc + p v for keys start .. start + BLOCK (V read as zeros past T if MASKED)."""
    offs_n = start + tl.arange(0, BLOCK)
    v_mask = (offs_n < T)[:, None] & mask_d[None, :] if MASKED else mask_d[None, :]
    v = tl.load(v_base + offs_n[:, None] * sv_t + offs_d[None, :], mask=v_mask, other=0.0)
    return mma(cast(p, v.dtype), v, acc, INPUT_PRECISION, False, QKV_TF32)


@triton.jit
def _attend(acc, m_i, l_i, q, k_base, v_base, start, T, sk_t, sv_t, qk_scale, offs_d, mask_d,
            INPUT_PRECISION: tl.constexpr, QKV_TF32: tl.constexpr, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """One step of the online softmax over keys start .. start + BLOCK (masked past T if MASKED)."""
    s = _scores(q, k_base, start, T, sk_t, offs_d, mask_d, INPUT_PRECISION, QKV_TF32, BLOCK, MASKED)
    # The scale (> 0) is applied to the row max, and to each score inside the exponent's FMA.
    m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)
    p = exp2(s * qk_scale - m_new[:, None])
    alpha = exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = _add_pv(acc * alpha[:, None], p, v_base, start, T, sv_t, offs_d, mask_d, INPUT_PRECISION, QKV_TF32, BLOCK,
                  MASKED)
    return acc, m_new, l_i


@triton.jit
def _attend_once(q, k_base, v_base, T, sk_t, sv_t, qk_scale, offs_d, mask_d, acc,
                 INPUT_PRECISION: tl.constexpr, QKV_TF32: tl.constexpr,
                 KEYS0: tl.constexpr, KEYS1: tl.constexpr, KEYS2: tl.constexpr):
    """The one-pass softmax over all T keys, in pieces KEYS0 >= KEYS1 >= KEYS2 (0: absent; the last
    present one is masked past T). Returns the unnormalised P V and the row sums of P."""
    s0 = _scores(q, k_base, 0, T, sk_t, offs_d, mask_d, INPUT_PRECISION, QKV_TF32, KEYS0, KEYS1 == 0)
    m = tl.max(s0, axis=1)
    if KEYS1 > 0:
        s1 = _scores(q, k_base, KEYS0, T, sk_t, offs_d, mask_d, INPUT_PRECISION, QKV_TF32, KEYS1, KEYS2 == 0)
        m = tl.maximum(m, tl.max(s1, axis=1))
    if KEYS2 > 0:
        s2 = _scores(q, k_base, KEYS0 + KEYS1, T, sk_t, offs_d, mask_d, INPUT_PRECISION, QKV_TF32, KEYS2, True)
        m = tl.maximum(m, tl.max(s2, axis=1))
    m = m * qk_scale   # the scale (> 0) is applied to the row max, and to each score inside the exponent's FMA
    p = exp2(s0 * qk_scale - m[:, None])
    l_i = tl.sum(p, axis=1)
    acc = _add_pv(acc, p, v_base, 0, T, sv_t, offs_d, mask_d, INPUT_PRECISION, QKV_TF32, KEYS0, KEYS1 == 0)
    if KEYS1 > 0:
        p = exp2(s1 * qk_scale - m[:, None])
        l_i += tl.sum(p, axis=1)
        acc = _add_pv(acc, p, v_base, KEYS0, T, sv_t, offs_d, mask_d, INPUT_PRECISION, QKV_TF32, KEYS1, KEYS2 == 0)
    if KEYS2 > 0:
        p = exp2(s2 * qk_scale - m[:, None])
        l_i += tl.sum(p, axis=1)
        acc = _add_pv(acc, p, v_base, KEYS0 + KEYS1, T, sv_t, offs_d, mask_d, INPUT_PRECISION, QKV_TF32, KEYS2, True)
    return acc, l_i


@triton.jit
def _attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr,
    T_K, H, T_Q, qk_scale,   # keys, queries
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, so_b, so_t, so_h,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, INPUT_PRECISION: tl.constexpr, PDL: tl.constexpr,
    QKV_TF32: tl.constexpr, O_TF32: tl.constexpr,   # q, k, v hold tf32 values already; o stored rounded to tf32
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

    q_ptrs = q_ptr + b * sq_b + h * sq_h + offs_m[:, None] * sq_t + offs_d[None, :]
    q = tl.load(q_ptrs, mask=(offs_m < T_Q)[:, None] & mask_d[None, :], other=0.0)
    k_base = k_ptr + b * sk_b + h * sk_h
    v_base = v_ptr + b * sv_b + h * sv_h

    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    if KEYS0 > 0:
        acc, l_i = _attend_once(q, k_base, v_base, T_K, sk_t, sv_t, qk_scale, offs_d, mask_d, acc,
                                INPUT_PRECISION, QKV_TF32, KEYS0, KEYS1, KEYS2)
    else:
        # Whole key blocks without masks, then the last T_K % BLOCK_N keys in blocks of TAIL_N: at 197
        # tokens, 3 x 64 + 16 keys are multiplied instead of 4 x 64.
        whole = T_K - T_K % BLOCK_N
        for start in range(0, whole, BLOCK_N):
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_base, v_base, start, T_K, sk_t, sv_t, qk_scale, offs_d,
                                    mask_d, INPUT_PRECISION, QKV_TF32, BLOCK_N, False)
        for start in range(whole, T_K, TAIL_N):
            acc, m_i, l_i = _attend(acc, m_i, l_i, q, k_base, v_base, start, T_K, sk_t, sv_t, qk_scale, offs_d,
                                    mask_d, INPUT_PRECISION, QKV_TF32, TAIL_N, True)

    start_next_kernel(PDL)
    o = acc / l_i[:, None]
    if O_TF32:
        o = to_tf32(o)
    o_ptrs = o_ptr + b * so_b + h * so_h + offs_m[:, None] * so_t + offs_d[None, :]
    tl.store(o_ptrs, cast(o, o_ptr.dtype.element_ty), mask=(offs_m < T_Q)[:, None] & mask_d[None, :])


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
) -> torch.Tensor:
    """softmax(q @ k^T * scale) @ v for q [B, Tq, H, Dh] and k, v [B, Tk, H, Dh]; returns [B, Tq, H, Dh]
    contiguous. q may be one query expanded over the batch (batch stride 0).

    scale (positive) defaults to Dh ** -0.5. Head dims from 16 to 256 are accepted. tf32_input (q, k and
    v), tf32_output: see tf32.py; they act only where the matmuls run on tf32.
    """
    check_device(q, k, v, out)
    check_float("q", q)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, T, H, Dh], got shape {tuple(t.shape)}")
    (B, Tq, H, Dh), Tk = q.shape, v.shape[1]
    if not 16 <= Dh <= 256:
        raise ValueError(f"head dim must be between 16 and 256, got {Dh}")
    for name, t, tokens in (("k", k, Tk), ("v", v, Tk), ("out", out, Tq)):
        if t is not None:
            check_shape(name, t, (B, tokens, H, Dh))
            check_dtype(name, t, q.dtype)
    for name, t in (("q", q), ("k", k), ("v", v), ("out", out)):
        if t is not None and t.stride(3) != 1:
            raise ValueError(f"{name} must have unit stride along the head dim, got strides {t.stride()}")
    if out is None:
        out = torch.empty((B, Tq, H, Dh), device=q.device, dtype=q.dtype)
    scale = Dh ** -0.5 if scale is None else scale
    precision = input_precision(q.dtype, allow_tf32)
    if not scale > 0:
        raise ValueError(f"scale must be positive, got {scale}")

    flags = dict(HEAD_DIM=Dh, BLOCK_D=max(16, triton.next_power_of_2(Dh)), INPUT_PRECISION=precision,
                 QKV_TF32=precision == "tf32" and tf32_input, O_TF32=precision == "tf32" and tf32_output,
                 **pdl(q.device, B * H * triton.cdiv(Tq, SMALLEST_BLOCK_M)))

    def launch(config: Config, keys: tuple[int, int, int] = (0, 0, 0)) -> None:
        # One axis of programs, which allows 2^31 - 1 (axis 1 allows 65535).
        _attention_kernel[(B * H * triton.cdiv(Tq, config.block_m),)](
            q, k, v, out,
            Tk, H, Tq, scale * LOG2E,
            q.stride(0), q.stride(1), q.stride(2),
            k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            **flags, **dict(zip(("KEYS0", "KEYS1", "KEYS2"), keys)), BLOCK_M=config.block_m,
            BLOCK_N=config.block_n, num_warps=config.warps, num_stages=config.stages,
        )

    # A short launch over at most ONE_PASS_MAX_T keys takes the one-pass path untuned.
    if Tk <= ONE_PASS_MAX_T and B * H * triton.cdiv(Tq, ONE_PASS_BLOCK_M) <= ONE_PASS_WAVES * sm_count(q.device):
        launch(ONE_PASS, key_pieces(Tk))
    else:
        key = (*tuning_sizes(B, H, Tq, Tk), Dh, precision, flags["QKV_TF32"], flags["O_TF32"])
        launch(_TUNER.pick(key, CANDIDATES, launch, q.device))
    return out


def tuning_sizes(B: int, H: int, Tq: int, Tk: int) -> tuple[int, int, int]:
    """The sizes in the streaming kernel's tuning key: B*H's power of two, and the query and key lengths in
    size_bucket (nearby lengths share one pick). The best tile depends on how many programs fill the GPU (one
    image: 64-row tiles, every SM busy; 256 images: 128-row tiles, at 0.75x the time of 64-row ones)."""
    return triton.next_power_of_2(B * H), size_bucket(Tq), size_bucket(Tk)


def key_pieces(T: int) -> tuple[int, int, int]:
    """T keys rounded up to 16 as at most three powers of two, largest first, 0 for an absent piece
    (197 -> 208 = 128 + 64 + 16); a fourth binary digit and below round up into the third piece."""
    bits = [1 << i for i in reversed(range(ONE_PASS_MAX_T.bit_length())) if triton.cdiv(T, 16) * 16 & 1 << i]
    if len(bits) > 3:
        bits = bits[:2] + [triton.next_power_of_2(sum(bits[2:]))]
    return tuple(bits + [0] * (3 - len(bits)))
