"""timm VisionTransformer (and DeiT's VisionTransformerDistilled; AIMv2's, with RmsNorm, SwiGLU and a norm in the
patch embedding), Eva (EVA02, the RoPE ViTs, DINOv3) and Beit (BEiT, BEiT v2) -> vit-triton.

timm's names are ours but for the nesting (attn.qkv -> qkv, mlp.fc1 -> fc1, patch_embed.proj ->
patch_embed, patch_embed.norm -> embed_norm), the prefix tokens (cls_token, dist_token and reg_token become the
rows of prefix_tokens) and
the leading batch dimension of pos_embed. LayerScale (ls1.gamma, ls2.gamma: DeiT III, DINOv2; Eva's gamma_1, gamma_2)
becomes the blocks' ls1 and ls2. Eva's separate q, k, v projections (or q_bias and v_bias beside a bias-free qkv)
join into one qkv with k's bias zero; a gated MLP's two halves (GluMlp's packed fc1, gate first, or SwiGLU's fc1_g
and fc1_x) become one fc1 with its gate and value rows interleaved; the rotary embedding's settings become the
config's rope fields, and RoPE-mixed's learned frequencies rope_freqs. Beit's relative position bias tables (every
block's attn.relative_position_bias_table, or the shared rel_pos_bias') become rel_pos_table; their index buffers,
which older checkpoints hold, are not read.

vit_to_timm is the way back: our config and state dict as a timm architecture's model_args and state dict, named
by the same rules after the keys of the model timm builds (on the meta device).
"""

from __future__ import annotations

import torch
from torch import nn

from ..model import ViT, ViTConfig
from .common import Mapped, Unmapped, build, check_written, mlp_ratio, refuse

_RULES = [
    (r"patch_embed\.proj\.(weight|bias)", r"patch_embed.\1"),
    (r"patch_embed\.norm\.(weight|bias)", r"embed_norm.\1"),
    (r"(cls_token|dist_token|reg_token|pos_embed)", r"\1"),
    (r"blocks\.(\d+)\.attn\.(qkv|proj)\.(weight|bias)", r"blocks.\1.\2.\3"),
    (r"blocks\.(\d+)\.mlp\.(fc1|fc2)\.(weight|bias)", r"blocks.\1.\2.\3"),
    (r"blocks\.(\d+)\.(ls[12])\.gamma", r"blocks.\1.\2"),
    (r"blocks\.(\d+)\.gamma_([12])", r"blocks.\1.ls\2"),
    (r"blocks\.(\d+)\.attn\.([qv])_bias", r"blocks.\1.\2.bias"),
    (r"blocks\.(\d+)\.attn\.([qkv])_proj\.(weight|bias)", r"blocks.\1.\2.\3"),
    (r"blocks\.(\d+)\.mlp\.fc1_g\.(weight|bias)", r"blocks.\1.gate.\2"),
    (r"blocks\.(\d+)\.mlp\.fc1_x\.(weight|bias)", r"blocks.\1.value.\2"),
    (r"blocks\.(\d+)\.mlp\.norm\.(weight|bias)", r"blocks.\1.mlp_norm.\2"),
    (r"blocks\.(\d+)\.attn\.norm\.(weight|bias)", r"blocks.\1.attn_norm.\2"),
    (r"rope\.freqs", "rope_freqs"),
    (r"blocks\.(\d+)\.attn\.relative_position_bias_table", r"blocks.\1.rel_pos_table"),
    (r"rel_pos_bias\.relative_position_bias_table", "rel_pos_table"),
    (r"(blocks\.\d+\.norm[12]|norm_pre|norm|fc_norm|head|head_dist)\.(weight|bias)", r"\1.\2"),
    (r"attn_pool\.(latent|(?:q|kv|proj|norm|mlp\.fc1|mlp\.fc2)\.(?:weight|bias))", r"attn_pool.\1"),
]
# Computed from the grid, not read: Beit's index of the relative position bias tables (in older checkpoints).
_UNUSED = [(r"(?:blocks\.\d+\.attn\.|rel_pos_bias\.)relative_position_index", "")]
_POOLS = ("token", "avg", "map")
# timm's families refused for what the kernels do not compute, by the module that defines them.
_REFUSED = {"timm.models.vision_transformer_relpos": "an MLP (RelPosMlp) making the relative position bias from "
                                                     "log-spaced patch offsets",
            "timm.models.vision_transformer_sam": "windowed attention with relative position bias",
            "timm.models.vision_transformer_hybrid": "a hybrid convolutional stem (a CNN before the patch projection)"}


