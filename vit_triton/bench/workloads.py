"""Each kernel of one forward pass as a runnable workload: random inputs at the model's shapes,
our launcher, the PyTorch operators that compute the same thing, and the kernel's cost.
`verify` compares the two; the roofline times them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import fused_attention, layer_norm, linear, patch_embed, token_mean
from ..model.config import ViTConfig
from ..model.reference import activation
from .costs import KernelCost, forward_costs


@dataclass
class Workload:
    cost: KernelCost
    ours: Callable[..., torch.Tensor]
    torch: Callable[..., torch.Tensor]
    inputs: tuple[torch.Tensor | None, ...]


def patch_embed_torch(px, w, b, pos, pre):
    """timm's order: pos is added before the prefix tokens are put in front unless it covers them."""
    x = F.conv2d(px.to(w.dtype), w, b, stride=w.shape[-1]).flatten(2).transpose(1, 2)
    covers_prefix = pre is not None and pos is not None and pos.shape[0] == x.shape[1] + pre.shape[0]
    if pos is not None and not covers_prefix:
        x = x + pos
    if pre is not None:
        x = torch.cat([pre.expand(x.shape[0], -1, -1), x], dim=1)
    return x + pos if covers_prefix else x


def _attention_torch(qkv, bias=None):
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2)


def forward_workloads(cfg: ViTConfig, batch: int, dtype: torch.dtype, device: torch.device) -> list[Workload]:
    """One workload per entry of forward_costs(cfg, batch), with fresh random inputs."""
    d, t, s, eps = cfg.embed_dim, cfg.num_tokens, cfg.patch_size, cfg.norm_eps

    def rand(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, device=device) * scale + shift).to(dtype)

    def build(c: KernelCost) -> Workload:
        if c.kind == "patch_embed":
            k = cfg.in_chans * s * s
            pos_len = t if cfg.pos_embed_prefix else cfg.num_patches
            inputs = (rand(batch, cfg.in_chans, cfg.image_size, cfg.image_size), rand(d, cfg.in_chans, s, s,
                      scale=k ** -0.5), rand(d) if cfg.patch_bias else None, rand(pos_len, d),
                      rand(cfg.num_prefix_tokens, d) if cfg.num_prefix_tokens else None)
            return Workload(c, patch_embed, patch_embed_torch, inputs)
        if c.kind == "layer_norm":
            width, rms, rows = c.dims["d"], c.dims["rms"], c.dims["post_add"]
            inputs = (rand(c.dims["m"], width, scale=2.0, shift=0.5), rand(width, scale=0.5, shift=1.0),
                      None if rms else rand(width), rand(rows, width) if rows else None)

            def ln_torch(x, w, b, table):
                y = F.rms_norm(x, (width,), w, eps) if rms else F.layer_norm(x, (width,), w, b, eps)
                return y if table is None else y + table.repeat(x.shape[0] // rows, 1)
            return Workload(c, lambda x, w, b, table: layer_norm(x, w, b, eps, rms=rms, post_add=table), ln_torch,
                            inputs)
        if c.kind == "linear":
            m, n, k, act = c.dims["m"], c.dims["n"], c.dims["k"], c.dims["act"]
            inputs = (rand(m, k), rand(n, k, scale=k ** -0.5), rand(n) if c.dims["bias"] else None,
                      rand(m, n // 2 if act == "swiglu" else n) if c.dims["residual"] else None)

            def ref(x, w, b, r):
                y = activation(F.linear(x, w, b), act)
                return y if r is None else y + r
            return Workload(c, lambda x, w, b, r: linear(x, w, b, activation=act, residual=r), ref, inputs)
        if c.kind == "fused_attention":
            qkv = rand(batch, t, 3, cfg.num_heads, cfg.head_dim)
            bias = rand(cfg.num_heads, t, t) if c.dims["bias"] else None   # BEiT's, in the model's dtype
            return Workload(c, lambda qkv, b: fused_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], bias=b),
                            _attention_torch, (qkv, bias))
        if c.kind == "token_mean":
            start = cfg.num_prefix_tokens
            return Workload(c, lambda x: token_mean(x, start), lambda x: x[:, start:].mean(1), (rand(batch, t, d),))
        raise ValueError(f"no workload for kernel kind {c.kind!r}")

    elem = torch.empty((), dtype=dtype).element_size()
    return [build(c) for c in forward_costs(cfg, batch, elem)]
