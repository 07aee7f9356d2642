"""timm VisionTransformer (and DeiT's VisionTransformerDistilled) -> vit-triton.

timm's names are ours but for the nesting (attn.qkv -> qkv, mlp.fc1 -> fc1, patch_embed.proj ->
patch_embed), the prefix tokens (cls_token, dist_token and reg_token become the rows of prefix_tokens) and
the leading batch dimension of pos_embed. LayerScale (ls1, ls2: DeiT III, DINOv2) is folded into the
layer before it.
"""

from __future__ import annotations

import torch
from torch import nn

from ..model import ViT, ViTConfig
from .common import Mapped, build

_RULES = [
    (r"patch_embed\.proj\.(weight|bias)", r"patch_embed.\1"),
    (r"(cls_token|dist_token|reg_token|pos_embed)", r"\1"),
    (r"blocks\.(\d+)\.attn\.(qkv|proj)\.(weight|bias)", r"blocks.\1.\2.\3"),
    (r"blocks\.(\d+)\.mlp\.(fc1|fc2)\.(weight|bias)", r"blocks.\1.\2.\3"),
    (r"blocks\.(\d+)\.(ls[12])\.gamma", r"blocks.\1.\2"),
    (r"(blocks\.\d+\.norm[12]|norm_pre|norm|fc_norm|head|head_dist)\.(weight|bias)", r"\1.\2"),
    (r"attn_pool\.(latent|(?:q|kv|proj|norm|mlp\.fc1|mlp\.fc2)\.(?:weight|bias))", r"attn_pool.\1"),
]
_POOLS = ("token", "avg", "map")


def _activation(act: nn.Module) -> str:
    name = type(act).__name__
    if name == "GELU":
        return "gelu_tanh" if getattr(act, "approximate", "none") == "tanh" else "gelu"
    if name in ("GELUTanh", "QuickGELU"):
        return {"GELUTanh": "gelu_tanh", "QuickGELU": "quick_gelu"}[name]
    raise ValueError(f"unsupported timm activation {name}; supported: GELU, GELUTanh, QuickGELU")


def _unusual_pool(pool: nn.Module | None) -> bool:
    """An AttentionPoolLatent that our AttentionPool does not compute: it takes one learned query through a q
    projection, no qk_norm, no position embedding, and the output of that query."""
    if pool is None:
        return False
    q = getattr(pool, "q", None)
    return (not isinstance(q, nn.Linear) or tuple(pool.latent.shape) != (1, 1, q.in_features)
            or any(not isinstance(getattr(pool, n, nn.Identity()), nn.Identity) for n in ("q_norm", "k_norm"))
            or getattr(pool, "pos_embed", None) is not None or type(pool.mlp).__name__ != "Mlp"
            or getattr(pool, "pool", "token") != "token")


def _is_layer_norm(m: nn.Module) -> bool:
    return isinstance(m, nn.LayerNorm)


def timm_config_to_vit(module: nn.Module) -> ViTConfig:
    """ViTConfig of a timm VisionTransformer; ValueError naming any feature we do not support."""
    if type(module).__name__ not in ("VisionTransformer", "VisionTransformerDistilled"):
        raise ValueError(f"from_timm takes a timm VisionTransformerDistilled or timm VisionTransformer, "
                         f"got {type(module).__name__}")
    distilled = type(module).__name__ == "VisionTransformerDistilled"
    block = module.blocks[0]
    pe = module.patch_embed
    other_norms = {type(n).__name__ for n in (block.norm1, block.norm2, module.norm_pre, module.norm, module.fc_norm)
                   if not isinstance(n, (nn.LayerNorm, nn.Identity))}
    unsupported = {
        f"global_pool {module.global_pool!r} (supported: {', '.join(_POOLS)})": module.global_pool not in _POOLS,
        "an attention pool other than one learned query (latent_len, qk_norm, pos_embed, pool_type)":
            _unusual_pool(getattr(module, "attn_pool", None)),
        "qk_norm": not isinstance(getattr(block.attn, "q_norm", nn.Identity()), nn.Identity),
        "attention or MLP scale norms": not isinstance(getattr(block.attn, "norm", nn.Identity()), nn.Identity)
        or not isinstance(getattr(block.mlp, "norm", nn.Identity()), nn.Identity),
        f"block type {type(block).__name__} (supported: Block)": type(block).__name__ != "Block",
        f"MLP type {type(block.mlp).__name__} (supported: Mlp)": type(block.mlp).__name__ != "Mlp",
        f"norm layer {', '.join(sorted(other_norms))} (supported: LayerNorm)": bool(other_norms),
        "proj_bias=False (projections without bias)": block.attn.proj.bias is None or block.mlp.fc2.bias is None,
        "no position embedding": module.pos_embed is None,
        "a norm layer in the patch embedding": not isinstance(getattr(pe, "norm", nn.Identity()), nn.Identity),
        "pool_include_prefix": getattr(module, "pool_include_prefix", False),
        "a non-square img_size or patch_size (the checkpoint's own grid must be square; inputs of any size run)":
        pe.img_size[0] != pe.img_size[1] or pe.patch_size[0] != pe.patch_size[1],
    }
    found = [what for what, present in unsupported.items() if present]
    if found:
        raise ValueError(f"unsupported timm VisionTransformer feature: {'; '.join(found)}")
    return ViTConfig(
        image_size=pe.img_size[0], patch_size=pe.patch_size[0], in_chans=pe.proj.in_channels,
        embed_dim=module.embed_dim, depth=len(module.blocks), num_heads=block.attn.num_heads,
        mlp_dim=block.mlp.fc1.out_features, qkv_bias=block.attn.qkv.bias is not None, norm_eps=block.norm1.eps,
        act=_activation(block.mlp.act), class_token=module.cls_token is not None,
        reg_tokens=module.num_reg_tokens, pos_embed_prefix=not module.no_embed_class,
        patch_bias=pe.proj.bias is not None, pre_norm=_is_layer_norm(module.norm_pre),
        final_norm=_is_layer_norm(module.norm) or _is_layer_norm(module.fc_norm),
        fc_norm=_is_layer_norm(module.fc_norm), pool=module.global_pool, num_classes=module.num_classes,
        dist_token=distilled, head_dist=distilled and module.num_classes > 0,
        pos_resample="bicubic_float32_antialias",   # resample_abs_pos_embed, as dynamic_img_size runs it
    )


def timm_state_dict_to_vit(state_dict: dict[str, torch.Tensor], cfg: ViTConfig) -> dict[str, torch.Tensor]:
    """Our state dict from a timm VisionTransformer one; raises listing every mismatch by the checkpoint's
    own key names."""
    mapped = Mapped(state_dict, _RULES)
    mapped.concat("prefix_tokens", ["cls_token", "dist_token", "reg_token"])
    mapped.reshape("pos_embed", -1, cfg.embed_dim)
    mapped.fold_layer_scale(cfg.depth)
    mapped.reshape("attn_pool.latent", -1, cfg.embed_dim)
    return mapped.check(cfg, "timm VisionTransformer")


def from_timm(module: nn.Module) -> ViT:
    """vit-triton model with the weights, device and dtype of a timm VisionTransformer."""
    cfg = timm_config_to_vit(module)
    return build(cfg, timm_state_dict_to_vit(module.state_dict(), cfg), next(module.parameters()))