def timm_refusal(module_name: str) -> str:
    """Why the timm models defined in module `module_name` are refused, if the reason is known: " (..., which the
    kernels do not compute)", else ""."""
    reason = _REFUSED.get(module_name)
    return f" ({reason}, which the kernels do not compute)" if reason else ""


def timm_meta_model(architecture: str, **args) -> nn.Module:
    """timm's `architecture` made by create_model with `args` on the meta device (no memory, no init)."""
    try:
        import timm
    except ImportError:
        raise ImportError(f"{architecture} is a timm architecture, which timm builds: pip install timm") from None
    with torch.device("meta"):
        return timm.create_model(architecture, pretrained=False, **args)


def _activation(act: nn.Module) -> str:
    name = type(act).__name__
    if name == "GELU":
        return "gelu_tanh" if getattr(act, "approximate", "none") == "tanh" else "gelu"
    if name in ("GELUTanh", "QuickGELU"):
        return {"GELUTanh": "gelu_tanh", "QuickGELU": "quick_gelu"}[name]
    raise ValueError(f"unsupported timm activation {name}; supported: GELU, GELUTanh, QuickGELU")


def _attn_pool(module: nn.Module, act: str | None, qkv_bias: bool) -> tuple[dict, list[str]]:
    """The config's pool fields of a timm model's attention pool (AttentionPoolLatent, global_pool 'map': pool_heads
    and pool_mlp_dim where they are not the blocks', pool_query_proj), and what in it our AttentionPool does not
    compute: one learned query through a q projection or none, no qk_norm, no position embedding, the output of
    that query, an Mlp of the blocks' activation (act; None: unknown) after the blocks' LayerNorm, and biases where
    the blocks' qkv has them."""
    pool = getattr(module, "attn_pool", None)
    if pool is None:
        return {}, []
    block, mlp = module.blocks[0], getattr(pool, "mlp", None)
    blocks_mlp = block.mlp.fc2.in_features
    unusual = {
        "more than one latent query, or a latent_dim": tuple(pool.latent.shape) != (1, 1, module.embed_dim),
        "qk_norm": any(not isinstance(getattr(pool, n, nn.Identity()), nn.Identity) for n in ("q_norm", "k_norm")),
        "a position embedding": getattr(pool, "pos_embed", None) is not None,
        f"pool_type {getattr(pool, 'pool', 'token')!r}": getattr(pool, "pool", "token") != "token",
        "no output projection (out_features 0)": not isinstance(pool.proj, nn.Linear),
        f"MLP type {type(mlp).__name__} (supported: Mlp)": type(mlp).__name__ != "Mlp",
        "an MLP activation other than the blocks'": act is not None and type(mlp).__name__ == "Mlp"
        and _activation(mlp.act) != act,
        "a norm other than the blocks' LayerNorm": _norm_kind(pool.norm) != "layernorm"
        or _norm_kind(block.norm1) != "layernorm" or pool.norm.eps != block.norm1.eps,
        "q and kv biases unlike the blocks' qkv bias": (pool.kv.bias is not None) != qkv_bias,
    }
    found = [f"an attention pool (global_pool 'map') with {what}" for what, present in unusual.items() if present]
    pool_mlp = mlp.fc1.out_features if type(mlp).__name__ == "Mlp" else blocks_mlp
    return dict(pool_query_proj=isinstance(pool.q, nn.Linear),
                pool_heads=0 if pool.num_heads == block.attn.num_heads else pool.num_heads,
                pool_mlp_dim=0 if pool_mlp == blocks_mlp else pool_mlp), found


def _is_swiglu_packed(mlp: nn.Module) -> bool:
    """timm's SwiGLUPacked (DINOv2 ViT-g/14): a GluMlp with SiLU whose packed fc1 holds the gate first."""
    return type(mlp).__name__ == "GluMlp" and not mlp.gate_last and type(mlp.act).__name__ == "SiLU"


