"""HuggingFace transformers vision encoders -> vit-triton: ViT, DeiT, DINOv2 (with registers), DINOv3, CLIP's
vision tower (with its projection), SigLIP's (with its attention-pool head), ViT-MAE's encoder, AIMv2's vision
tower (with its attention-pool head and, in an Aimv2Model, its projection).

Keys come in the hub's spellings (transformers 4: encoder.layer.N.attention.attention.query,
intermediate.dense, output.dense, ...; CLIP's encoder.layers.N.self_attn.q_proj, layer_norm1, ...) and in
transformers 5's (layers.N.attention.q_proj, mlp.fc1, ...). All map here. q, k and v are concatenated into one
QKV weight (a bias left out, as DINOv3's key bias, is zero); DINOv2's and DINOv3's LayerScale is folded into the
layer before it; a gated MLP (DINOv3's gate_proj and up_proj, DINOv2 ViT-g's packed weights_in) becomes one fc1
with gate and value rows interleaved; SigLIP's head (probe, attention.in_proj,
out_proj, layernorm, mlp) becomes attn_pool (latent, q and kv, proj, norm, mlp); AIMv2's (cls_token, k_proj and
v_proj, output_proj) attn_pool's latent, kv and proj, and its embeddings' rms_norm embed_norm. Not part of our forward:
ViTModel's pooler (dense + tanh over the class token), mask tokens, the text tower of a CLIPModel or SiglipModel
checkpoint and ViT-MAE's decoder. DeiT is ViT with a distillation token after the class token, and with a
teacher, a second classifier on it (cls_classifier -> head, distillation_classifier -> head_dist).
"""

from __future__ import annotations

import torch

from ..model import ViT, ViTConfig
from .common import Mapped, build, square

_ACTIVATIONS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                "quick_gelu": "quick_gelu"}

# architecture -> model_type of the config that describes its vision encoder
ARCHITECTURES = {
    "ViTModel": "vit", "ViTForImageClassification": "vit",
    "DeiTModel": "deit", "DeiTForImageClassification": "deit", "DeiTForImageClassificationWithTeacher": "deit",
    "Dinov2Model": "dinov2", "Dinov2WithRegistersModel": "dinov2_with_registers", "DINOv3ViTModel": "dinov3_vit",
    "CLIPVisionModel": "clip_vision_model", "CLIPVisionModelWithProjection": "clip_vision_model",
    "CLIPModel": "clip",
    "SiglipVisionModel": "siglip_vision_model", "SiglipModel": "siglip",
    "ViTMAEModel": "vit_mae", "ViTMAEForPreTraining": "vit_mae",
    "Aimv2VisionModel": "aimv2_vision_model", "Aimv2Model": "aimv2",
}
# Models of two towers, whose config.json describes the vision encoder in its vision_config.
_TWO_TOWERS = ("clip", "siglip", "aimv2")
HF_ARCHITECTURES = tuple(ARCHITECTURES)
# How each resamples its position embedding for another input size (interpolate_pos_encoding); the rest: bicubic
# in the table's dtype.
_POS_RESAMPLES = {"dinov2": "bicubic_float32", "dinov2_with_registers": "bicubic_float32_antialias"}
# What each returns as the image embedding (ViT.embedding): CLIP's projected class token where it has one.
_PROJECTED = ("CLIPVisionModelWithProjection", "CLIPModel", "Aimv2Model")

