"""The activations of linear's epilogue, on its fp32 accumulator: none, GELU (exact, erf), tanh-GELU, QuickGELU
(x * sigmoid(1.702 x)) and SwiGLU (silu(gate) * value, gate and value in interleaved columns, so the tile comes out
half as wide), each from special-function instructions (exp2, reciprocal, tanh) and FMAs.

A float32 (or tf32) output gets GELU as x * Phi(x) with Phi from the Abramowitz & Stegun erfc approximation, and the
sigmoid forms (QuickGELU, SiLU) from one exp2 and one reciprocal an element. A bf16 or fp16 output gets every
activation as h + h tanh(u(x)), h = x / 2, from one tanh an element (SiLU: u = h); for exact GELU, u is an odd
polynomial fitted to erf, of the degree GELU_FIT_DEGREES gives for the output's dtype (gelu_fit_degree). Each form is
within the output's rounding of PyTorch's (tests/kernels/test_linear.py).

The backward's derivatives (activation_grad) take the fp32 forms whatever the dtype: a gradient is rounded once, after
it is multiplied by the upstream gradient, so the one-tanh shortcuts' error would not hide under a rounding step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import LOG2E, exp2, reciprocal, tanh

ACTIVATIONS = ("none", "gelu", "gelu_tanh", "quick_gelu", "swiglu")

_GELU_P = tl.constexpr(0.3275911 * 0.7071067811865476)       # A&S p, times 1/sqrt(2) for z = |x|/sqrt(2)
_MINUS_HALF_LOG2E = tl.constexpr(-0.5 * LOG2E)                # exp(-z^2) = 2^(-x^2 log2(e) / 2)
_SQRT_2_OVER_PI = 0.7978845608028654   # tanh-GELU: u = sqrt(2/pi) (x + 0.044715 x^3)
_QUICK_GELU_K = 1.702                   # QuickGELU: x sigmoid(1.702 x)
_GELU_TANH_A = tl.constexpr(-2.0 * _SQRT_2_OVER_PI * LOG2E)  # exp(-2u) = 2^(x (A + B x^2))
_GELU_TANH_B = tl.constexpr(-2.0 * _SQRT_2_OVER_PI * 0.044715 * LOG2E)
_QUICK_GELU_A = tl.constexpr(-_QUICK_GELU_K * LOG2E)
_QUICK_GELU_DS = tl.constexpr(_QUICK_GELU_K)   # sigmoid(k x)' = k s (1 - s)
_SILU_A = tl.constexpr(-LOG2E)   # SiLU: x sigmoid(x), exp(-x) = 2^(-x log2(e))
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)   # the normal density phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
_GELU_TANH_DU = tl.constexpr(3 * 0.044715)   # u'(x) = sqrt(2/pi) (1 + 3 * 0.044715 x^2)
# The one-tanh forms: u(x) in h + h tanh(u(x)), h = x / 2. Exact GELU's u is an odd polynomial whose tanh is closest
# to erf(x / sqrt(2)) (minimax fits): of degree 3 within 2.72e-4 of x Phi(x), which
# bf16's rounding hides (half an ulp: 2e-3 at 1) and fp16's does not (2.4e-4); of degree 5 within 2.8e-5, its x^2
# held at 64 (|x| >= 8, where tanh(u) rounds to 1 either way) since past |x| = 10 the x^5 term would turn u down.
_GELU_FIT3_1, _GELU_FIT3_3 = tl.constexpr(0.8001587525878255), tl.constexpr(0.034701480458530345)
_GELU_FIT5_1, _GELU_FIT5_3 = tl.constexpr(0.7975240468576681), tl.constexpr(0.03700132026148351)
_GELU_FIT5_5 = tl.constexpr(-0.0003523119647840455)
_GELU_TANH_U, _GELU_TANH_U3 = tl.constexpr(_SQRT_2_OVER_PI), tl.constexpr(_SQRT_2_OVER_PI * 0.044715)
_QUICK_GELU_U = tl.constexpr(0.5 * _QUICK_GELU_K)   # sigmoid(1.702 x) = (1 + tanh(0.851 x)) / 2
# The one-tanh forms by output dtype, as the degree of exact GELU's u; fp32 and tf32 keep the forms below them.
GELU_FIT_DEGREES = {torch.bfloat16: 3, torch.float16: 5}


def gelu_fit_degree(dtype: torch.dtype, activation: str) -> int:
    """The kernel's GELU_FIT_DEGREE for this output dtype and activation: 0 (the exp2 and reciprocal forms, and no
    activation) or the degree of exact GELU's u in the one-tanh forms."""
    return GELU_FIT_DEGREES.get(dtype, 0) if activation != "none" else 0


@triton.jit
def _normal_tail(x):
    """(Phi(-|x|), exp(-x^2 / 2)) for fp32 x: Phi(-|x|) = erfc(z) / 2 = poly(t) * exp(-z^2), t = 1 / (1 + p z),
    z = |x| / sqrt(2) (Abramowitz & Stegun 7.1.26, |error| < 1.5e-7; the 1/2 is folded into the coefficients)."""
    t = reciprocal(1.0 + _GELU_P * tl.abs(x))
    poly = t * (0.127414796 + t * (-0.142248368 + t * (0.7107068705 + t * (-0.7265760135 + t * 0.5307027145))))
    density = exp2(x * x * _MINUS_HALF_LOG2E)
    return poly * density, density