def _mlp_act(mlp: nn.Module, model: str) -> str:
    """The config's act of a timm MLP: "swiglu" for SwiGLUPacked and SwiGLU (whose gate must be SiLU), else the
    activation of an Mlp."""
    if type(mlp).__name__ == "SwiGLU" and type(mlp.act).__name__ != "SiLU":
        raise ValueError(f"unsupported timm {model} gated MLP activation {type(mlp.act).__name__} (supported: SiLU)")
    return "swiglu" if type(mlp).__name__ == "SwiGLU" or _is_swiglu_packed(mlp) else _activation(mlp.act)


def _norm_kind(m: nn.Module) -> str | None:
    """ViTConfig.norm of a timm norm layer: "layernorm", "rmsnorm", or None for another kind."""
    return "layernorm" if isinstance(m, nn.LayerNorm) else "rmsnorm" if type(m).__name__ == "RmsNorm" else None


def _is_norm(m: nn.Module) -> bool:
    return _norm_kind(m) is not None


def _scale_norms(block: nn.Module) -> list[nn.Module]:
    """A block's norm of the attention's output before its projection (timm's scale_attn_norm, Eva's
    scale_attn_inner) and of the MLP's hidden layer (scale_mlp_norm, scale_mlp), Identity where it has none."""
    return [getattr(block.attn, "norm", nn.Identity()), getattr(block.mlp, "norm", nn.Identity())]


def _scale_norm_fields(block: nn.Module) -> dict:
    """The config's attn_norm and mlp_norm of a block (_scale_norms)."""
    attn_norm, mlp_norm = (not isinstance(n, nn.Identity) for n in _scale_norms(block))
    return dict(attn_norm=attn_norm, mlp_norm=mlp_norm)


def _trunk_fields(module: nn.Module, act: str | None) -> dict:
    """The config fields that timm's VisionTransformer, Eva and Beit hold alike: the sizes, the norms' eps, the MLP's
    activation, the biases of the patch embedding and of the projections, the scale norms, the final norm, pooling
    and head; a position table resampled as timm's resample_abs_pos_embed (dynamic_img_size) does."""
    block, pe = module.blocks[0], module.patch_embed
    return dict(
        image_size=pe.img_size[0], patch_size=pe.patch_size[0], in_chans=pe.proj.in_channels,
        embed_dim=module.embed_dim, depth=len(module.blocks), num_heads=block.attn.num_heads,
        mlp_dim=block.mlp.fc2.in_features, norm_eps=block.norm1.eps, act=act, patch_bias=pe.proj.bias is not None,
        final_norm=_is_norm(module.norm) or _is_norm(module.fc_norm), fc_norm=_is_norm(module.fc_norm),
        pool=module.global_pool, num_classes=module.num_classes, pos_resample="bicubic_float32_antialias",
        proj_bias=block.attn.proj.bias is not None, mlp_bias=block.mlp.fc2.bias is not None,
        **_scale_norm_fields(block),
    )