_LAYER = r"(?:encoder\.layers?|layers|(?:model\.)?layer)\.(\d+)\."
_ATTENTION = r"(?:attention\.(?:attention\.)?|self_attn\.)"
# ViTForImageClassification nests the model under "vit." (DeiT: "deit."), CLIP under "vision_model."
_RULES = [(r"(?:vit\.|deit\.|dinov2\.|vision_model\.)?" + pattern, repl) for pattern, repl in [
    (r"embeddings\.(?:cls_token|class_embedding)", "cls_token"),
    (r"embeddings\.distillation_token", "distillation_token"),
    (r"embeddings\.register_tokens", "reg_token"),
    (r"embeddings\.(?:position_embeddings|position_embedding\.weight)", "pos_embed"),
    (r"embeddings\.(?:patch_embeddings\.projection|patch_embeddings?|patch_embed)\.(weight|bias)", r"patch_embed.\1"),
    (r"embeddings\.rms_norm\.weight", "embed_norm.weight"),
    (r"pre_layrnorm\.(weight|bias)", r"norm_pre.\1"),
    (_LAYER + _ATTENTION + r"(?:query|q_proj)\.(weight|bias)", r"blocks.\1.q.\2"),
    (_LAYER + _ATTENTION + r"(?:key|k_proj)\.(weight|bias)", r"blocks.\1.k.\2"),
    (_LAYER + _ATTENTION + r"(?:value|v_proj)\.(weight|bias)", r"blocks.\1.v.\2"),
    (_LAYER + r"(?:attention\.output\.dense|attention\.o_proj|attention\.out_proj|self_attn\.out_proj)\.(weight|bias)",
     r"blocks.\1.proj.\2"),
    (_LAYER + r"(?:layernorm_before|norm1|layer_norm1|rms_norm1)\.(weight|bias)", r"blocks.\1.norm1.\2"),
    (_LAYER + r"(?:layernorm_after|norm2|layer_norm2|rms_norm2)\.(weight|bias)", r"blocks.\1.norm2.\2"),
    (_LAYER + r"(?:intermediate\.dense|mlp\.fc1|mlp\.weights_in)\.(weight|bias)", r"blocks.\1.fc1.\2"),
    (_LAYER + r"(?:output\.dense|(?:mlp|ffn)\.fc2|(?:mlp|ffn)\.down_proj|mlp\.weights_out)\.(weight|bias)",
     r"blocks.\1.fc2.\2"),
    (_LAYER + r"(?:mlp|ffn)\.gate_proj\.(weight|bias)", r"blocks.\1.gate.\2"),
    (_LAYER + r"(?:mlp|ffn)\.up_proj\.(weight|bias)", r"blocks.\1.up.\2"),
    (_LAYER + r"layer_scale([12])\.lambda1", r"blocks.\1.ls\2"),
    (r"(?:layernorm|post_layernorm|norm|rms_norm)\.(weight|bias)", r"norm.\1"),
    (r"head\.(?:probe|cls_token)", "attn_pool.latent"),
    (r"head\.([kv])_proj\.(weight|bias)", r"attn_pool.\1.\2"),
    (r"head\.output_proj\.(weight|bias)", r"attn_pool.proj.\1"),
    (r"head\.attention\.in_proj_(weight|bias)", r"attn_pool.in_proj.\1"),
    (r"head\.attention\.out_proj\.(weight|bias)", r"attn_pool.proj.\1"),
    (r"head\.layernorm\.(weight|bias)", r"attn_pool.norm.\1"),
    (r"head\.mlp\.(fc1|fc2)\.(weight|bias)", r"attn_pool.mlp.\1.\2"),
]] + [(r"(?:cls_)?classifier\.(weight|bias)", r"head.\1"),
       (r"distillation_classifier\.(weight|bias)", r"head_dist.\1"),
       (r"visual_projection\.weight", "proj.weight")]
# Not in our forward: the pooler, mask tokens, position ids, a CLIP checkpoint's text tower, MAE's decoder.
_UNUSED = [(r"(?:vit\.|deit\.|dinov2\.|vision_model\.)?(?:pooler\.dense\.(?:weight|bias)|embeddings\.mask_token"
            r"|embeddings\.position_ids)", ""),
           (r"(?:(?:text_model\.|decoder\.).*|text_projection\.weight|logit_scale|logit_bias)", "")]


def vision_config(config: dict) -> dict:
    """The vision encoder's part of a config.json: a CLIPModel's, SiglipModel's or Aimv2Model's vision_config (with
    the projection width), else the config itself."""
    model_type = config.get("model_type")
    if model_type in _TWO_TOWERS:
        vision = config["vision_config"]
        return {**vision, "model_type": f"{model_type}_vision_model",
                "projection_dim": config.get("projection_dim", vision.get("projection_dim"))}
    return config


