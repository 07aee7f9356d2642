"""OpenCLIP checkpoints (open_clip_config.json with open_clip_model.safetensors or open_clip_pytorch_model.bin)
-> vit-triton: the vision tower and its projection; the text tower is not read.

OpenCLIP's VisionTransformer keys: conv1 (no bias) -> patch_embed, class_embedding [D] and positional_embedding
[T, D] -> prefix_tokens and pos_embed, ln_pre -> norm_pre, transformer.resblocks.N.{ln_1, attn.in_proj (q, k
and v already one matrix), attn.out_proj, ln_2, mlp.c_fc, mlp.c_proj} -> blocks.N.{norm1, qkv, proj, norm2, fc1,
fc2}, LayerScale ls_1/ls_2 -> blocks.N.ls1/ls2, ln_post -> norm (fc_norm with
final_ln_after_pool), proj [D, E] (x @ proj) -> proj.weight [E, D].

A tower whose trunk is a timm model (vision_cfg's timm_model_name: EVA02-CLIP, PE-Core, SigLIP) is built as OpenCLIP's
TimmModel builds it, by timm on the meta device, and read as from_timm reads that model: visual.trunk.* are its keys;
the projection is the trunk's head (timm_proj null, with a bias), visual.head.proj (timm_proj "linear") or none
(timm_proj "none").

The way back is timm's layout (open_clip_to_timm): OpenCLIP has no classifier, and loads a tower only with its text
tower, which we do not read.
"""

from __future__ import annotations

import dataclasses

import torch

from ..model import ViTConfig
from .common import Mapped, square
from .timm import timm_config_to_vit, timm_meta_model, timm_state_dict_to_vit

# OpenCLIP's normalization where preprocess_cfg leaves it out (open_clip.constants), and its resize modes as timm's
# crop modes (the shorter side to the size then a center crop; both sides to the size).
OPENAI_MEAN, OPENAI_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
_CROP_MODES = {"shortest": "center", "squash": "squash"}

_BLOCK = r"visual\.transformer\.resblocks\.(\d+)\."
_RULES = [
    (r"visual\.conv1\.weight", "patch_embed.weight"),
    (r"visual\.class_embedding", "cls_token"),
    (r"visual\.positional_embedding", "pos_embed"),
    (r"visual\.ln_pre\.(weight|bias)", r"norm_pre.\1"),
    (_BLOCK + r"ln_1\.(weight|bias)", r"blocks.\1.norm1.\2"),
    (_BLOCK + r"attn\.in_proj_(weight|bias)", r"blocks.\1.qkv.\2"),
    (_BLOCK + r"attn\.out_proj\.(weight|bias)", r"blocks.\1.proj.\2"),
    (_BLOCK + r"ln_2\.(weight|bias)", r"blocks.\1.norm2.\2"),
    (_BLOCK + r"mlp\.c_fc\.(weight|bias)", r"blocks.\1.fc1.\2"),
    (_BLOCK + r"mlp\.c_proj\.(weight|bias)", r"blocks.\1.fc2.\2"),
    (_BLOCK + r"ls_([12])\.gamma", r"blocks.\1.ls\2"),
    (r"visual\.ln_post\.(weight|bias)", r"norm.\1"),
    (r"visual\.proj", "proj.weight"),
]
_UNUSED = [(r"(?!visual\.).*", "")]   # the text tower, logit_scale and logit_bias
_POOLS = {"tok": "token", "avg": "avg"}
# CheckpointInfo.architecture of OpenCLIP's own tower (a timm trunk's is its timm architecture).
OPEN_CLIP_TOWER = "VisionTransformer"
# vision_cfg entries whose non-default values change the tower into something we do not run
_UNSUPPORTED = {
    "timm_model_name": "a timm trunk (timm_model_name: open_clip_timm_tower reads it)",
    "attentional_pool": "attentional pooling",
    "qk_norm": "qk_norm", "scaled_cosine_attn": "scaled cosine attention", "scale_heads": "scale_heads",
    "scale_attn_inner": "scale_attn_inner", "scale_attn": "scale_attn", "scale_fc": "scale_fc",
    "act_kwargs": "act_kwargs",
}