def timm_config_to_vit(module: nn.Module) -> ViTConfig:
    """ViTConfig of a timm VisionTransformer, Eva or Beit; ValueError naming any feature we do not support."""
    if type(module).__name__ == "Eva":
        return _eva_config(module)
    if type(module).__name__ == "Beit":
        return _beit_config(module)
    if type(module).__name__ not in ("VisionTransformer", "VisionTransformerDistilled"):
        raise ValueError(f"from_timm takes a timm VisionTransformer, VisionTransformerDistilled, Eva or Beit, "
                         f"got {type(module).__name__}{timm_refusal(type(module).__module__)}")
    distilled = type(module).__name__ == "VisionTransformerDistilled"
    block = module.blocks[0]
    pe = module.patch_embed
    embed_norm = getattr(pe, "norm", nn.Identity())
    norms = [n for n in (block.norm1, block.norm2, module.norm_pre, module.norm, module.fc_norm, embed_norm,
                         *_scale_norms(block)) if not isinstance(n, nn.Identity)]
    other_norms = {type(n).__name__ for n in norms if not _is_norm(n)}
    kinds = {_norm_kind(n) for n in norms} - {None}
    mlp_ok = type(block.mlp).__name__ in ("Mlp", "SwiGLU") or _is_swiglu_packed(block.mlp)
    act = _mlp_act(block.mlp, "VisionTransformer") if mlp_ok else None
    pool, pool_problems = _attn_pool(module, act, block.attn.qkv.bias is not None)
    unsupported = {
        f"global_pool {module.global_pool!r} (supported: {', '.join(_POOLS)})": module.global_pool not in _POOLS,
        **dict.fromkeys(pool_problems, True),
        "qk_norm (a norm of each head's q and k)": not isinstance(getattr(block.attn, "q_norm", nn.Identity()),
                                                                 nn.Identity),
        f"block type {type(block).__name__} (supported: Block)": type(block).__name__ != "Block",
        f"MLP type {type(block.mlp).__name__} (supported: Mlp, SwiGLUPacked, SwiGLU)": not mlp_ok,
        f"norm layer {', '.join(sorted(other_norms))} (supported: LayerNorm, RmsNorm)": bool(other_norms),
        "LayerNorm and RmsNorm in one model": len(kinds) > 1,
        "no position embedding": module.pos_embed is None,
        "pool_include_prefix": getattr(module, "pool_include_prefix", False),
        f"patch embedding {type(pe).__name__} (supported: PatchEmbed; a hybrid convolutional stem is not computed)":
        type(pe).__name__ != "PatchEmbed",
        "a non-square img_size or patch_size (the checkpoint's own grid must be square; inputs of any size run)":
        pe.img_size[0] != pe.img_size[1] or pe.patch_size[0] != pe.patch_size[1],
    }
    refuse(unsupported, "timm VisionTransformer")
    return ViTConfig(
        **_trunk_fields(module, act), qkv_bias=block.attn.qkv.bias is not None,
        class_token=module.cls_token is not None, reg_tokens=module.num_reg_tokens,
        pos_embed_prefix=not module.no_embed_class, pre_norm=_is_norm(module.norm_pre),
        dist_token=distilled, head_dist=distilled and module.num_classes > 0,
        norm=kinds.pop() if kinds else "layernorm", embed_norm=_is_norm(embed_norm),
        layer_scale=not isinstance(block.ls1, nn.Identity), **pool,
    )


_ROPES = {"RotaryEmbeddingCat": "axial", "RotaryEmbeddingMixed": "mixed", "RotaryEmbeddingDinoV3": "centered"}


def _eva_rope(module: nn.Module) -> dict:
    """The config's rope fields from an Eva's rotary module; ValueError for settings we do not reproduce."""
    rope = module.rope
    if rope is None:
        return {}
    kind = _ROPES.get(type(rope).__name__)
    unsupported = {
        f"rope module {type(rope).__name__} (supported: {', '.join(_ROPES)})": kind is None,
        "rope in_pixels or a grid_type other than 'index'": kind == "axial" and (
            getattr(rope, "in_pixels", False) or getattr(rope, "grid_type", "index") != "index"),
        "DINOv3 rope with min/max periods or coordinates normalized other than 'separate'": kind == "centered" and (
            rope.min_period is not None or rope.max_period is not None or rope.normalize_coords != "separate"),
    }
    refuse(unsupported, "timm Eva")
    ref = getattr(rope, "ref_feat_shape", None)
    return dict(rope=kind, rope_theta=rope.temperature, rope_half=module.blocks[0].attn.rotate_half,
                rope_xy=rope.grid_indexing == "xy", rope_offset=getattr(rope, "grid_offset", 0.0),
                rope_ref_grid=tuple(ref) if ref is not None else None,
                rope_cpu=not module.dynamic_img_size and kind != "mixed")


def _key_biasless(attn: nn.Module) -> bool:
    """Whether an Eva attention has a query and a value bias but no key bias (q_bias and v_bias beside a bias-free
    qkv, or a bias-free k_proj), as EVA02 and DINOv3 do; the RoPE ViTs' fused qkv has all three."""
    k_proj = getattr(attn, "k_proj", None)
    return getattr(attn, "q_bias", None) is not None or (k_proj is not None and k_proj.bias is None
                                                         and attn.q_proj.bias is not None)