def hf_config_to_vit(config: dict, num_classes: int = 0, head_dist: bool = False,
                     projection: bool = False) -> ViTConfig:
    """ViTConfig from a transformers config (config.json as a dict; a CLIPModel's is read through its
    vision_config); the head size, whether there is a distillation head (DeiTForImageClassificationWithTeacher)
    and whether the image embedding is projected (CLIP with projection) are separate."""
    config = vision_config(config)
    model_type = config.get("model_type")
    families = sorted(set(ARCHITECTURES.values()) - set(_TWO_TOWERS))
    if model_type not in families:
        raise ValueError(f"unsupported HuggingFace model_type {model_type!r}; supported: "
                         f"{', '.join(map(repr, families))}")
    if model_type == "dinov3_vit":
        return _dinov3_config(config)
    if model_type == "aimv2_vision_model":
        return _aimv2_config(config, projection)
    clip, dinov2, siglip = (model_type == "clip_vision_model", model_type.startswith("dinov2"),
                            model_type == "siglip_vision_model")
    act = config.get("hidden_act", "quick_gelu" if clip else "gelu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {act!r}; supported: {', '.join(_ACTIVATIONS)}")
    swiglu = dinov2 and config.get("use_swiglu_ffn", False)   # DINOv2 ViT-g/14: its width rounded as Dinov2SwiGLUFFN's
    mlp_dim = int(config["hidden_size"] * config.get("mlp_ratio", 4)) if dinov2 else config["intermediate_size"]
    if swiglu:
        mlp_dim = (int(mlp_dim * 2 / 3) + 7) // 8 * 8
    if siglip and config.get("vision_use_head") is False:
        raise ValueError("unsupported vision_use_head=False (SigLIP without its attention-pool head: no pooled "
                         "output)")
    d = config["hidden_size"]
    return ViTConfig(
        image_size=square(config["image_size"], "image_size"),
        patch_size=square(config["patch_size"], "patch_size"),
        in_chans=config.get("num_channels", 3), embed_dim=d, depth=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"],
        mlp_dim=mlp_dim, qkv_bias=config.get("qkv_bias", True),
        norm_eps=config.get("layer_norm_eps", 1e-5 if clip else 1e-6 if dinov2 or siglip else 1e-12),
        act="swiglu" if swiglu else _ACTIVATIONS[act], class_token=not siglip,
        reg_tokens=config.get("num_register_tokens", 0),
        pos_embed_prefix=not config.get("num_register_tokens"),   # see hf_state_dict_to_vit
        patch_bias=not clip, pre_norm=clip, fc_norm=clip,   # CLIP normalizes only the pooled class token
        pool="map" if siglip else "token",
        num_classes=num_classes, dist_token=model_type == "deit", head_dist=head_dist,
        proj_dim=config["projection_dim"] if projection else 0,
        pos_resample=_POS_RESAMPLES.get(model_type, "bicubic"),
    )


def _dinov3_config(config: dict) -> ViTConfig:
    """DINOv3ViTModel: no absolute position embedding but rotary tables (transformers' own, half pairs), the class
    token and registers unrotated, a bias-free key projection, LayerScale, and a gated MLP in the "plus" sizes;
    pooler_output is the class token after the final norm."""
    gated, act = config.get("use_gated_mlp", False), config.get("hidden_act", "gelu")
    if gated and act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r} for DINOv3's gated MLP; supported: silu")
    if not gated and act not in _ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {act!r}; supported: {', '.join(_ACTIVATIONS)}")
    return ViTConfig(
        image_size=square(config.get("image_size", 224), "image_size"),
        patch_size=square(config["patch_size"], "patch_size"), in_chans=config.get("num_channels", 3),
        embed_dim=config["hidden_size"], depth=config["num_hidden_layers"], num_heads=config["num_attention_heads"],
        mlp_dim=config["intermediate_size"],
        qkv_bias=any(config.get(k, True) for k in ("query_bias", "key_bias", "value_bias")),
        norm_eps=config.get("layer_norm_eps", 1e-5), act="swiglu" if gated else _ACTIVATIONS[act],
        reg_tokens=config.get("num_register_tokens", 0), abs_pos_embed=False,
        proj_bias=config.get("proj_bias", True), mlp_bias=config.get("mlp_bias", True),
        rope="centered_inv_freq", rope_theta=config.get("rope_theta", 100.0), rope_half=True,
    )


def _aimv2_config(config: dict, projection: bool) -> ViTConfig:
    """Aimv2VisionModel (transformers' defaults where config.json leaves them out): RMSNorm throughout, the patch
    embeddings normalised before the position table is added (learned; is_native: sin-cos, built for each grid), no
    class token, a gated MLP, and the attention's four projections with a bias only if qkv_bias. pooler_output is
    the head's (use_head): the learned query itself against k_proj and v_proj, then output_proj; without the head
    there is none, and we pool the mean of last_hidden_state, as timm's AIMv2 does. transformers runs its learned
    table at its own grid only; at another one we resample it as timm does the same checkpoints' table."""
    act, use_head = config.get("hidden_act", "silu"), config.get("use_head", True)
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r} for AIMv2's gated MLP; supported: silu")
    if projection and not use_head:
        raise ValueError("unsupported use_head=False in an Aimv2Model: its image embedding projects the output of "
                         "the attention-pool head")
    qkv_bias = config.get("qkv_bias", False)
    return ViTConfig(
        image_size=square(config.get("image_size", 224), "image_size"),
        patch_size=square(config.get("patch_size", 14), "patch_size"), in_chans=config.get("num_channels", 3),
        embed_dim=config["hidden_size"], depth=config["num_hidden_layers"], num_heads=config["num_attention_heads"],
        mlp_dim=config["intermediate_size"], qkv_bias=qkv_bias, norm_eps=config.get("rms_norm_eps", 1e-5),
        act="swiglu", class_token=False, norm="rmsnorm", proj_bias=qkv_bias, mlp_bias=config.get("mlp_bias", False),
        embed_norm=True, pos_sincos=config.get("is_native", False), pos_resample="bicubic_float32_antialias",
        proj_dim=config["projection_dim"] if projection else 0,
        **(dict(pool="map", pool_query_proj=False, pool_mlp=False) if use_head else dict(pool="avg")),
    )


