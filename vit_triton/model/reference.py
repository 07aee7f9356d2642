"""The same ViT written with PyTorch operators: the reference that `verify` and the tests hold
the kernels to. Takes a ViT's config and parameters, so it can run in float64 on a copy."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .config import ViTConfig
from .pos_embed import resample, sincos_table
from .rel_pos_bias import relative_position_bias, relative_position_index
from .rope import rope_tables


def activation(x: torch.Tensor, act: str) -> torch.Tensor:
    """The MLP's activation on fc1's output; "swiglu" gates: silu(x[..., 0::2]) * x[..., 1::2] (fc1's rows
    interleaved, gate then value)."""
    if act == "swiglu":
        return F.silu(x[..., 0::2]) * x[..., 1::2]
    if act == "gelu":
        return F.gelu(x)
    if act == "gelu_tanh":
        return F.gelu(x, approximate="tanh")
    if act == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    return x


def norm(x: torch.Tensor, p: dict[str, torch.Tensor], name: str, cfg: ViTConfig) -> torch.Tensor:
    """The model's norm `name` (LayerNorm, bias optional, or RMSNorm) over x's last dimension."""
    if cfg.norm == "rmsnorm":
        return F.rms_norm(x, (x.shape[-1],), p[name + ".weight"], cfg.norm_eps)
    return F.layer_norm(x, (x.shape[-1],), p[name + ".weight"], p.get(name + ".bias"), cfg.norm_eps)


def reference_forward(cfg: ViTConfig, params: dict[str, torch.Tensor], pixels: torch.Tensor,
                      features_only: bool = False,
                      branch_scales: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
    """forward_features (features_only) or forward of a ViT with parameters `params` (state dict), for pixels of
    any size the model takes (its position embedding resampled as pos_embed.resample does). Differentiable: the
    tests take the gradients of every parameter and of the pixels from it. branch_scales: for each block, the
    per-image scales [B] of its attention and MLP branches (stochastic depth's draws, as timm's drop_path applies
    them), or None for none."""
    p = params
    d = cfg.embed_dim
    grid = (pixels.shape[2] // cfg.patch_size, pixels.shape[3] // cfg.patch_size)
    x = F.conv2d(pixels.to(p["patch_embed.weight"].dtype), p["patch_embed.weight"], p.get("patch_embed.bias"),
                 stride=cfg.patch_size).flatten(2).transpose(1, 2)
    batch = x.shape[0]
    pos = None
    if cfg.pos_sincos:
        pos = sincos_table(grid, d, pixels.device, x.dtype)
    elif cfg.abs_pos_embed:
        pos = resample(p["pos_embed"], cfg.num_prefix_tokens if cfg.pos_embed_prefix else 0, cfg.grid, grid,
                       cfg.pos_resample)
    if cfg.embed_norm:   # of the patch embeddings, before the position embedding
        x = norm(x, p, "embed_norm", cfg)
    if pos is not None and not cfg.pos_embed_prefix:
        x = x + pos
    if cfg.num_prefix_tokens:
        x = torch.cat([p["prefix_tokens"].expand(batch, -1, -1), x], dim=1)
    if pos is not None and cfg.pos_embed_prefix:
        x = x + pos
    if cfg.pre_norm:
        x = norm(x, p, "norm_pre", cfg)
    if cfg.rope != "none":
        cos, sin = rope_tables(cfg, grid, pixels.device, p.get("rope_freqs"))
    index = relative_position_index(grid, pixels.device) if cfg.rel_pos_bias != "none" else None
    for i in range(cfg.depth):
        b = f"blocks.{i}."
        h = norm(x, p, b + "norm1", cfg)
        qkv = F.linear(h, p[b + "qkv.weight"], p.get(b + "qkv.bias"))
        q, k, v = qkv.view(batch, -1, 3, cfg.num_heads, cfg.head_dim).unbind(2)   # [B, T, H, Dh]
        if cfg.rope != "none":
            tables = (cos[i], sin[i]) if cfg.rope == "mixed" else (cos, sin)
            q, k = (rope_reference(t, *tables, cfg.rope_half, cfg.num_prefix_tokens) for t in (q, k))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        table = p.get(b + "rel_pos_table", p.get("rel_pos_table"))   # BEiT's, the block's own or the shared one
        bias = None if table is None else relative_position_bias(table, index)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=bias).transpose(1, 2).reshape(batch, -1, d)
        if cfg.attn_norm:
            a = norm(a, p, b + "attn_norm", cfg)
        scales = (None, None) if branch_scales is None else branch_scales[i]
        x = x + _branch(F.linear(a, p[b + "proj.weight"], p.get(b + "proj.bias")), p.get(b + "ls1"), scales[0])
        h = activation(F.linear(norm(x, p, b + "norm2", cfg), p[b + "fc1.weight"], p.get(b + "fc1.bias")), cfg.act)
        if cfg.mlp_norm:
            h = norm(h, p, b + "mlp_norm", cfg)
        x = x + _branch(F.linear(h, p[b + "fc2.weight"], p.get(b + "fc2.bias")), p.get(b + "ls2"), scales[1])
    if "norm.weight" in p:
        x = norm(x, p, "norm", cfg)
    if features_only:
        return x
    if cfg.head_dist:
        return (F.linear(x[:, 0], p["head.weight"], p["head.bias"])
                + F.linear(x[:, 1], p["head_dist.weight"], p["head_dist.bias"])) / 2
    if cfg.pool == "map":
        x = attention_pool_reference(p, "attn_pool.", x, cfg.attn_pool_heads, cfg.norm_eps, cfg.act)
    else:
        x = x[:, 0] if cfg.pool == "token" else x[:, cfg.num_prefix_tokens:].mean(1)
    if cfg.fc_norm:
        x = norm(x, p, "fc_norm", cfg)
    if cfg.num_classes:
        x = F.linear(x, p["head.weight"], p["head.bias"])
    if cfg.proj_dim:
        x = F.linear(x, p["proj.weight"], p.get("proj.bias"))
    return x


def _branch(y: torch.Tensor, gamma: torch.Tensor | None, scale: torch.Tensor | None) -> torch.Tensor:
    """A block's branch output [B, T, D] times its LayerScale gamma [D] and its images' scales [B], if any."""
    if gamma is not None:
        y = y * gamma
    return y if scale is None else y * scale.to(y.dtype)[:, None, None]


def attention_pool_reference(params: dict[str, torch.Tensor], prefix: str, x: torch.Tensor, num_heads: int,
                             eps: float, act: str) -> torch.Tensor:
    """An attention-pool head (model.attention_pool.AttentionPool, whose parameters are params[prefix + name]) on
    tokens x [B, T, D], as timm's AttentionPoolLatent computes it: every latent query attends to the tokens, then
    proj, then + mlp(norm); returns latent 0's output [B, D]. Without a q (or mlp) in params, the latent is the
    query (proj's output is returned), as AIMv2's head does."""
    p = prefix
    batch, tokens, d = x.shape
    q = params[p + "latent"]
    if p + "q.weight" in params:
        q = F.linear(q, params[p + "q.weight"], params.get(p + "q.bias"))
    q = q.view(1, -1, num_heads, d // num_heads).transpose(1, 2).expand(batch, -1, -1, -1)
    kv = F.linear(x, params[p + "kv.weight"], params.get(p + "kv.bias"))
    k, v = kv.view(batch, tokens, 2, num_heads, d // num_heads).permute(2, 0, 3, 1, 4)
    a = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, -1, d)
    x = F.linear(a, params[p + "proj.weight"], params[p + "proj.bias"])
    if p + "mlp.fc1.weight" not in params:
        return x[:, 0]
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
