"""Attention pooling with a learned query (multihead attention pooling, MAP) from vit_triton kernels: timm's
AttentionPoolLatent (global_pool 'map') and the heads of SigLIP's and AIMv2's vision towers.

Parameter names and shapes are timm's (latent, q, kv, proj, norm, mlp.fc1, mlp.fc2) but for the latent queries,
[L, D] without timm's leading batch dimension. SigLIP's head is the same with L = 1: its probe is the latent, its
attention's in_proj splits into q (the first D rows) and kv (the other 2D), out_proj is proj, layernorm is norm.
AIMv2's has neither q nor norm and MLP: its cls_token is the query itself, k_proj and v_proj make kv, output_proj
is proj, whose output is the pooled embedding.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import attention, mlp
from .config import ACTIVATIONS
from .layers import LayerNorm, Linear


class Mlp(nn.Module):
    """fc2(activation(fc1(h))) + residual, in two GEMMs; timm's names."""

    def __init__(self, dim: int, hidden: int, act: str, **factory) -> None:
        super().__init__()
        self.fc1 = Linear(dim, hidden, activation=act, tf32_input=True, tf32_output=True, **factory)
        self.fc2 = Linear(hidden, dim, tf32_input=True, **factory)

    def forward(self, h: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return mlp(h, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias, activation=self.fc1.activation,
                   residual=residual, tf32_input=True)


class AttentionPool(nn.Module):
    """tokens [B, T, D] -> [B, D]: latent query 0 attends to the tokens (q = q(latent), k and v from kv(tokens)),
    then x = proj(attention), and x + mlp(norm(x)). This is timm's pool_type 'token', the output of latent 0, which
    depends on no other latent: with latent_len > 1 the other latents are kept (a timm state dict loads) but never
    used. query_proj=False: q is the latent itself (no q layer); mlp=False: the output is x (no norm, no mlp).

    q(latent) does not depend on the input, so it is computed once and kept (see query()). The attention, proj,
    norm and fc1 outputs are read only by the next matmul: with float32 matmuls on tf32 they are stored rounded
    (kernels/tf32.py); kv reads the tokens as they are."""

    def __init__(self, dim: int, num_heads: int, mlp_dim: int, act: str = "gelu", norm_eps: float = 1e-6,
                 latent_len: int = 1, qkv_bias: bool = True, query_proj: bool = True, mlp: bool = True,
                 **factory) -> None:
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} must be a multiple of num_heads {num_heads}")
        if act not in ACTIVATIONS:
            raise ValueError(f"act must be one of {ACTIVATIONS}, got {act!r}")
        self.num_heads = num_heads
        self.latent = nn.Parameter(torch.empty(latent_len, dim, **factory))
        nn.init.trunc_normal_(self.latent, std=dim ** -0.5)
        self.q = Linear(dim, dim, bias=qkv_bias, tf32_output=True, **factory) if query_proj else None
        self.kv = Linear(dim, 2 * dim, bias=qkv_bias, tf32_output=True, **factory)
        self.proj = Linear(dim, dim, tf32_input=True, **factory)
        self.norm = LayerNorm(dim, norm_eps, tf32_output=True, **factory) if mlp else None
        self.mlp = Mlp(dim, mlp_dim, act, **factory) if mlp else None
        self._kept_query: tuple[tuple, torch.Tensor] | None = None   # (what it was computed from, q(latent[:1]))

    def query(self) -> torch.Tensor:
        """q(latent[:1]), [1, D] (without query_proj: latent[:1] itself). Kept while latent, q.weight and q.bias
        stay where they are with the same version counters, and the float32 matmul precision (which decides its tf32
        rounding) stays the same. Computed at each call where that cannot be told or must not be kept: under
        torch.compile, inside a CUDA-graph capture (the graph then computes it from the weights where they lie, so
        in-place updates reach it), for inference tensors, which have no version counter, and where autograd
        records it (training)."""
        latent = self.latent[:1]
        if self.q is None:
            return latent
        params = [t for t in (self.latent, self.q.weight, self.q.bias) if t is not None]
        if (torch.compiler.is_compiling() or any(t.is_inference() for t in params)
                or torch.is_grad_enabled() and any(t.requires_grad for t in params)
                or latent.is_cuda and torch.cuda.is_current_stream_capturing()):
            return self.q(latent)
        made_from = (torch.get_float32_matmul_precision(), *((t.data_ptr(), t._version) for t in params))
        if self._kept_query is None or self._kept_query[0] != made_from:
            self._kept_query = made_from, self.q(latent)
        return self._kept_query[1]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B, T, D], viewable as [B*T, D] (a contiguous batch of rows) -> the pooled embedding [B, D]."""
        batch, num_tokens, d = tokens.shape
        head_dim = d // self.num_heads
        # kv's [B*T, 2D] output is read in place as k, v [B, T, H, Dh]; the one query is expanded over the batch.
        kv = self.kv(tokens.view(batch * num_tokens, d)).view(batch, num_tokens, 2, self.num_heads, head_dim)
        q = self.query().view(1, 1, self.num_heads, head_dim)
        # The latent as the query holds no tf32 values: the kernel rounds q, k and v (k, v lose nothing to it).
        attn = attention(kv, q, tf32_input=self.q is not None, tf32_output=True)
        x = self.proj(attn.view(batch, d))
        return x if self.mlp is None else self.mlp(self.norm(x), residual=x)