def hf_num_classes(state_dict: dict[str, torch.Tensor]) -> int:
    """Rows of the classifier (ViTForImageClassification, DeiT's), 0 for a model without one."""
    head = state_dict.get("classifier.weight", state_dict.get("cls_classifier.weight"))
    return 0 if head is None else head.shape[0]


def biasless_projections(config: dict) -> str:
    """Which of q, k, v a transformers config makes without bias while the others have one (DINOv3's key)."""
    flags = {n: config.get(f"{name}_bias", True) for n, name in zip("qkv", ("query", "key", "value"))}
    return "".join(n for n, f in flags.items() if not f) if any(flags.values()) else ""


def hf_state_dict_to_vit(state_dict: dict[str, torch.Tensor], cfg: ViTConfig,
                         zero_biases: str = "") -> dict[str, torch.Tensor]:
    """Our state dict from a transformers one (any key spelling above); raises listing every mismatch by the
    checkpoint's own key names. zero_biases: which of q, k, v have no bias in the checkpoint (zeros join qkv's)."""
    mapped = Mapped(state_dict, _RULES, _UNUSED)
    d = cfg.embed_dim
    mapped.reshape("pos_embed", -1, d)
    if cfg.reg_tokens:   # DINOv2's registers have no position: the class token's row moves into the token
        mapped.add_first_row("cls_token", "pos_embed")
    mapped.concat("prefix_tokens", ["cls_token", "distillation_token", "reg_token"])
    with_bias = next((n for n in "qkv" if n not in zero_biases), None)   # the zeros' shape
    for i in range(cfg.depth):
        b = f"blocks.{i}."
        mapped.concat(b + "qkv.weight", [b + n + ".weight" for n in "qkv"], shape=(d, d))
        for n in zero_biases:   # projections the config makes without bias
            mapped.zeros_like(b + n + ".bias", b + with_bias + ".bias")
        mapped.concat(b + "qkv.bias", [b + n + ".bias" for n in "qkv"], shape=(d,))
        if cfg.act == "swiglu":   # DINOv3's gate_proj and up_proj, or DINOv2's weights_in (gate, then value)
            for name in ("weight", "bias"):
                mapped.split(f"{b}fc1.{name}", [f"{b}gate.{name}", f"{b}up.{name}"], cfg.mlp_dim)
                mapped.interleave(f"{b}fc1.{name}", f"{b}gate.{name}", f"{b}up.{name}")
        else:
            mapped.move(b + "up", b + "fc1")
    mapped.fold_layer_scale(cfg.depth)
    mapped.split("attn_pool.in_proj.weight", ["attn_pool.q.weight", "attn_pool.kv.weight"], d)
    mapped.split("attn_pool.in_proj.bias", ["attn_pool.q.bias", "attn_pool.kv.bias"], d)
    if cfg.pool == "map" and not cfg.pool_query_proj:   # AIMv2's head: k_proj and v_proj, no query projection
        mapped.concat("attn_pool.kv.weight", ["attn_pool.k.weight", "attn_pool.v.weight"], shape=(d, d))
        mapped.concat("attn_pool.kv.bias", ["attn_pool.k.bias", "attn_pool.v.bias"], shape=(d,))
    mapped.reshape("attn_pool.latent", -1, d)
    if cfg.fc_norm:   # CLIP's post_layernorm
        mapped.move("norm", "fc_norm")
    return mapped.check(cfg, "HuggingFace")


def hf_architecture_to_vit(architecture: str, config: dict, state_dict: dict[str, torch.Tensor],
                           num_classes: int = 0) -> tuple[ViTConfig, dict[str, torch.Tensor]]:
    """(ViTConfig, our state dict) of a transformers model of this architecture (one of HF_ARCHITECTURES)."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unsupported transformers architecture {architecture}; supported: "
                         f"{', '.join(HF_ARCHITECTURES)}")
    cfg = hf_config_to_vit(config, num_classes, head_dist=architecture.endswith("WithTeacher"),
                           projection=architecture in _PROJECTED)
    return cfg, hf_state_dict_to_vit(state_dict, cfg, biasless_projections(vision_config(config)))


def from_hf(module: torch.nn.Module) -> ViT:
    """vit-triton model with the weights, device and dtype of a transformers model (one of HF_ARCHITECTURES;
    a CLIPModel or Aimv2Model gives its vision tower and projection)."""
    name = type(module).__name__
    if name not in ARCHITECTURES:
        raise ValueError(f"from_hf takes a transformers {', '.join(HF_ARCHITECTURES)}, got {name}")
    state_dict = module.state_dict()
    cfg, ours = hf_architecture_to_vit(name, module.config.to_dict(), state_dict, hf_num_classes(state_dict))
    return build(cfg, ours, next(module.parameters()))
