"""The Vision Transformer as nn.Modules whose forward runs only vit_triton kernels.

Parameter names follow timm (patch_embed, blocks.i.qkv, blocks.i.fc1, norm, head, ...) except
that the prefix tokens (class, distillation, then registers) are one tensor, prefix_tokens [P0, D], and
position embeddings are [T_pos, D] without timm's leading batch dimension.

Images of any height and width of at least the patch size run: the patch grid is floor(side / patch) (pixels past
the last whole patch are not read, as the libraries' strided convolution does: SigLIP's 384 px at patch 14), and
the position embedding is resampled to it as the checkpoint's library does (pos_embed.py, ViTConfig.pos_resample).
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import ResidualStream, fused_attention, patch_embed, token_mean
from .attention_pool import AttentionPool
from .config import ViTConfig
from .layers import LayerNorm, Linear
from .pos_embed import ResampledTables


class PatchEmbed(nn.Module):
    def __init__(self, cfg: ViTConfig, **factory) -> None:
        super().__init__()
        s = cfg.patch_size
        self.weight = nn.Parameter(torch.empty(cfg.embed_dim, cfg.in_chans, s, s, **factory))
        self.bias = nn.Parameter(torch.zeros(cfg.embed_dim, **factory)) if cfg.patch_bias else None
        nn.init.trunc_normal_(self.weight, std=0.02)


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm1(x)), then + mlp(norm2(x)), on the residual stream
    (ops.ResidualStream, which may leave a small GEMM's sum to the next norm). The norms, qkv, attention and fc1
    write what only the next matmul reads: with float32 matmuls on tf32 they store it rounded to tf32, so that
    matmul's K loop does not round it. defer_fc2=False: fc2 updates the stream itself (no norm reads it next)."""

    def __init__(self, cfg: ViTConfig, **factory) -> None:
        super().__init__()
        d = cfg.embed_dim
        self.num_heads = cfg.num_heads
        self.norm1 = LayerNorm(d, cfg.norm_eps, tf32_output=True, **factory)
        self.qkv = Linear(d, 3 * d, bias=cfg.qkv_bias, tf32_input=True, tf32_output=True, **factory)
        self.proj = Linear(d, d, tf32_input=True, **factory)
        self.norm2 = LayerNorm(d, cfg.norm_eps, tf32_output=True, **factory)
        self.fc1 = Linear(d, cfg.mlp_dim, activation=cfg.act, tf32_input=True, tf32_output=True, **factory)
        self.fc2 = Linear(cfg.mlp_dim, d, tf32_input=True, **factory)
        self.defer_fc2 = True

    def forward(self, x: ResidualStream) -> ResidualStream:
        batch, tokens, d = x.shape
        # The QKV GEMM's [B*T, 3D] output is read in place as q, k, v [B, T, H, Dh] views.
        qkv = self.qkv(x.norm(self.norm1)).view(batch, tokens, 3, self.num_heads, d // self.num_heads)
        attn = fused_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], tf32_input=True, tf32_output=True)
        x = x.add(self.proj, attn.view(batch * tokens, d))
        return x.add(self.fc2, self.fc1(x.norm(self.norm2)), defer=self.defer_fc2)