def timm_trunk(config: dict) -> str | None:
    """The timm architecture of an OpenCLIP tower whose trunk is a timm model (open_clip_config.json as a dict), else
    None."""
    return (config.get("model_cfg", config).get("vision_cfg") or {}).get("timm_model_name")


def open_clip_config_to_vit(config: dict) -> ViTConfig:
    """ViTConfig of the vision tower of an OpenCLIP model (open_clip_config.json as a dict, its "model_cfg"
    holding embed_dim, vision_cfg and quick_gelu)."""
    model_cfg = config.get("model_cfg", config)
    vision = model_cfg.get("vision_cfg") or {}
    found = [what for key, what in _UNSUPPORTED.items() if vision.get(key)]
    if vision.get("block_type") not in (None, "default"):
        found.append(f"block_type {vision['block_type']!r}")
    if isinstance(vision.get("layers", 12), (list, tuple)):
        found.append("a ResNet tower (layers as a list)")
    pool = vision.get("pool_type", "tok")
    if pool not in _POOLS:
        found.append(f"pool_type {pool!r} (supported: {', '.join(_POOLS)})")
    if found:
        raise ValueError(f"unsupported OpenCLIP vision tower: {'; '.join(found)}")
    width = vision.get("width", 768)
    final_ln_after_pool = bool(vision.get("final_ln_after_pool"))
    return ViTConfig(
        image_size=square(vision.get("image_size", 224), "image_size"),
        patch_size=square(vision.get("patch_size", 16), "patch_size"), embed_dim=width, depth=vision.get("layers", 12),
        num_heads=width // vision.get("head_width", 64), mlp_dim=int(width * vision.get("mlp_ratio", 4.0)),
        norm_eps=(vision.get("norm_kwargs") or {}).get("eps", 1e-5),
        act="quick_gelu" if model_cfg.get("quick_gelu") else "gelu",
        patch_bias=False, pre_norm=not vision.get("no_ln_pre"), fc_norm=final_ln_after_pool,
        pool=_POOLS[pool], proj_dim=model_cfg.get("embed_dim", 512),
        layer_scale=vision.get("ls_init_value") is not None,
    )


def open_clip_state_dict_to_vit(state_dict: dict[str, torch.Tensor], cfg: ViTConfig) -> dict[str, torch.Tensor]:
    """Our state dict from an OpenCLIP one (the vision tower's keys); raises listing every mismatch by the
    checkpoint's own key names."""
    mapped = Mapped(state_dict, _RULES, _UNUSED)
    mapped.concat("prefix_tokens", ["cls_token"])
    mapped.transpose("proj.weight")
    if cfg.fc_norm:
        mapped.move("norm", "fc_norm")
    return mapped.check(cfg, "OpenCLIP")