def _eva_config(module: nn.Module) -> ViTConfig:
    """ViTConfig of a timm Eva (EVA02, vit_*_rope_*, vit_*_dinov3); ValueError naming any feature we do not
    support."""
    block, pe = module.blocks[0], module.patch_embed
    attn, mlp = block.attn, block.mlp
    mlp_type = type(mlp).__name__
    norms = {type(n).__name__ for n in (block.norm1, block.norm2, module.norm_pre, module.norm, module.fc_norm,
                                         *_scale_norms(block)) if not isinstance(n, (nn.LayerNorm, nn.Identity))}
    qkv_bias = getattr(attn, "q_bias", None) is not None or (
        getattr(attn, "qkv", None) is not None and attn.qkv.bias is not None) or (
        getattr(attn, "q_proj", None) is not None and attn.q_proj.bias is not None)
    mlp_ok = mlp_type in ("Mlp", "SwiGLU") or _is_swiglu_packed(mlp)
    act = _mlp_act(mlp, "Eva") if mlp_ok else None
    pool, pool_problems = _attn_pool(module, act, qkv_bias)
    unsupported = {
        f"block type {type(block).__name__} (supported: EvaBlock; EvaBlockPostNorm's norms after each branch are "
        f"not ours)": type(block).__name__ != "EvaBlock",
        f"MLP type {mlp_type} (supported: Mlp, SwiGLUPacked, SwiGLU)": not mlp_ok,
        "grouped-query attention (num_kv_heads: fewer key and value heads than query heads, which the attention "
        "kernel does not read)": getattr(attn, "num_kv_heads", attn.num_heads) != attn.num_heads,
        "qk_norm (a norm of each head's q and k)": not isinstance(getattr(attn, "q_norm", nn.Identity()),
                                                                 nn.Identity),
        "gated attention (a sigmoid gate on the attention's output)": getattr(attn, "gate", None) is not None,
        "layer scale on attention only": (getattr(block, "gamma_1", None) is None) != (
            getattr(block, "gamma_2", None) is None),
        f"norm layer {', '.join(sorted(norms))} (supported: LayerNorm)": bool(norms),
        f"global_pool {module.global_pool!r} (supported: {', '.join(_POOLS)})": module.global_pool not in _POOLS,
        **dict.fromkeys(pool_problems, True),
        "a norm layer in the patch embedding": not isinstance(getattr(pe, "norm", nn.Identity()), nn.Identity),
        "a non-square img_size or patch_size (the checkpoint's own grid must be square; inputs of any size run)":
        pe.img_size[0] != pe.img_size[1] or pe.patch_size[0] != pe.patch_size[1],
    }
    refuse(unsupported, "timm Eva")
    return ViTConfig(
        **_trunk_fields(module, act), qkv_bias=qkv_bias, class_token=module.cls_token is not None,
        reg_tokens=0 if module.reg_token is None else module.reg_token.shape[1],
        pos_embed_prefix=not module.no_embed_class, pre_norm=_is_norm(module.norm_pre),
        abs_pos_embed=module.pos_embed is not None, layer_scale=getattr(block, "gamma_1", None) is not None,
        key_bias=not _key_biasless(attn), **pool, **_eva_rope(module),
    )


def _beit_config(module: nn.Module) -> ViTConfig:
    """ViTConfig of a timm Beit (beit_*, beitv2_*): q_bias and v_bias beside a bias-free qkv, LayerScale (gamma_1,
    gamma_2), a relative position bias table in every block (use_rel_pos_bias) or one for all
    (use_shared_rel_pos_bias), an absolute position embedding or none; ValueError naming any feature we do not
    support."""
    block, pe = module.blocks[0], module.patch_embed
    attn, mlp = block.attn, block.mlp
    tables = {"block": attn.relative_position_bias_table is not None, "shared": module.rel_pos_bias is not None}
    norms = {type(n).__name__ for n in (block.norm1, block.norm2, module.norm, module.fc_norm, *_scale_norms(block))
             if not isinstance(n, (nn.LayerNorm, nn.Identity))}
    mlp_ok = type(mlp).__name__ in ("Mlp", "SwiGLU")
    unsupported = {
        "a relative position bias table in every block and a shared one (use_rel_pos_bias and "
        "use_shared_rel_pos_bias)": all(tables.values()),
        f"global_pool {module.global_pool!r} (supported: token, avg)": module.global_pool not in ("token", "avg"),
        "attn_head_dim (heads not embed_dim / num_heads wide)": attn.qkv.out_features != 3 * module.embed_dim,
        f"MLP type {type(mlp).__name__} (supported: Mlp, SwiGLU)": not mlp_ok,
        f"norm layer {', '.join(sorted(norms))} (supported: LayerNorm)": bool(norms),
        "a non-square img_size or patch_size (the relative position bias' grid must be square)":
        pe.img_size[0] != pe.img_size[1] or pe.patch_size[0] != pe.patch_size[1],
    }
    refuse(unsupported, "timm Beit")
    return ViTConfig(
        **_trunk_fields(module, _mlp_act(mlp, "Beit")), qkv_bias=attn.q_bias is not None,
        abs_pos_embed=module.pos_embed is not None, layer_scale=block.gamma_1 is not None,
        key_bias=attn.q_bias is None, rel_pos_bias=next((kind for kind, present in tables.items() if present), "none"),
    )