class ViT(nn.Module):
    """Vision Transformer from Triton kernels, with timm's forward_features/forward_head split."""

    def __init__(self, config: ViTConfig, *, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        cfg = self.config = config
        factory = {"device": device, "dtype": dtype}
        d = cfg.embed_dim
        self.patch_embed = PatchEmbed(cfg, **factory)
        pos_len = cfg.num_tokens if cfg.pos_embed_prefix else cfg.num_patches
        self.pos_embed = nn.Parameter(torch.empty(pos_len, d, **factory))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        self.pos_tables = ResampledTables(cfg.num_prefix_tokens if cfg.pos_embed_prefix else 0, cfg.grid,
                                          cfg.pos_resample)
        self.prefix_tokens = (
            nn.Parameter(torch.zeros(cfg.num_prefix_tokens, d, **factory)) if cfg.num_prefix_tokens else None
        )
        self.norm_pre = LayerNorm(d, cfg.norm_eps, **factory) if cfg.pre_norm else None
        self.blocks = nn.ModuleList(Block(cfg, **factory) for _ in range(cfg.depth))
        self.norm = LayerNorm(d, cfg.norm_eps, **factory) if cfg.final_norm and not cfg.fc_norm else None
        self.fc_norm = LayerNorm(d, cfg.norm_eps, **factory) if cfg.fc_norm else None
        self.attn_pool = (AttentionPool(d, cfg.num_heads, cfg.mlp_dim, cfg.act, cfg.norm_eps, qkv_bias=cfg.qkv_bias,
                                        **factory) if cfg.pool == "map" else None)
        self.head = Linear(d, cfg.num_classes, **factory) if cfg.num_classes else None
        self.head_dist = Linear(d, cfg.num_classes, **factory) if cfg.head_dist else None
        self.proj = Linear(d, cfg.proj_dim, bias=False, **factory) if cfg.proj_dim else None
        if cfg.depth:   # the final norm adds the last fc2's sum, if there is one
            self.blocks[-1].defer_fc2 = self.norm is not None

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """The patch grid (rows, columns) of height x width images, floor(side / patch); ValueError unless both
        sides are at least the patch size."""
        p = self.config.patch_size
        if height < p or width < p:
            raise ValueError(f"image height and width must be at least the patch size {p}, got {height}x{width}")
        return height // p, width // p

    def refresh_pos_embed(self) -> None:
        """Resamples again, in place, the kept position tables of other grids that pos_embed changed since: a
        CUDA graph reads them where they were (CUDAGraphRunner calls this before each replay)."""
        self.pos_tables.refresh(self.pos_embed)

    def _check_pixels(self, pixels: torch.Tensor) -> tuple[int, int]:
        """The patch grid of `pixels`, after checking them."""
        cfg = self.config
        expected = f"[B, {cfg.in_chans}, H, W]"
        if pixels.dim() != 4:
            raise ValueError(f"pixels must be 4-D {expected}, got shape {tuple(pixels.shape)}")
        if pixels.shape[1] != cfg.in_chans:
            raise ValueError(f"pixels must have {cfg.in_chans} channels {expected}, got shape {tuple(pixels.shape)}")
        grid = self.grid(pixels.shape[2], pixels.shape[3])
        dtype = self.pos_embed.dtype
        if pixels.dtype not in (torch.float32, dtype):
            raise ValueError(f"pixels must be float32 or {dtype} (the model's dtype), got {pixels.dtype}")
        if pixels.device != self.pos_embed.device:
            raise ValueError(f"pixels must be on the model's device {self.pos_embed.device}, got {pixels.device}")
        return grid

    def forward_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """Tokens [B, T, D] after the blocks and the final norm (HF last_hidden_state), for pixels [B, C, H, W] of
        any H and W of at least the patch size."""
        grid = self._check_pixels(pixels)
        cfg = self.config
        if pixels.shape[0] == 0:   # no image: no kernel has a program to run
            return self.pos_embed.new_empty(0, cfg.num_prefix_tokens + grid[0] * grid[1], cfg.embed_dim)
        pe = self.patch_embed
        tokens = patch_embed(pixels, pe.weight, pe.bias, self.pos_tables(self.pos_embed, grid), self.prefix_tokens)
        batch, num_tokens, d = tokens.shape
        x = tokens.view(batch * num_tokens, d)
        if self.norm_pre is not None:
            x = self.norm_pre(x)
        x = ResidualStream(x, batch)
        for block in self.blocks:
            x = block(x)
        x = x.norm(self.norm) if self.norm is not None else x.tensor()
        return x.view(batch, num_tokens, d)

    def forward_head(self, features: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """Pool (class token, patch mean or attention pool), fc_norm, then the classifier or the projection unless
        pre_logits."""
        if features.shape[0] == 0:
            out = self.head if self.head is not None else self.proj
            width = out.weight.shape[0] if out is not None and not pre_logits else features.shape[-1]
            return features.new_empty(0, width)
        if self.head_dist is not None:
            # DeiT distilled: class and distillation token each have a classifier; both are averaged.
            if pre_logits:
                return token_mean(features[:, :2])
            return self.head_dist(features[:, 1], residual=self.head(features[:, 0]), scale=0.5)
        if self.config.pool == "token":
            pooled = features[:, 0]
        elif self.attn_pool is not None:
            pooled = self.attn_pool(features)
        else:
            pooled = token_mean(features, self.config.num_prefix_tokens)
        if self.fc_norm is not None:
            pooled = self.fc_norm(pooled)
        out = self.head if self.head is not None else self.proj
        if pre_logits or out is None:
            return pooled
        return out(pooled)

    def embedding(self, features: torch.Tensor) -> torch.Tensor:
        """The image embedding of forward_features' tokens: the projection's output where the model has one, else
        the pooled features (a classifier's input)."""
        return self.forward_head(features, pre_logits=self.head is not None)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Logits [B, num_classes] when the model has a classifier, else the image embedding (embedding())."""
        return self.forward_head(self.forward_features(pixels))
