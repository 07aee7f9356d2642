"""The Vision Transformer as nn.Modules whose forward runs only vit_triton kernels.

Parameter names follow timm (patch_embed, blocks.i.qkv, blocks.i.fc1, norm, head, ...) except
that the prefix tokens (class, distillation, then registers) are one tensor, prefix_tokens [P0, D], and
position embeddings are [T_pos, D] without timm's leading batch dimension.

Images of any height and width of at least the patch size run: the patch grid is floor(side / patch) (pixels past
the last whole patch are not read, as the libraries' strided convolution does: SigLIP's 384 px at patch 14), and
the position embedding is resampled to it as the checkpoint's library does (pos_embed.py, ViTConfig.pos_resample).
With embed_norm (AIMv2) the patch embeddings are normalised before the position table is added: patch_embed then
adds only the bias, and the norm's kernel adds the table after normalising. A relative position bias (BEiT) is
learned for the checkpoint's own grid, which the pixels must then make.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..ops import ResidualStream, attention, patch_embed, token_mean
from .attention_pool import AttentionPool
from .config import ViTConfig
from .layers import LayerNorm, Linear
from .pos_embed import ResampledTables, SincosTables
from .reference import rope_reference
from .rel_pos_bias import relative_position_bias, relative_position_index, table_rows
from .rope import RopeTables


def norm_layer(cfg: ViTConfig, dim: int, tf32_output: bool = False, **factory) -> LayerNorm:
    """The model's norm over `dim` features: LayerNorm, or RMSNorm (cfg.norm "rmsnorm", no bias)."""
    rms = cfg.norm == "rmsnorm"
    return LayerNorm(dim, cfg.norm_eps, tf32_output=tf32_output, bias=not rms, rms=rms, **factory)


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
    matmul's K loop does not round it. defer_fc2=False: fc2 updates the stream itself (no norm reads it next).
    attn_norm normalises the attention's output before proj (the attention then stores it unrounded: a norm reads
    it). A gated MLP (act "swiglu") gates in fc1's epilogue; mlp_norm normalises its output before fc2. Rotary
    embeddings (rope: cos, sin tables) rotate q and k of the patch tokens in the QKV GEMM's epilogue. LayerScale
    (ls1, ls2) and stochastic depth (drop_path: the probability of dropping a branch for an image, in training)
    scale the proj's and fc2's products in their epilogues, before the residual add. A relative position bias
    (rel_pos_bias: [H, T, T], from the block's own rel_pos_table or the model's) is added to the attention's scores."""

    def __init__(self, cfg: ViTConfig, drop_path: float = 0.0, **factory) -> None:
        super().__init__()
        d = cfg.embed_dim
        self.num_heads = cfg.num_heads
        self.rope_half, self.rope_prefix = cfg.rope_half, cfg.num_prefix_tokens
        self.norm1 = norm_layer(cfg, d, tf32_output=True, **factory)
        self.qkv = Linear(d, 3 * d, bias=cfg.qkv_bias, tf32_input=True, tf32_output=True, **factory)
        self.attn_norm = norm_layer(cfg, d, tf32_output=True, **factory) if cfg.attn_norm else None
        self.proj = Linear(d, d, bias=cfg.proj_bias, tf32_input=True, **factory)
        self.norm2 = norm_layer(cfg, d, tf32_output=True, **factory)
        self.fc1 = Linear(d, cfg.mlp_dim, bias=cfg.mlp_bias, activation=cfg.act, tf32_input=True, tf32_output=True,
                          **factory)
        self.mlp_norm = norm_layer(cfg, cfg.mlp_dim, tf32_output=True, **factory) if cfg.mlp_norm else None
        self.fc2 = Linear(cfg.mlp_dim, d, bias=cfg.mlp_bias, tf32_input=True, **factory)
        # key_bias=False: the key third of qkv.bias is multiplied by zero where autograd records it, so that no
        # gradient reaches it (a buffer outside the state dict)
        mask = torch.tensor([1.0, 0.0, 1.0], device=factory.get("device")).repeat_interleave(d)
        self.register_buffer("key_bias_mask", mask if cfg.qkv_bias and not cfg.key_bias else None, persistent=False)
        self.ls1 = nn.Parameter(torch.ones(d, **factory)) if cfg.layer_scale else None
        self.ls2 = nn.Parameter(torch.ones(d, **factory)) if cfg.layer_scale else None
        self.rel_pos_table = (nn.Parameter(torch.zeros(table_rows(cfg.grid), cfg.num_heads, **factory))
                              if cfg.rel_pos_bias == "block" else None)
        self.drop_path = drop_path
        self.defer_fc2 = True

    def _drop_path(self, batch: int, tokens: int, device: torch.device) -> torch.Tensor | None:
        """In training, stochastic depth's row scale [B*T] (float32): per image 0 (dropped, with probability
        drop_path) or 1 / keep, as timm's drop_path draws it; else None."""
        if not (self.training and self.drop_path):
            return None
        keep = 1.0 - self.drop_path
        return torch.empty(batch, device=device).bernoulli_(keep).div_(keep).repeat_interleave(tokens)

    def forward(self, x: ResidualStream, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                rel_pos_bias: torch.Tensor | None = None) -> ResidualStream:
        batch, tokens, d = x.shape
        # The QKV GEMM's [B*T, 3D] output is read in place as q, k, v [B, T, H, Dh] views.
        h, shape = x.norm(self.norm1), (batch, tokens, 3, self.num_heads, d // self.num_heads)
        bias = self.qkv.bias
        if self.key_bias_mask is not None and torch.is_grad_enabled() and bias.requires_grad:
            bias = bias * self.key_bias_mask.to(bias.dtype)
        rounded = self.attn_norm is None   # the output stored rounded to tf32 where only proj reads it
        if rope is not None and rope[0].requires_grad:
            # RoPE-mixed's learned frequencies in training: q and k rotated by PyTorch, differentiable in the tables
            qkv = self.qkv(h, bias=bias).view(shape)
            q, k = (rope_reference(qkv[:, :, i], *rope, self.rope_half, self.rope_prefix) for i in (0, 1))
            attn = attention(torch.stack([q, k, qkv[:, :, 2]], 2), bias=rel_pos_bias, tf32_output=rounded)
        else:
            qkv = self.qkv(h, bias=bias, rope=rope, rope_half=self.rope_half, rope_prefix=self.rope_prefix)
            attn = attention(qkv.view(shape), bias=rel_pos_bias, tf32_input=True, tf32_output=rounded)
        device, attn = attn.device, attn.view(batch * tokens, d)
        if self.attn_norm is not None:
            attn = self.attn_norm(attn)
        x = x.add(self.proj, attn, col_scale=self.ls1,
                  row_scale=self._drop_path(batch, tokens, device))
        h = x.norm(self.norm2)
        if self.mlp_norm is None:
            return x.add_mlp(self.fc1, self.fc2, h, col_scale=self.ls2,
                             row_scale=self._drop_path(batch, tokens, device), defer=self.defer_fc2)
        return x.add(self.fc2, self.mlp_norm(self.fc1(h)), defer=self.defer_fc2, col_scale=self.ls2,
                     row_scale=self._drop_path(batch, tokens, device))


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
        learned = cfg.abs_pos_embed and not cfg.pos_sincos
        self.pos_embed = nn.Parameter(torch.empty(pos_len, d, **factory)) if learned else None
        if self.pos_embed is not None:
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
        self.pos_tables = ResampledTables(cfg.num_prefix_tokens if cfg.pos_embed_prefix else 0, cfg.grid,
                                          cfg.pos_resample)
        self.sincos_tables = SincosTables(d) if cfg.pos_sincos else None
        self.embed_norm = norm_layer(cfg, d, **factory) if cfg.embed_norm else None
        self.prefix_tokens = (
            nn.Parameter(torch.zeros(cfg.num_prefix_tokens, d, **factory)) if cfg.num_prefix_tokens else None
        )
        self.rope_tables = RopeTables(cfg) if cfg.rope != "none" else None
        # RoPE-mixed's learned frequencies, from which its tables are computed (timm's rope.freqs)
        self.rope_freqs = (nn.Parameter(torch.zeros(self.rope_tables.freqs_shape, **factory))
                           if cfg.rope == "mixed" else None)
        self.norm_pre = norm_layer(cfg, d, **factory) if cfg.pre_norm else None
        # the relative position bias' table shared by all blocks, and every table's row of each (query, key) pair
        self.rel_pos_table = (nn.Parameter(torch.zeros(table_rows(cfg.grid), cfg.num_heads, **factory))
                              if cfg.rel_pos_bias == "shared" else None)
        self.register_buffer("rel_pos_index", relative_position_index(cfg.grid, device)
                             if cfg.rel_pos_bias != "none" else None, persistent=False)
        # Stochastic depth's rates rise linearly over the blocks, from 0 to drop_path_rate (timm's ramp).
        rates = torch.linspace(0, cfg.drop_path_rate, cfg.depth).tolist() if cfg.depth else []
        self.blocks = nn.ModuleList(Block(cfg, rate, **factory) for rate in rates)
        self.grad_checkpointing = False
        self.norm = norm_layer(cfg, d, **factory) if cfg.final_norm and not cfg.fc_norm else None
        self.fc_norm = norm_layer(cfg, d, **factory) if cfg.fc_norm else None
        self.attn_pool = (AttentionPool(d, cfg.attn_pool_heads, cfg.attn_pool_mlp_dim, cfg.act, cfg.norm_eps,
                                        qkv_bias=cfg.qkv_bias,
                                        query_proj=cfg.pool_query_proj, mlp=cfg.pool_mlp, **factory)
                          if cfg.pool == "map" else None)
        self.head = Linear(d, cfg.num_classes, **factory) if cfg.num_classes else None
        self.head_dist = Linear(d, cfg.num_classes, **factory) if cfg.head_dist else None
        self.proj = Linear(d, cfg.proj_dim, bias=cfg.embed_proj_bias, **factory) if cfg.proj_dim else None
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
        """Resamples again, in place, the kept position tables of other grids that pos_embed changed since (and
        the rotary tables that rope_freqs changed): a CUDA graph reads them where they were (CUDAGraphRunner calls
        this before each replay)."""
        if self.pos_embed is not None:
            self.pos_tables.refresh(self.pos_embed)
        if self.rope_tables is not None:
            self.rope_tables.refresh(self.rope_freqs)

    def _check_pixels(self, pixels: torch.Tensor) -> tuple[int, int]:
        """The patch grid of `pixels`, after checking them."""
        if not isinstance(pixels, torch.Tensor):
            raise TypeError(f"pixels must be a torch.Tensor [B, C, H, W], got {type(pixels).__name__}; for images, "
                            f"vit_triton.Preprocess.for_model(model) makes the pixels")
        cfg = self.config
        expected = f"[B, {cfg.in_chans}, H, W]"
        if pixels.dim() != 4:
            raise ValueError(f"pixels must be 4-D {expected}, got shape {tuple(pixels.shape)}")
        if pixels.shape[1] != cfg.in_chans:
            raise ValueError(f"pixels must have {cfg.in_chans} channels {expected}, got shape {tuple(pixels.shape)}")
        grid = self.grid(pixels.shape[2], pixels.shape[3])
        if self.rel_pos_index is not None and grid != cfg.grid:
            raise ValueError(f"the relative position bias is learned for {cfg.grid[0]} x {cfg.grid[1]} patches of "
                             f"{cfg.patch_size} ({cfg.image_size} x {cfg.image_size} images): pixels must make that "
                             f"grid, got {pixels.shape[2]}x{pixels.shape[3]} ({grid[0]} x {grid[1]} patches)")
        dtype = self.patch_embed.weight.dtype
        if pixels.dtype not in (torch.float32, dtype):
            raise ValueError(f"pixels must be float32 or {dtype} (the model's dtype), got {pixels.dtype}")
        device = self.patch_embed.weight.device
        if pixels.device != device:
            raise ValueError(f"pixels must be on the model's device {device}, got {pixels.device}")
        return grid

    def forward_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """Tokens [B, T, D] after the blocks and the final norm (HF last_hidden_state), for pixels [B, C, H, W] of
        any H and W of at least the patch size (with a relative position bias, of the checkpoint's patch grid)."""
        grid = self._check_pixels(pixels)
        cfg = self.config
        if pixels.shape[0] == 0:   # no image: no kernel has a program to run
            return self.patch_embed.weight.new_empty(0, cfg.num_prefix_tokens + grid[0] * grid[1], cfg.embed_dim)
        pe = self.patch_embed
        if self.sincos_tables is not None:
            pos = self.sincos_tables(grid, pixels.device, pe.weight.dtype)
        else:
            pos = None if self.pos_embed is None else self.pos_tables(self.pos_embed, grid)
        # With embed_norm the table is added after the norm of the patch embeddings, by the norm's kernel.
        tokens = patch_embed(pixels, pe.weight, pe.bias, pos if self.embed_norm is None else None, self.prefix_tokens)
        batch, num_tokens, d = tokens.shape
        x = tokens.view(batch * num_tokens, d)
        if self.embed_norm is not None:
            x = self.embed_norm(x, post_add=pos)
        if self.training and cfg.pos_drop_rate:
            x = F.dropout(x, cfg.pos_drop_rate)
        if self.norm_pre is not None:
            x = self.norm_pre(x)
        x = ResidualStream(x, batch)
        ropes = [None] * cfg.depth
        if self.rope_tables is not None:
            cos, sin = self.rope_tables(grid, pixels.device, self.rope_freqs)
            # RoPE-mixed: a [H, T, Dh] table per block, the others one [T, Dh] table for all
            ropes = list(zip(cos, sin)) if self.rope_freqs is not None else [(cos, sin)] * cfg.depth
        # Checkpointing only where autograd records the blocks (a frozen backbone runs as at inference).
        checkpointed = self.grad_checkpointing and torch.is_grad_enabled() and (
            x.tensor().requires_grad or any(p.requires_grad for p in self.blocks.parameters()))
        shared = (None if self.rel_pos_table is None
                  else relative_position_bias(self.rel_pos_table, self.rel_pos_index))
        for block, rope in zip(self.blocks, ropes):
            # a block's own bias gathered as it runs: one [H, T, T] bias at a time at inference
            rel_pos_bias = (shared if block.rel_pos_table is None
                            else relative_position_bias(block.rel_pos_table, self.rel_pos_index))
            if checkpointed:   # the block's activations recomputed in the backward (drop path's masks too)
                x = ResidualStream(checkpoint(
                    lambda t, r, b, block=block: block(ResidualStream(t, batch), r, b).tensor(),
                    x.tensor(), rope, rel_pos_bias, use_reentrant=False), batch)
            else:
                x = block(x, rope, rel_pos_bias)
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
        if self.training and self.config.drop_rate:
            pooled = F.dropout(pooled, self.config.drop_rate)
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

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Activation checkpointing (timm's name): in training each block keeps only its input, and its forward
        runs again in the backward (drop path draws the same masks): less memory for about a third more time."""
        self.grad_checkpointing = enable

    def reset_classifier(self, num_classes: int) -> None:
        """A new classifier of num_classes (timm's name; 0: none), on the pooled features: weights truncated-normal
        (std 0.02) and zero bias, as timm initialises a ViT's head. A projection (CLIP's) or a distillation head
        (DeiT's) is replaced by it; config records the change."""
        factory = {"device": self.patch_embed.weight.device, "dtype": self.patch_embed.weight.dtype}
        self.config = dataclasses.replace(self.config, num_classes=num_classes, proj_dim=0, embed_proj_bias=False,
                                          head_dist=False)
        self.head = Linear(self.config.embed_dim, num_classes, **factory) if num_classes else None
        self.head_dist = self.proj = None

    def group_matcher(self, coarse: bool = False) -> dict:
        """Parameter groups by layer, as timm's VisionTransformer gives them: the stem, then each block, the final
        norm last (the head and pooling after it), for layer-wise learning-rate decay
        (timm.optim.param_groups_layer_decay)."""
        return dict(stem=r"^prefix_tokens|pos_embed|patch_embed|rope_freqs|embed_norm|norm_pre|^rel_pos_table",
                    blocks=[(r"^blocks\.(\d+)", None), (r"^norm", (99999,))])

    def no_weight_decay(self) -> set[str]:
        """The matrices exempt from weight decay (timm's; 1-D parameters are exempt anyway): the position and prefix
        tokens' tables, RoPE-mixed's frequencies, every relative position bias table (timm's Beit exempts them)."""
        tables = {name for name, _ in self.named_parameters() if name.endswith("rel_pos_table")}
        return {"pos_embed", "prefix_tokens", "rope_freqs"} | tables