def timm_state_dict_to_vit(state_dict: dict[str, torch.Tensor], cfg: ViTConfig) -> dict[str, torch.Tensor]:
    """Our state dict from a timm VisionTransformer, Eva or Beit one; raises listing every mismatch by the checkpoint's
    own key names."""
    mapped = Mapped(state_dict, _RULES, _UNUSED)
    mapped.concat("prefix_tokens", ["cls_token", "dist_token", "reg_token"])
    mapped.reshape("pos_embed", -1, cfg.embed_dim)
    d, t = cfg.embed_dim, mapped.tensors
    for i in range(cfg.depth):
        b = f"blocks.{i}."
        if b + "q.weight" in t:   # Eva's separate q, k, v projections
            mapped.concat(b + "qkv.weight", [b + n + ".weight" for n in "qkv"], shape=(d, d))
        if b + "q.bias" in t:   # k has no bias
            mapped.zeros_like(b + "k.bias", b + "q.bias")
            mapped.concat(b + "qkv.bias", [b + n + ".bias" for n in "qkv"], shape=(d,))
        if cfg.act == "swiglu":
            for name in ("weight", "bias"):
                # GluMlp packs gate then value into fc1; SwiGLU keeps them apart
                mapped.split(f"{b}fc1.{name}", [f"{b}gate.{name}", f"{b}value.{name}"], cfg.mlp_dim)
                mapped.interleave(f"{b}fc1.{name}", f"{b}gate.{name}", f"{b}value.{name}")
    mapped.reshape("attn_pool.latent", -1, cfg.embed_dim)
    return mapped.check(cfg, "timm VisionTransformer")


def from_timm(module: nn.Module) -> ViT:
    """vit-triton model with the weights, device and dtype of a timm VisionTransformer, Eva or Beit."""
    cfg = timm_config_to_vit(module)
    return build(cfg, timm_state_dict_to_vit(module.state_dict(), cfg), next(module.parameters()))