@triton.jit
def _logistic(e):
    """1 / (1 + 2^e), sigmoid(k x) for e = -k log2(e) x: one exp2 and one reciprocal (0 where 2^e overflows)."""
    return reciprocal(1.0 + exp2(e))


@triton.jit
def apply_activation(x, ACT: tl.constexpr, GELU_FIT_DEGREE: tl.constexpr):
    """The activation on fp32 x, from single SFU instructions and FMAs: evaluated once an element while no
    MMA runs, so each instruction shows at K = 768. "swiglu" takes x [BM, BN] with the gate in its even columns
    and the value in its odd ones, and returns silu(gate) * value [BM, BN // 2].

    GELU_FIT_DEGREE > 0 (y is 16-bit; gelu_fit_degree): h + h tanh(u(x)), one SFU instruction an element where
    the forms below take two; exact GELU's u is a fit of that degree. fc1 + GELU's relative Frobenius error on an H100: bf16
    (degree 3) 0.64-0.67x PyTorch's, fp16 (degree 5) 0.65-0.68x, against 0.62-0.67x below."""
    if ACT == "swiglu":
        x, value = tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
    if GELU_FIT_DEGREE and ACT != "none":
        if ACT == "gelu" and GELU_FIT_DEGREE == 5:
            s = tl.minimum(x * x, 64.0)
            u = x * (_GELU_FIT5_1 + s * (_GELU_FIT5_3 + s * _GELU_FIT5_5))
        elif ACT == "gelu":
            u = x * (_GELU_FIT3_1 + _GELU_FIT3_3 * x * x)
        elif ACT == "gelu_tanh":
            u = x * (_GELU_TANH_U + _GELU_TANH_U3 * x * x)
        elif ACT == "quick_gelu":
            u = x * _QUICK_GELU_U
        else:   # SiLU: sigmoid(x) = (1 + tanh(x / 2)) / 2
            u = 0.5 * x
        h = 0.5 * x
        x = h + h * tanh(u)   # +inf -> +inf, -inf -> NaN, as PyTorch's tanh form
    elif ACT == "gelu":
        tail, _ = _normal_tail(x)
        # x (1 - tail) for x >= 0, x tail below: one FMA, no select (NaN at +-inf, as PyTorch's)
        x = tl.maximum(x, 0.0) - tl.abs(x) * tail
    elif ACT == "gelu_tanh":
        # 0.5x(1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
        x = x * _logistic(x * (_GELU_TANH_A + _GELU_TANH_B * x * x))
    elif ACT == "quick_gelu":
        # x * sigmoid(1.702x)
        x = x * _logistic(x * _QUICK_GELU_A)
    elif ACT == "swiglu":
        # SiLU, x * sigmoid(x)
        x = x * _logistic(x * _SILU_A)
    if ACT == "swiglu":
        x = x * value
    return x


@triton.jit
def activation_grad(x, g, ACT: tl.constexpr):
    """The gradient at the activation's input: g * act'(x) for fp32 x (the forward's pre-activation) and g (the
    gradient at its output), elementwise and accurate to fp32 (the exp2 and reciprocal forms, for every dtype).
    "swiglu" takes x [BM, 2W], gates in its even columns and values in its odd ones, and g [BM, W], and returns
    [BM, 2W] laid out as x: d gate = g value silu'(gate), d value = g silu(gate).

        gelu        Phi(x) + x phi(x)
        gelu_tanh   s + 2 x s (1 - s) u'(x),  s = sigmoid(2 u) = (1 + tanh(u)) / 2, u = sqrt(2/pi) (x + 0.044715 x^3)
        quick_gelu  s + 1.702 x s (1 - s),    s = sigmoid(1.702 x)
        silu        s + x s (1 - s),          s = sigmoid(x)"""
    # One return: the compiler type-checks the code after a return in a constexpr branch, where g * d would not fit
    # swiglu's shapes.
    if ACT == "swiglu":
        gate, value = tl.split(tl.reshape(x, [x.shape[0], x.shape[1] // 2, 2]))
        s = _logistic(gate * _SILU_A)
        d_gate = g * value * (s + gate * s * (1.0 - s))
        dx = tl.reshape(tl.join(d_gate, g * gate * s), [x.shape[0], x.shape[1]])
    else:
        if ACT == "gelu":
            tail, density = _normal_tail(x)
            d = tl.where(x >= 0, 1.0 - tail, tail) + x * density * _INV_SQRT_2PI
        elif ACT == "gelu_tanh":
            s = _logistic(x * (_GELU_TANH_A + _GELU_TANH_B * x * x))
            d = s + 2.0 * x * s * (1.0 - s) * _GELU_TANH_U * (1.0 + _GELU_TANH_DU * x * x)
        else:   # quick_gelu
            s = _logistic(x * _QUICK_GELU_A)
            d = s + _QUICK_GELU_DS * x * s * (1.0 - s)
        dx = g * d
    return dx
