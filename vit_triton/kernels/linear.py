"""Linear layer with a fused epilogue: y = scale * (act(x @ W^T + b) [+ residual]).

Layouts: x [M, K] with unit stride along K (any row stride, so a view such as tokens[:, 0] is
read in place); W [N, K] row-major, the nn.Linear layout, read K-major as the tensor cores want
it (no transposed copy); b [N]; residual and y [M, N] with unit stride along N.

The epilogue runs on the fp32 accumulator before the single store: bias, then the activation,
then the residual add, then the scale, so no elementwise kernel follows the GEMM.

Cost: 2*M*N*K FLOPs; at least (M*K + N*K + M*N [+ M*N residual]) elements moved (+ N bias).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import cast, check_device, check_dtype, check_float, check_shape, input_precision, mma, tune

ACTIVATIONS = ("none", "gelu", "gelu_tanh", "quick_gelu")

_SQRT_HALF = tl.constexpr(0.7071067811865476)
_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)


@triton.jit
def _activation(x, ACT: tl.constexpr):
    # gelu_tanh = 0.5x(1 + tanh(u)) = x * sigmoid(2u); quick_gelu = x * sigmoid(1.702x).
    if ACT == "gelu":
        x = 0.5 * x * (1.0 + tl.erf(x * _SQRT_HALF))
    elif ACT == "gelu_tanh":
        u = _SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
        x = x / (1.0 + tl.exp(-2.0 * u))
    elif ACT == "quick_gelu":
        x = x / (1.0 + tl.exp(-1.702 * x))
    return x


def _config(bm, bn, bk, warps, stages):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                         num_warps=warps, num_stages=stages)


@triton.autotune(
    configs=tune(
        [
            _config(128, 256, 64, 8, 3),
            _config(128, 128, 64, 8, 4),
            _config(128, 128, 64, 4, 4),
            _config(128, 64, 64, 4, 4),
            _config(64, 128, 64, 4, 4),
            _config(64, 64, 64, 4, 4),
            _config(128, 128, 32, 8, 4),
            _config(64, 64, 32, 4, 5),
        ],
        _config(32, 32, 32, 4, 1),
    ),
    key=["M", "N", "K", "HAS_BIAS", "ACT", "HAS_RESIDUAL", "HAS_SCALE", "INPUT_PRECISION"],
)
@triton.jit
def _linear_kernel(
    x_ptr, w_ptr, b_ptr, r_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_rm, stride_ym, scale,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, HAS_RESIDUAL: tl.constexpr, HAS_SCALE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    # Grouped tile order: GROUP_M row-tiles share each column-tile of W while it sits in L2.
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    group_size = min(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % group_size
    pid_n = (pid % (GROUP_M * num_n)) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(x_ptrs, mask=mask_m[:, None] & (offs_k[None, :] < k_left), other=0.0)
        b = tl.load(w_ptrs, mask=mask_n[None, :] & (offs_k[:, None] < k_left), other=0.0)
        acc = mma(a, b, acc, INPUT_PRECISION)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    acc = _activation(acc, ACT)
    mask = mask_m[:, None] & mask_n[None, :]
    rows = offs_m[:, None].to(tl.int64)
    if HAS_RESIDUAL:
        acc += tl.load(r_ptr + rows * stride_rm + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        acc *= scale
    tl.store(y_ptr + rows * stride_ym + offs_n[None, :], cast(acc, y_ptr.dtype.element_ty), mask=mask)


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

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    _linear_kernel[grid](
        x, weight, bias, residual, out,
        M, N, K,
        x.stride(0), weight.stride(0),
        residual.stride(0) if residual is not None else 0, out.stride(0), scale,
        HAS_BIAS=bias is not None, ACT=activation, HAS_RESIDUAL=residual is not None, HAS_SCALE=scale != 1.0,
        INPUT_PRECISION=input_precision(x.dtype, allow_tf32),
    )
    return out