def timm_model_args(cfg: ViTConfig, architecture: str) -> tuple[dict, nn.Module]:
    """The create_model arguments that make timm's `architecture` a model of config cfg (the sizes, LayerScale, and
    each family's own choices: a VisionTransformer's tokens and norms, an Eva's scale norms and attention pool, a
    Beit's position embedding and bias tables; the rest is the architecture's), and that model, built on the meta
    device (no memory, no init); ValueError naming what the architecture would not hold."""
    try:
        import timm
    except ImportError:
        raise ImportError(f"writing a timm checkpoint ({architecture}) needs timm: pip install timm") from None
    if not timm.is_model(architecture):
        raise ValueError(f"unknown timm architecture {architecture!r}")
    args = dict(img_size=cfg.image_size, patch_size=cfg.patch_size, in_chans=cfg.in_chans, embed_dim=cfg.embed_dim,
                depth=cfg.depth, num_heads=cfg.num_heads, mlp_ratio=mlp_ratio(cfg.mlp_dim, cfg.embed_dim),
                num_classes=cfg.num_classes, global_pool=cfg.pool)
    if cfg.layer_scale:
        args["init_values"] = 1.0   # any: the gammas are the weights'
    if cfg.rope in ("axial", "centered") and not cfg.rope_cpu:   # tables computed on the device, as ours are
        args["dynamic_img_size"] = True
    family = timm.models.model_entrypoint(architecture).__module__
    if family == "timm.models.eva":
        args.update(scale_attn_inner=cfg.attn_norm, scale_mlp=cfg.mlp_norm)
        if cfg.pool == "map":
            args.update(attn_pool_num_heads=cfg.attn_pool_heads,
                        attn_pool_mlp_ratio=mlp_ratio(cfg.attn_pool_mlp_dim, cfg.embed_dim))
    elif family == "timm.models.beit":   # init_values None: no LayerScale, where the architectures have one
        args.update(qkv_bias=cfg.qkv_bias, init_values=args.get("init_values"), use_abs_pos_emb=cfg.abs_pos_embed,
                    use_rel_pos_bias=cfg.rel_pos_bias == "block", use_shared_rel_pos_bias=cfg.rel_pos_bias == "shared",
                    use_fc_norm=cfg.fc_norm, scale_mlp=cfg.mlp_norm, swiglu_mlp=cfg.act == "swiglu")
    else:
        args.update(qkv_bias=cfg.qkv_bias, class_token=cfg.class_token, reg_tokens=cfg.reg_tokens,
                    no_embed_class=not cfg.pos_embed_prefix, pre_norm=cfg.pre_norm, fc_norm=cfg.fc_norm)
        # each only where it differs from timm's default: older timm's VisionTransformer takes none of them
        args.update({name: value for name, value, default in (("final_norm", cfg.final_norm, True),
                                                              ("scale_attn_norm", cfg.attn_norm, False),
                                                              ("scale_mlp_norm", cfg.mlp_norm, False))
                     if value != default})
    module = timm_meta_model(architecture, **args)
    hidden = module.blocks[0].mlp.fc2.in_features if cfg.depth else cfg.mlp_dim
    if hidden != cfg.mlp_dim:   # GluMlp's mlp_ratio sizes its packed fc1: gate and value rows
        args["mlp_ratio"] = mlp_ratio(cfg.mlp_dim * cfg.mlp_dim // hidden, cfg.embed_dim)
        module = timm_meta_model(architecture, **args)
    check_written(cfg, timm_config_to_vit(module), f"timm {architecture}")
    return args, module


def vit_to_timm(state_dict: dict[str, torch.Tensor], cfg: ViTConfig,
                architecture: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(create_model arguments, state dict) of timm's `architecture` holding our model (timm_state_dict_to_vit's
    inverse): the prefix tokens as cls_token, dist_token and reg_token, q, k and v split where the architecture
    keeps them apart (Eva's q_proj, k_proj, v_proj; q_bias and v_bias), a gated MLP's gate and value rows apart
    (GluMlp's packed into fc1, gate first), every tensor in the shape of the model timm builds."""
    args, module = timm_model_args(cfg, architecture)
    expected = module.state_dict()
    t = Unmapped(state_dict)
    t.split("prefix_tokens", {name: n for name, n in (("cls_token", int(cfg.class_token)),
                                                       ("dist_token", int(cfg.dist_token)),
                                                       ("reg_token", cfg.reg_tokens)) if n})
    for i in range(cfg.depth):
        b = f"blocks.{i}."
        for name in ("weight", "bias"):
            if f"{b}attn.qkv.{name}" not in expected:
                t.split(f"{b}qkv.{name}", {f"{b}{n}.{name}": cfg.embed_dim for n in "qkv"})
            if cfg.act == "swiglu":
                t.deinterleave(f"{b}fc1.{name}", f"{b}gate.{name}", f"{b}value.{name}")
                if f"{b}mlp.fc1.{name}" in expected:
                    t.join(f"{b}fc1.{name}", [f"{b}gate.{name}", f"{b}value.{name}"])
    out = t.unmap(expected, _RULES, f"timm {architecture}", rotary=cfg.rope != "none")
    missing = [k for k in expected if k not in out]
    if missing:
        raise ValueError(f"cannot write the model as timm {architecture}, which needs {', '.join(missing)}")
    return args, {k: v.reshape(expected[k].shape) for k, v in out.items()}
