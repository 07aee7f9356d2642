"""The two parametrized layers every module of the model is built from: LayerNorm and Linear (a GEMM with its
fused epilogue), as nn.Modules over vit_triton ops."""

from __future__ import annotations

import torch
from torch import nn

from ..ops import layer_norm, linear


class LayerNorm(nn.Module):
    """LayerNorm, or with rms RMSNorm (x / sqrt(mean(x^2) + eps) * weight); bias=False: no bias parameter.
    tf32_output: the output is read only by a GEMM, so with float32 matmuls on tf32 it is stored rounded
    to tf32 and the GEMM skips that rounding (kernels/tf32.py)."""

    def __init__(self, dim: int, eps: float, tf32_output: bool = False, bias: bool = True, rms: bool = False,
                 **factory) -> None:
        super().__init__()
        self.eps = eps
        self.tf32_output, self.rms = tf32_output, rms
        self.weight = nn.Parameter(torch.ones(dim, **factory))
        self.bias = nn.Parameter(torch.zeros(dim, **factory)) if bias else None

    def forward(self, x: torch.Tensor, post_add: torch.Tensor | None = None) -> torch.Tensor:
        """The norm of x [M, D]'s rows; post_add [R, D], R dividing M, is added after it (row m: post_add[m % R])."""
        return layer_norm(x, self.weight, self.bias, self.eps, rms=self.rms, tf32_output=self.tf32_output,
                          post_add=post_add)


class Linear(nn.Module):
    """y = scale * (activation(x @ W^T + b) [+ residual]), all in one GEMM. tf32_input: x comes from a
    kernel's tf32_output; tf32_output: y is read only by another GEMM or attention (kernels/tf32.py).

    activation "swiglu" (a gated MLP's fc1): y [.., d_out] = silu(x @ Wg^T + bg) * (x @ Wv^T + bv), from one
    weight [2 * d_out, d_in] and bias [2 * d_out] whose rows interleave the gate's and the value's: row 2j is
    Wg's row j, row 2j + 1 Wv's (a loader must interleave a checkpoint's gate and value weights into this layout)."""

    def __init__(self, d_in: int, d_out: int, bias: bool = True, activation: str = "none", tf32_input: bool = False,
                 tf32_output: bool = False, **factory) -> None:
        super().__init__()
        self.activation = activation
        self.tf32_input, self.tf32_output = tf32_input, tf32_output
        rows = 2 * d_out if activation == "swiglu" else d_out   # swiglu: a gate's and a value's row an output
        self.weight = nn.Parameter(torch.empty(rows, d_in, **factory))
        self.bias = nn.Parameter(torch.zeros(rows, **factory)) if bias else None
        nn.init.trunc_normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, scale: float = 1.0,
                rope: tuple[torch.Tensor, torch.Tensor] | None = None, rope_half: bool = False,
                rope_prefix: int = 0, col_scale: torch.Tensor | None = None,
                row_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None) -> torch.Tensor:
        """rope, rope_half, rope_prefix: a QKV projection's rotary embedding; col_scale: a LayerScale's gamma;
        row_scale: stochastic depth's per-row scale (ops.linear); bias: in place of the layer's own (a function of
        it)."""
        bias = self.bias if bias is None else bias
        return linear(x, self.weight, bias, activation=self.activation, residual=residual, scale=scale,
                      tf32_input=self.tf32_input, tf32_output=self.tf32_output, rope=rope, rope_half=rope_half,
                      rope_prefix=rope_prefix, col_scale=col_scale, row_scale=row_scale)
