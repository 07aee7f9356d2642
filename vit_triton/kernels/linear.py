"""Linear layer with a fused epilogue: y = scale * (act(x @ W^T + b) [+ residual]).

Layouts: x [M, K] with unit stride along K (any row stride, so a view such as tokens[:, 0] is
read in place); W [N, K] row-major, the nn.Linear layout, read K-major as the tensor cores want
it (no transposed copy); b [N]; residual and y [M, N] with unit stride along N.

The epilogue runs on the fp32 accumulator before the single store: bias, then the activation,
then the residual add, then the scale, so no elementwise kernel follows the GEMM.

Schedule: output tiles in grouped order; a persistent config launches one (or two) programs per
SM, each walking tiles pid, pid + grid, ... with the tile and K loops flattened, so the next
tile's loads are in flight during this tile's epilogue. When every matrix is 16-byte aligned
(base and row stride) and M is at least TMA_MIN_ROWS, tiles move through TMA descriptors, which
zero-fill and clip at the edges; otherwise through masked pointer loads and stores.

Cost: 2*M*N*K FLOPs; at least (M*K + N*K + M*N [+ M*N residual]) elements moved (+ N bias).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    INTERPRET, cast, check_device, check_dtype, check_float, check_shape, input_precision, mma, num_programs,
    tma_ready, tune, use_torch_scratch,
)

ACTIVATIONS = ("none", "gelu", "gelu_tanh", "quick_gelu")

_SQRT_HALF = tl.constexpr(0.7071067811865476)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def _activation(x, ACT: tl.constexpr):
    if ACT == "gelu":
        # x * Phi(x). Phi from erfc(z) = poly(t) * exp(-z^2), t = 1 / (1 + p z), z = |x| / sqrt(2) >= 0
        # (Abramowitz & Stegun 7.1.26, |error| < 1.5e-7): two SFU ops and a few FMAs where
        # libdevice's erf costs several times that, which the epilogue of a K=768 GEMM notices.
        z = tl.abs(x) * _SQRT_HALF
        t = tl.fdiv(1.0, 1.0 + 0.3275911 * z)
        poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
        tail = 0.5 * poly * tl.exp(-z * z)  # Phi(-|x|)
        x = x * tl.where(x >= 0, 1.0 - tail, tail)
    elif ACT == "gelu_tanh":
        # 0.5x(1 + tanh(u)) = x * sigmoid(2u)
        u = _SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
        x = tl.fdiv(x, 1.0 + tl.exp(-2.0 * u))
    elif ACT == "quick_gelu":
        # x * sigmoid(1.702x)
        x = tl.fdiv(x, 1.0 + tl.exp(-1.702 * x))
    return x


def _config(bm, bn, bk, warps, stages, persistent=1):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8, "PERSISTENT": persistent},
                         num_warps=warps, num_stages=stages)


# Measured on an H100 at ViT-S/B/L shapes (scripts/sweep_kernels.py, benchmarks/NOTES.md): persistent
# TMA tiles win from a few thousand rows up; below that, small tiles that give every SM work.
LARGE_M = [
    _config(128, 256, 64, 8, 3), _config(128, 128, 64, 8, 5), _config(128, 128, 64, 4, 4),
    _config(128, 128, 128, 8, 3), _config(256, 128, 64, 8, 3), _config(128, 128, 64, 8, 4),
]
SMALL_M = [
    _config(64, 128, 128, 4, 3), _config(64, 128, 128, 4, 3, 0), _config(64, 64, 64, 4, 4, 0),
    _config(64, 64, 128, 4, 4, 0), _config(64, 32, 128, 4, 4, 0), _config(64, 32, 128, 4, 4, 2),
    _config(128, 128, 64, 4, 4), _config(128, 128, 64, 8, 5), _config(64, 256, 64, 4, 4),
]
FLOAT32 = [_config(128, 128, 32, 8, 3), _config(128, 128, 32, 4, 4), _config(64, 128, 32, 4, 4),
           _config(64, 64, 32, 4, 4, 0)]
SMALL_M_ROWS = 2048
# Fewer rows than this take the pointer path even when aligned: each program builds its TMA
# descriptors first, a fixed cost the copies do not earn back on a single image's 197 tokens (ViT-B
# batch 1: 0.664 -> 0.619 ms a forward); at 1576 rows (batch 8) the TMA path is 1.26x faster.
TMA_MIN_ROWS = 256


def _candidates(configs, named_args, **kwargs):
    """The list made for this dtype and row count: fewer compilations on each new shape."""
    if INTERPRET:
        return configs
    if named_args["x_ptr"].dtype == torch.float32:
        return FLOAT32
    return SMALL_M if named_args["M"] <= SMALL_M_ROWS else LARGE_M


@triton.jit
def _tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """Grouped order: GROUP_M row-tiles share each column-tile of W while it sits in L2."""
    group = tile // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_size = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % (GROUP_M * num_n)) % group_size
    pid_n = (tile % (GROUP_M * num_n)) // group_size
    return pid_m, pid_n


@triton.autotune(
    configs=tune(LARGE_M + SMALL_M + FLOAT32, _config(32, 32, 32, 4, 1)),
    key=["M", "N", "K", "HAS_BIAS", "ACT", "HAS_RESIDUAL", "HAS_SCALE", "INPUT_PRECISION", "USE_TMA"],
    prune_configs_by={"early_config_prune": _candidates},
    cache_results=True,
)
@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, r_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_rm, stride_ym, scale,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_SCALE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PERSISTENT: tl.constexpr,  # read by the launcher only: programs per SM, or 0 for one per tile
):
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    if USE_TMA:
        x_desc = tl.make_tensor_descriptor(x_ptr, [M, K], [stride_xm, 1], [BLOCK_M, BLOCK_K])
        w_desc = tl.make_tensor_descriptor(w_ptr, [N, K], [stride_wn, 1], [BLOCK_N, BLOCK_K])
        y_desc = tl.make_tensor_descriptor(y_ptr, [M, N], [stride_ym, 1], [BLOCK_M, BLOCK_N])
        if HAS_RESIDUAL:
            r_desc = tl.make_tensor_descriptor(r_ptr, [M, N], [stride_rm, 1], [BLOCK_M, BLOCK_N])
    offs_k = tl.arange(0, BLOCK_K)
    # Each program walks tiles pid, pid + grid, ...; flattening the two loops lets the pipeliner
    # issue the next tile's first loads while this tile's epilogue runs.
    for tile in tl.range(tl.program_id(0), num_m * num_n, tl.num_programs(0), flatten=True):
        pid_m, pid_n = _tile_coords(tile, num_m, num_n, GROUP_M)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = offs_m < M
        mask_n = offs_n < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            if USE_TMA:  # the TMA zero-fills what lies outside [M, K] and [N, K]
                a = x_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
                b = w_desc.load([pid_n * BLOCK_N, k * BLOCK_K]).T
            else:
                cols = k * BLOCK_K + offs_k
                a = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + cols[None, :],
                            mask=mask_m[:, None] & (cols[None, :] < K), other=0.0)
                b = tl.load(w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + cols[:, None],
                            mask=mask_n[None, :] & (cols[:, None] < K), other=0.0)
            acc = mma(a, b, acc, INPUT_PRECISION)

        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        acc = _activation(acc, ACT)
        mask = mask_m[:, None] & mask_n[None, :]
        rows = offs_m[:, None].to(tl.int64)
        if HAS_RESIDUAL:
            if USE_TMA:
                acc += r_desc.load([pid_m * BLOCK_M, pid_n * BLOCK_N]).to(tl.float32)
            else:
                acc += tl.load(r_ptr + rows * stride_rm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            acc *= scale
        y = cast(acc, y_ptr.dtype.element_ty)
        if USE_TMA:  # the store is clipped to [M, N]
            y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], y)
        else:
            tl.store(y_ptr + rows * stride_ym + offs_n[None, :], y, mask=mask)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str = "none",
    residual: torch.Tensor | None = None,
    scale: float = 1.0,
    allow_tf32: bool | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = scale * (activation(x @ weight.T + bias) + residual) for 2-D x [M, K] and weight [N, K].

    activation: "none", "gelu" (exact erf), "gelu_tanh" or "quick_gelu" (x * sigmoid(1.702 x)).
    allow_tf32: for float32 inputs; None follows torch.get_float32_matmul_precision().
    out must not alias x or residual.
    """
    check_device(x, weight, bias, residual, out)
    check_float("x", x)
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D [M, K] with unit stride along K, got shape {tuple(x.shape)} "
                         f"and strides {x.stride()}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    M, K = x.shape
    N = weight.shape[0]
    check_shape("weight", weight, (N, K))
    check_dtype("weight", weight, x.dtype)
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    if bias is not None:
        check_shape("bias", bias, (N,))
        check_dtype("bias", bias, x.dtype)
        bias = bias.contiguous()
    for name, t in (("residual", residual), ("out", out)):
        if t is not None:
            check_shape(name, t, (M, N))
            check_dtype(name, t, x.dtype)
            if t.stride(1) != 1:
                raise ValueError(f"{name} must have unit stride along N, got strides {t.stride()}")
    if out is None:
        out = torch.empty((M, N), device=x.device, dtype=x.dtype)

    programs = num_programs(x.device)
    use_tma = M >= TMA_MIN_ROWS and tma_ready(x, weight, residual, out)
    if use_tma:
        use_torch_scratch()

    def grid(meta):
        tiles = triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"])
        return (min(tiles, programs * meta["PERSISTENT"]) if meta["PERSISTENT"] else tiles,)

    _linear_kernel[grid](
        x, weight, bias, residual, out,
        M, N, K,
        x.stride(0), weight.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), scale,
        HAS_BIAS=bias is not None, ACT=activation, HAS_RESIDUAL=residual is not None, HAS_SCALE=scale != 1.0,
        INPUT_PRECISION=input_precision(x.dtype, allow_tf32), USE_TMA=use_tma,
    )
    return out