def open_clip_timm_tower(config: dict,
                         state_dict: dict[str, torch.Tensor]) -> tuple[ViTConfig, dict[str, torch.Tensor]]:
    """(config, our state dict) of an OpenCLIP tower whose trunk is a timm model: the trunk as OpenCLIP's TimmModel
    makes it (create_model's num_classes and global_pool from timm_proj and timm_pool; the architecture's own sizes)
    read as from_timm reads it, then its projection: the trunk's head (timm_proj null), visual.head.proj ("linear")
    or none ("none"). ValueError for a projection or pool we do not compute, and for keys that do not fit."""
    model_cfg = config.get("model_cfg", config)
    vision, embed_dim = model_cfg["vision_cfg"], model_cfg.get("embed_dim", 512)
    name, pool, proj = vision["timm_model_name"], vision.get("timm_pool", "avg"), vision.get("timm_proj", "linear")
    if proj not in (None, "none", "linear") or pool in ("abs_attn", "rot_attn"):
        raise ValueError(f"unsupported OpenCLIP timm tower {name}: timm_pool {pool!r} and timm_proj {proj!r} "
                         f"(supported: the trunk's own pools, and timm_proj null, 'none' or 'linear')")
    if proj == "linear":   # the trunk without its head, pooling as timm_pool says (or as it does)
        trunk = timm_meta_model(name)
        trunk.reset_classifier(0, **({"global_pool": pool} if pool else {}))
    else:
        trunk = timm_meta_model(name, num_classes=0 if proj == "none" else embed_dim, global_pool=pool)
    cfg = timm_config_to_vit(trunk)
    ours = timm_state_dict_to_vit({k.removeprefix("visual.trunk."): v for k, v in state_dict.items()
                                   if k.startswith("visual.trunk.")}, cfg)
    head = {"weight": ours.pop("head.weight", None), "bias": ours.pop("head.bias", None)} if proj is None else \
        {"weight": state_dict.get("visual.head.proj.weight"), "bias": state_dict.get("visual.head.proj.bias")}
    kept = ("visual.trunk.", "visual.head.proj.") if proj == "linear" else ("visual.trunk.",)
    problems = [f"unexpected: {k}" for k in state_dict if k.startswith("visual.") and not k.startswith(kept)]
    if proj == "linear" and head["weight"] is None:
        problems.append("missing: visual.head.proj.weight")
    if problems:
        raise ValueError(f"OpenCLIP {name} checkpoint does not fit its timm_proj {proj!r}:\n  " + "\n  ".join(problems))
    if proj != "none":
        cfg = dataclasses.replace(cfg, num_classes=0, proj_dim=embed_dim, embed_proj_bias=head["bias"] is not None)
        ours.update({f"proj.{k}": v for k, v in head.items() if v is not None})
    return cfg, ours


def open_clip_to_timm(state_dict: dict[str, torch.Tensor], cfg: ViTConfig, preprocess_cfg: dict,
                      architecture: str) -> tuple[str, ViTConfig, dict[str, torch.Tensor], dict]:
    """An OpenCLIP tower (CheckpointInfo.architecture `architecture`) as a timm model, the layout save_pretrained
    writes it in (OpenCLIP loads only both towers): (timm architecture, the config that layout holds, our state dict
    for it, timm's pretrained_cfg). OpenCLIP's own tower is written as vit_base_patch16_clip_224 or its quickgelu
    variant, whose model_args give the sizes, a timm trunk as its architecture; the projection becomes timm's head
    (with a zero bias where it has none), as timm converts OpenCLIP's towers, so the model reads back as a classifier
    whose logits are the image embedding."""
    if architecture == OPEN_CLIP_TOWER:
        architecture = f"vit_base_patch16_clip_{'quickgelu_' if cfg.act == 'quick_gelu' else ''}224"
    if cfg.proj_dim:
        state_dict = dict(state_dict)
        state_dict["head.weight"] = state_dict.pop("proj.weight")
        state_dict["head.bias"] = state_dict.pop("proj.bias", state_dict["head.weight"].new_zeros(cfg.proj_dim))
        cfg = dataclasses.replace(cfg, num_classes=cfg.proj_dim, proj_dim=0, embed_proj_bias=False)
    mode = preprocess_cfg.get("resize_mode") or "shortest"
    if mode not in _CROP_MODES:
        raise ValueError(f"unsupported OpenCLIP resize_mode {mode!r}; supported: {', '.join(_CROP_MODES)}")
    pretrained_cfg = dict(input_size=[cfg.in_chans, cfg.image_size, cfg.image_size], crop_pct=1.0,
                          crop_mode=_CROP_MODES[mode], interpolation=preprocess_cfg.get("interpolation") or "bicubic",
                          mean=list(preprocess_cfg.get("mean") or OPENAI_MEAN),
                          std=list(preprocess_cfg.get("std") or OPENAI_STD))
    return architecture, cfg, state_dict, pretrained_cfg
