"""The same ViT written with PyTorch operators: the reference that `verify` and the tests hold
the kernels to. Takes a ViT's config and parameters, so it can run in float64 on a copy."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ViTConfig
from .pos_embed import resample


def activation(x: torch.Tensor, act: str) -> torch.Tensor:
    if act == "gelu":
        return F.gelu(x)
    if act == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if act == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    return x


def reference_forward(cfg: ViTConfig, params: dict[str, torch.Tensor], pixels: torch.Tensor,
                      features_only: bool = False) -> torch.Tensor:
    """forward_features (features_only) or forward of a ViT with parameters `params` (state dict), for pixels of
    any size the model takes (its position embedding resampled as pos_embed.resample does)."""
    p = params
    d, eps = cfg.embed_dim, cfg.norm_eps
    grid = (pixels.shape[2] // cfg.patch_size, pixels.shape[3] // cfg.patch_size)
    pos = resample(p["pos_embed"], cfg.num_prefix_tokens if cfg.pos_embed_prefix else 0, cfg.grid, grid,
                   cfg.pos_resample)
    x = F.conv2d(pixels.to(p["pos_embed"].dtype), p["patch_embed.weight"], p.get("patch_embed.bias"),
                 stride=cfg.patch_size).flatten(2).transpose(1, 2)
    batch = x.shape[0]
    if not cfg.pos_embed_prefix:
        x = x + pos
    if cfg.num_prefix_tokens:
        x = torch.cat([p["prefix_tokens"].expand(batch, -1, -1), x], dim=1)
    if cfg.pos_embed_prefix:
        x = x + pos
    if cfg.pre_norm:
        x = F.layer_norm(x, (d,), p["norm_pre.weight"], p["norm_pre.bias"], eps)
    for i in range(cfg.depth):
        b = f"blocks.{i}."
        h = F.layer_norm(x, (d,), p[b + "norm1.weight"], p[b + "norm1.bias"], eps)
        qkv = F.linear(h, p[b + "qkv.weight"], p.get(b + "qkv.bias"))
        q, k, v = qkv.view(batch, -1, 3, cfg.num_heads, cfg.head_dim).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, -1, d)
        x = x + F.linear(a, p[b + "proj.weight"], p[b + "proj.bias"])
        h = F.layer_norm(x, (d,), p[b + "norm2.weight"], p[b + "norm2.bias"], eps)
        h = activation(F.linear(h, p[b + "fc1.weight"], p[b + "fc1.bias"]), cfg.act)
        x = x + F.linear(h, p[b + "fc2.weight"], p[b + "fc2.bias"])
    if "norm.weight" in p:
        x = F.layer_norm(x, (d,), p["norm.weight"], p["norm.bias"], eps)
    if features_only:
        return x
    if cfg.head_dist:
        return (F.linear(x[:, 0], p["head.weight"], p["head.bias"])
                + F.linear(x[:, 1], p["head_dist.weight"], p["head_dist.bias"])) / 2
    if cfg.pool == "map":
        x = attention_pool_reference(p, "attn_pool.", x, cfg.num_heads, eps, cfg.act)
    else:
        x = x[:, 0] if cfg.pool == "token" else x[:, cfg.num_prefix_tokens:].mean(1)
    if cfg.fc_norm:
        x = F.layer_norm(x, (d,), p["fc_norm.weight"], p["fc_norm.bias"], eps)
    if cfg.num_classes:
        x = F.linear(x, p["head.weight"], p["head.bias"])
    if cfg.proj_dim:
        x = F.linear(x, p["proj.weight"])
    return x


def attention_pool_reference(params: dict[str, torch.Tensor], prefix: str, x: torch.Tensor, num_heads: int,
                             eps: float, act: str) -> torch.Tensor:
    """An attention-pool head (model.attention_pool.AttentionPool, whose parameters are params[prefix + name]) on
    tokens x [B, T, D], as timm's AttentionPoolLatent computes it: every latent query attends to the tokens, then
    proj, then + mlp(norm); returns latent 0's output [B, D]."""
    p = prefix
    batch, tokens, d = x.shape
    q = F.linear(params[p + "latent"], params[p + "q.weight"], params.get(p + "q.bias"))
    q = q.view(1, -1, num_heads, d // num_heads).transpose(1, 2).expand(batch, -1, -1, -1)
    kv = F.linear(x, params[p + "kv.weight"], params.get(p + "kv.bias"))
    k, v = kv.view(batch, tokens, 2, num_heads, d // num_heads).permute(2, 0, 3, 1, 4)
    a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, -1, d)
    x = F.linear(a, params[p + "proj.weight"], params[p + "proj.bias"])
    h = F.layer_norm(x, (d,), params[p + "norm.weight"], params[p + "norm.bias"], eps)
    h = activation(F.linear(h, params[p + "mlp.fc1.weight"], params[p + "mlp.fc1.bias"]), act)
    return (x + F.linear(h, params[p + "mlp.fc2.weight"], params[p + "mlp.fc2.bias"]))[:, 0]


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, half: bool = False,
                   prefix: int = 0) -> torch.Tensor:
    """Rotary position embeddings on x [B, T, H, Dh], as kernels.fused_attention applies them to q and k: tokens
    from `prefix` on become x cos + rotated(x) sin, with cos, sin [T - prefix, Dh] (all heads) or
    [H, T - prefix, Dh]; rotated(x) is [-x1, x0, -x3, x2, ...] (interleaved pairs) or, if half, [-x_hi, x_lo]
    (timm's rot and rope_rotate_half). The math in float32 (float64 for a float64 x), the result in x's dtype."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    tokens = x[:, prefix:].to(dtype)
    if half:
        lo, hi = tokens.chunk(2, -1)
        partner = torch.cat([-hi, lo], -1)
    else:
        partner = torch.stack([-tokens[..., 1::2], tokens[..., ::2]], -1).flatten(-2)
    cos, sin = (t.to(dtype).transpose(0, 1) if t.dim() == 3 else t.to(dtype)[:, None] for t in (cos, sin))
    return torch.cat([x[:, :prefix], (tokens * cos + partner * sin).to(x.dtype)], 1)
