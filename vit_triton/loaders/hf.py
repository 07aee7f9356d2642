"""HuggingFace transformers vision encoders -> vit-triton: ViT, DeiT, DINOv2 (with registers), DINOv3, CLIP's
vision tower (with its projection), SigLIP's (with its attention-pool head), ViT-MAE's encoder, AIMv2's vision
tower (with its attention-pool head and, in an Aimv2Model, its projection); the vision towers of vision-language
models, which have no pooling head: SigLIP's without it (vision_use_head=False: PaliGemma), Idefics3's and SmolVLM's
(at any size without their patch masks, each patch's position row picked as theirs are: pos_resample "bucket") and
InternVL's (LayerScale, LayerNorm or RMSNorm; not its QK-norm); BEiT's and data2vec-vision's (a relative position
bias table in every block or one shared, LayerScale, no key bias); and transformers' TimmWrapperModel, a timm model
inside, converted as from_timm converts it.

Keys come in the hub's spellings (transformers 4: encoder.layer.N.attention.attention.query,
intermediate.dense, output.dense, ...; CLIP's encoder.layers.N.self_attn.q_proj, layer_norm1, ...) and in
transformers 5's (layers.N.attention.q_proj, mlp.fc1, ...). All map here. q, k and v are concatenated into one
QKV weight (a bias left out, as DINOv3's key bias, is zero); DINOv2's and DINOv3's LayerScale stays the blocks' ls1
and ls2; a gated MLP (DINOv3's gate_proj and up_proj, DINOv2 ViT-g's packed weights_in) becomes one fc1
with gate and value rows interleaved; SigLIP's head (probe, attention.in_proj,
out_proj, layernorm, mlp) becomes attn_pool (latent, q and kv, proj, norm, mlp); AIMv2's (cls_token, k_proj and
v_proj, output_proj) attn_pool's latent, kv and proj, and its embeddings' rms_norm embed_norm; InternVL's
projection_layer proj and lambda_1, lambda_2 ls1, ls2 (BEiT's too); BEiT's relative_position_bias_table (a
block's, or the shared one) rel_pos_table, and its pooler's LayerNorm fc_norm. Not part of our forward:
ViTModel's pooler (dense + tanh over the class token), mask tokens, BEiT's relative position index (computed
from the grid), the text tower of a CLIPModel or SiglipModel
checkpoint and ViT-MAE's decoder. DeiT is ViT with a distillation token after the class token, and with a
teacher, a second classifier on it (cls_classifier -> head, distillation_classifier -> head_dist). DINOv2's
classifiers (Dinov2ForImageClassification) read the class token and the mean of the patch tokens: those whose mean
half is zero (what vit_to_hf_state_dict writes) load, as a classifier of the class token.

vit_to_hf_config and vit_to_hf_state_dict are the way back: our config and state dict as the transformers architecture
of the model's family (written_architecture), named by the same rules.
"""

from __future__ import annotations

import torch

from ..model import ViT, ViTConfig
from .common import Mapped, Unmapped, build, expand, mlp_ratio, refuse, square
from .timm import from_timm

_ACTIVATIONS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                "quick_gelu": "quick_gelu"}

# architecture -> model_type of the config that describes its vision encoder
ARCHITECTURES = {
    "ViTModel": "vit", "ViTForImageClassification": "vit",
    "DeiTModel": "deit", "DeiTForImageClassification": "deit", "DeiTForImageClassificationWithTeacher": "deit",
    "Dinov2Model": "dinov2", "Dinov2ForImageClassification": "dinov2",
    "Dinov2WithRegistersModel": "dinov2_with_registers",
    "Dinov2WithRegistersForImageClassification": "dinov2_with_registers", "DINOv3ViTModel": "dinov3_vit",
    "CLIPVisionModel": "clip_vision_model", "CLIPVisionModelWithProjection": "clip_vision_model",
    "CLIPModel": "clip",
    "SiglipVisionModel": "siglip_vision_model", "SiglipModel": "siglip",
    "ViTMAEModel": "vit_mae", "ViTMAEForPreTraining": "vit_mae",
    "Aimv2VisionModel": "aimv2_vision_model", "Aimv2Model": "aimv2",
    "Idefics3VisionTransformer": "idefics3_vision", "SmolVLMVisionTransformer": "smolvlm_vision",
    "InternVLVisionModel": "internvl_vision",
    "BeitModel": "beit", "BeitForImageClassification": "beit",
    "Data2VecVisionModel": "data2vec-vision", "Data2VecVisionForImageClassification": "data2vec-vision",
}
# transformers' wrappers of a timm model (model.timm_model), converted as from_timm converts it.
TIMM_WRAPPERS = ("TimmWrapperModel", "TimmWrapperForImageClassification")
# Encoders refused for what the attention kernel does not compute, by model_type.
_REFUSED = {"sam": "windowed attention with relative position bias",
            "sam_vision_model": "windowed attention with relative position bias"}
# Models of two towers, whose config.json describes the vision encoder in its vision_config.
_TWO_TOWERS = ("clip", "siglip", "aimv2")
HF_ARCHITECTURES = tuple(ARCHITECTURES)
# How each resamples its position embedding for another input size (interpolate_pos_encoding); the rest: bicubic
# in the table's dtype.
_POS_RESAMPLES = {"dinov2": "bicubic_float32", "dinov2_with_registers": "bicubic_float32_antialias",
                  "idefics3_vision": "bucket", "smolvlm_vision": "bucket"}
# SigLIP's vision tower and those made from it, without a class token (their default activation gelu_pytorch_tanh)
_SIGLIP_LIKE = ("siglip_vision_model", "idefics3_vision", "smolvlm_vision")
# What each returns as the image embedding (ViT.embedding): CLIP's projected class token where it has one.
_PROJECTED = ("CLIPVisionModelWithProjection", "CLIPModel", "Aimv2Model")
# BEiT and the encoder made from it: a relative position bias, q and v biases without k's, pooling by use_mean_pooling.
_BEIT_LIKE = ("beit", "data2vec-vision")
# Classifiers of [class token, mean of the patch tokens] (2 D columns).
_PATCH_MEAN_HEADS = ("Dinov2ForImageClassification", "Dinov2WithRegistersForImageClassification")

_LAYER = r"(?:encoder\.layers?|layers|(?:model\.)?layer)\.(\d+)\."
_ATTENTION = r"(?:attention\.(?:attention\.)?|self_attn\.)"
# ViTForImageClassification nests the model under "vit." (DeiT: "deit.", DINOv2: "dinov2.",
# "dinov2_with_registers.", BEiT: "beit.", data2vec-vision: "data2vec_vision."), CLIP under "vision_model."
_PREFIX = r"(?:vit\.|deit\.|dinov2\.|dinov2_with_registers\.|beit\.|data2vec_vision\.|vision_model\.)?"
_RULES = [(_PREFIX + pattern, repl) for pattern, repl in [
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
    (_LAYER + r"(?:attention\.output\.dense|attention\.o_proj|attention\.out_proj|self_attn\.out_proj"
     r"|attention\.projection_layer)\.(weight|bias)", r"blocks.\1.proj.\2"),
    (_LAYER + r"(?:layernorm_before|norm1|layer_norm1|rms_norm1)\.(weight|bias)", r"blocks.\1.norm1.\2"),
    (_LAYER + r"(?:layernorm_after|norm2|layer_norm2|rms_norm2)\.(weight|bias)", r"blocks.\1.norm2.\2"),
    (_LAYER + r"(?:intermediate\.dense|mlp\.fc1|mlp\.weights_in)\.(weight|bias)", r"blocks.\1.fc1.\2"),
    (_LAYER + r"(?:output\.dense|(?:mlp|ffn)\.fc2|(?:mlp|ffn)\.down_proj|mlp\.weights_out)\.(weight|bias)",
     r"blocks.\1.fc2.\2"),
    (_LAYER + r"(?:mlp|ffn)\.gate_proj\.(weight|bias)", r"blocks.\1.gate.\2"),
    (_LAYER + r"(?:mlp|ffn)\.up_proj\.(weight|bias)", r"blocks.\1.up.\2"),
    (_LAYER + r"layer_scale([12])\.lambda1", r"blocks.\1.ls\2"),
    (_LAYER + r"lambda_([12])", r"blocks.\1.ls\2"),
    (_LAYER + r"(?:attention\.attention\.)?relative_position_bias\.relative_position_bias_table",
     r"blocks.\1.rel_pos_table"),
    (r"(?:encoder\.relative_position_bias|shared_position_bias)\.relative_position_bias_table", "rel_pos_table"),
    (r"pooler\.layernorm\.(weight|bias)", r"fc_norm.\1"),
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
# Not in our forward: the pooler, mask tokens, position ids, BEiT's relative position index, a CLIP checkpoint's text
# tower, MAE's decoder.
_UNUSED = [(_PREFIX + r"(?:pooler\.dense\.(?:weight|bias)|embeddings\.mask_token"
            r"|embeddings\.position_ids|(?:.*\.)?relative_position_index)", ""),
           (r"(?:(?:text_model\.|decoder\.).*|text_projection\.weight|logit_scale|logit_bias)", "")]


def refusal(model_type: str | None) -> str:
    """Why a transformers model_type is refused, if the reason is known: " (its ..., which the attention kernel does
    not compute)", else ""."""
    reason = _REFUSED.get(model_type)
    return f" (its {reason}, which the attention kernel does not compute)" if reason else ""


def vision_config(config: dict) -> dict:
    """The vision encoder's part of a config.json: a CLIPModel's, SiglipModel's or Aimv2Model's vision_config (with
    the projection width), else the config itself."""
    model_type = config.get("model_type")
    if model_type in _TWO_TOWERS:
        vision = config["vision_config"]
        return {**vision, "model_type": f"{model_type}_vision_model",
                "projection_dim": config.get("projection_dim", vision.get("projection_dim"))}
    return config


def hf_config_to_vit(config: dict, num_classes: int = 0, head_dist: bool = False, projection: bool = False,
                     pooler_norm: bool = True) -> ViTConfig:
    """ViTConfig from a transformers config (config.json as a dict; a CLIPModel's is read through its
    vision_config); the head size, whether there is a distillation head (DeiTForImageClassificationWithTeacher),
    whether the image embedding is projected (CLIP with projection) and whether BEiT's pooler has its LayerNorm
    (Data2VecVisionModel's has none unless built with add_pooling_layer) are separate."""
    config = vision_config(config)
    model_type = config.get("model_type")
    families = sorted(set(ARCHITECTURES.values()) - set(_TWO_TOWERS))
    if model_type not in families:
        raise ValueError(f"unsupported HuggingFace model_type {model_type!r}{refusal(model_type)}; supported: "
                         f"{', '.join(map(repr, families))}")
    if model_type == "dinov3_vit":
        return _dinov3_config(config)
    if model_type == "aimv2_vision_model":
        return _aimv2_config(config, projection)
    if model_type == "internvl_vision":
        return _internvl_config(config, num_classes)
    if model_type in _BEIT_LIKE:
        return _beit_config(config, num_classes, pooler_norm)
    clip, dinov2, siglip = (model_type == "clip_vision_model", model_type.startswith("dinov2"),
                            model_type in _SIGLIP_LIKE)
    act = config.get("hidden_act", "quick_gelu" if clip else "gelu_pytorch_tanh" if siglip else "gelu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {act!r}; supported: {', '.join(_ACTIVATIONS)}")
    swiglu = dinov2 and config.get("use_swiglu_ffn", False)   # DINOv2 ViT-g/14: its width rounded as Dinov2SwiGLUFFN's
    mlp_dim = int(config["hidden_size"] * config.get("mlp_ratio", 4)) if dinov2 else config["intermediate_size"]
    if swiglu:
        mlp_dim = (int(mlp_dim * 2 / 3) + 7) // 8 * 8
    # SigLIP's attention-pool head; without it (PaliGemma's tower, Idefics3's, SmolVLM's) the mean of the tokens
    head = model_type == "siglip_vision_model" and config.get("vision_use_head", True)
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
        pool="map" if head else "avg" if siglip else "token",
        num_classes=num_classes, dist_token=model_type == "deit", head_dist=head_dist,
        proj_dim=config["projection_dim"] if projection else 0,
        pos_resample=_POS_RESAMPLES.get(model_type, "bicubic"), layer_scale=dinov2,
    )


def _sizes(config: dict, image_size: int, patch_size: int) -> dict:
    """The config's size fields from a transformers vision config, with the family's image_size and patch_size where
    config.json leaves them out."""
    return dict(image_size=square(config.get("image_size", image_size), "image_size"),
                patch_size=square(config.get("patch_size", patch_size), "patch_size"),
                in_chans=config.get("num_channels", 3), embed_dim=config["hidden_size"],
                depth=config["num_hidden_layers"], num_heads=config["num_attention_heads"],
                mlp_dim=config["intermediate_size"])


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
        **_sizes(config, 224, 16), qkv_bias=any(config.get(k, True) for k in ("query_bias", "key_bias", "value_bias")),
        norm_eps=config.get("layer_norm_eps", 1e-5), act="swiglu" if gated else _ACTIVATIONS[act],
        reg_tokens=config.get("num_register_tokens", 0), abs_pos_embed=False,
        proj_bias=config.get("proj_bias", True), mlp_bias=config.get("mlp_bias", True),
        rope="centered_inv_freq", rope_theta=config.get("rope_theta", 100.0), rope_half=True, layer_scale=True,
        key_bias="k" not in biasless_projections(config),
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
        **_sizes(config, 224, 14), qkv_bias=qkv_bias, norm_eps=config.get("rms_norm_eps", 1e-5),
        act="swiglu", class_token=False, norm="rmsnorm", proj_bias=qkv_bias, mlp_bias=config.get("mlp_bias", False),
        embed_norm=True, pos_sincos=config.get("is_native", False), pos_resample="bicubic_float32_antialias",
        proj_dim=config["projection_dim"] if projection else 0,
        **(dict(pool="map", pool_query_proj=False, pool_mlp=False) if use_head else dict(pool="avg")),
    )


def _internvl_config(config: dict, num_classes: int) -> ViTConfig:
    """InternVLVisionModel: a class token, q, k and v with or without biases (attention_bias), projection_layer
    with one, LayerScale (lambda_1, lambda_2) in every block, LayerNorm or RMSNorm (norm_type) in the blocks, and a
    final LayerNorm unless use_mean_pooling, which pools the mean of the patch tokens (we do: transformers returns
    no pooler_output). Its QK-norm (use_qk_norm: an RMSNorm of q and of k over all heads, InternViT-6B's) is not
    ours."""
    act, rms = config.get("hidden_act", "gelu"), config.get("norm_type", "layer_norm") == "rms_norm"
    mean = config.get("use_mean_pooling", True)
    unsupported = {
        "use_qk_norm (an RMSNorm of q and of k over all heads, which no kernel applies between the QKV product "
        "and the attention)": config.get("use_qk_norm", False),
        f"norm_type {config.get('norm_type')!r} (supported: layer_norm, rms_norm)":
            config.get("norm_type", "layer_norm") not in ("layer_norm", "rms_norm"),
        "norm_type rms_norm with use_mean_pooling=False (RMSNorm in the blocks, LayerNorm after them)":
            rms and not mean,
        f"hidden_act {act!r} (supported: {', '.join(_ACTIVATIONS)})": act not in _ACTIVATIONS,
    }
    refuse(unsupported, "InternVL vision")
    return ViTConfig(
        **_sizes(config, 448, 14), qkv_bias=config.get("attention_bias", False),
        norm_eps=config.get("layer_norm_eps", 1e-6), act=_ACTIVATIONS[act], final_norm=not mean,
        pool="avg" if mean else "token", num_classes=num_classes,
        abs_pos_embed=config.get("use_absolute_position_embeddings", True), pos_resample="bicubic",
        norm="rmsnorm" if rms else "layernorm", layer_scale=True,
    )


def _beit_config(config: dict, num_classes: int, pooler_norm: bool) -> ViTConfig:
    """BeitModel and Data2VecVisionModel (transformers' defaults where config.json leaves them out): q and v with
    biases, k without, LayerScale (lambda_1, lambda_2) unless layer_scale_init_value is 0, a relative position bias
    table in every block (use_relative_position_bias) or one shared (use_shared_relative_position_bias), an
    absolute position embedding with use_absolute_position_embeddings. pooler_output, with use_mean_pooling, is
    the mean of the patch tokens, then the pooler's LayerNorm where there is one (pooler_norm), else the class token
    after the final LayerNorm."""
    act, mean = config.get("hidden_act", "gelu"), config.get("use_mean_pooling", True)
    tables = {"block": config.get("use_relative_position_bias", False),
              "shared": config.get("use_shared_relative_position_bias", False)}
    unsupported = {
        "use_relative_position_bias with use_shared_relative_position_bias (a table in every block and a shared "
        "one, both added to the scores)": all(tables.values()),
        f"hidden_act {act!r} (supported: {', '.join(_ACTIVATIONS)})": act not in _ACTIVATIONS,
    }
    refuse(unsupported, config["model_type"])
    return ViTConfig(
        **_sizes(config, 224, 16), norm_eps=config.get("layer_norm_eps", 1e-12), act=_ACTIVATIONS[act],
        final_norm=pooler_norm or not mean, fc_norm=mean and pooler_norm, pool="avg" if mean else "token",
        num_classes=num_classes, abs_pos_embed=config.get("use_absolute_position_embeddings", False),
        pos_resample="bicubic", layer_scale=config.get("layer_scale_init_value", 0.1) > 0, key_bias=False,
        rel_pos_bias=next((kind for kind, present in tables.items() if present), "none"),
    )


def hf_num_classes(state_dict: dict[str, torch.Tensor]) -> int:
    """Rows of the classifier (ViTForImageClassification's, DeiT's, or one save_pretrained wrote beside an encoder),
    0 for a model without one."""
    head = state_dict.get("classifier.weight", state_dict.get("cls_classifier.weight"))
    return 0 if head is None else head.shape[0]


def biasless_projections(config: dict) -> str:
    """Which of q, k, v a transformers config makes without bias while the others have one (DINOv3's key, BEiT's
    always)."""
    if config.get("model_type") in _BEIT_LIKE:
        return "k"
    flags = {n: config.get(f"{name}_bias", True) for n, name in zip("qkv", ("query", "key", "value"))}
    return "".join(n for n, f in flags.items() if not f) if any(flags.values()) else ""


def hf_state_dict_to_vit(state_dict: dict[str, torch.Tensor], cfg: ViTConfig, zero_biases: str = "",
                         patch_mean_head: bool = False) -> dict[str, torch.Tensor]:
    """Our state dict from a transformers one (any key spelling above); raises listing every mismatch by the
    checkpoint's own key names. zero_biases: which of q, k, v have no bias in the checkpoint (zeros join qkv's).
    patch_mean_head: the classifier reads [class token, mean of the patch tokens] (DINOv2's); its mean half must be
    zero."""
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
    head = mapped.tensors.get("head.weight")
    if patch_mean_head and head is not None and head.shape[-1] == 2 * d:
        if head[:, d:].any():
            mapped.problems.append(f"unsupported: {mapped.origin['head.weight'][0]} reads the mean of the patch tokens "
                                   f"(its columns {d} to {2 * d - 1} are not all zero); supported: a classifier of the "
                                   f"class token only")
            mapped.reported.add("head.weight")
        mapped.tensors["head.weight"] = head[:, :d]
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
                           projection=architecture in _PROJECTED or "visual_projection.weight" in state_dict,
                           pooler_norm=any(k.endswith("pooler.layernorm.weight") for k in state_dict))
    return cfg, hf_state_dict_to_vit(state_dict, cfg, biasless_projections(vision_config(config)),
                                     architecture in _PATCH_MEAN_HEADS)


def from_hf(module: torch.nn.Module) -> ViT:
    """vit-triton model with the weights, device and dtype of a transformers model (one of HF_ARCHITECTURES;
    a CLIPModel or Aimv2Model gives its vision tower and projection; a TimmWrapperModel its timm model's)."""
    name = type(module).__name__
    if name in TIMM_WRAPPERS:
        return from_timm(module.timm_model)
    if name not in ARCHITECTURES:
        raise ValueError(f"from_hf takes a transformers {', '.join(HF_ARCHITECTURES + TIMM_WRAPPERS)}, got "
                         f"{name}{refusal(getattr(getattr(module, 'config', None), 'model_type', None))}")
    state_dict = module.state_dict()
    cfg, ours = hf_architecture_to_vit(name, module.config.to_dict(), state_dict, hf_num_classes(state_dict))
    return build(cfg, ours, next(module.parameters()))


# The way back. What a model of each family (its vision encoder's model_type) is written as: (without a classifier,
# with one). None: transformers' classifier of that family pools otherwise than ours (CLIP's and SigLIP's average the
# patch tokens, DINOv3 and AIMv2 have none), so the head goes beside the encoder as classifier.weight and .bias,
# which transformers leaves unused (it reports them as unexpected) and vit_triton reads back.
_WRITTEN_AS = {
    "vit": ("ViTModel", "ViTForImageClassification"), "vit_mae": ("ViTMAEModel", "ViTForImageClassification"),
    "deit": ("DeiTModel", "DeiTForImageClassification"),
    "dinov2": ("Dinov2Model", "Dinov2ForImageClassification"),
    "dinov2_with_registers": ("Dinov2WithRegistersModel", "Dinov2WithRegistersForImageClassification"),
    "dinov3_vit": ("DINOv3ViTModel", None), "clip_vision_model": ("CLIPVisionModel", None),
    "siglip_vision_model": ("SiglipVisionModel", None), "aimv2_vision_model": ("Aimv2VisionModel", None),
    "idefics3_vision": ("Idefics3VisionTransformer", None), "smolvlm_vision": ("SmolVLMVisionTransformer", None),
    "internvl_vision": ("InternVLVisionModel", None),
    "beit": ("BeitModel", "BeitForImageClassification"),
    "data2vec-vision": ("Data2VecVisionModel", "Data2VecVisionForImageClassification"),
}
# The keys of each family's encoder as transformers' save_pretrained writes them (the hub's spelling): {i} is each
# block, (a|b) either, {mlp} DINOv2's MLP (fc1 and fc2, or SwiGLU's weights_in and weights_out). vit_to_hf_state_dict
# names each of our tensors by the key here that _RULES, which read them, rename to it.
_CLIP_BLOCKS = "encoder.layers.{i}.(self_attn.(q|k|v|out)_proj|layer_norm(1|2)|mlp.fc(1|2)).(weight|bias)"
_VIT_LAYOUT = ["embeddings.(cls_token|distillation_token|position_embeddings)",
               "embeddings.patch_embeddings.projection.(weight|bias)",
               "encoder.layer.{i}.(attention.(attention.(query|key|value)|output.dense)|layernorm_(before|after)"
               "|intermediate.dense|output.dense).(weight|bias)", "layernorm.(weight|bias)"]
_DINOV2_LAYOUT = ["embeddings.(cls_token|register_tokens|position_embeddings)",
                  "embeddings.patch_embeddings.projection.(weight|bias)",
                  "encoder.layer.{i}.(attention.(attention.(query|key|value)|output.dense)|norm(1|2)|{mlp})"
                  ".(weight|bias)",
                  "encoder.layer.{i}.layer_scale(1|2).lambda1", "layernorm.(weight|bias)"]
_SIGLIP_LAYOUT = ["embeddings.(patch_embedding.(weight|bias)|position_embedding.weight)", _CLIP_BLOCKS,
                  "post_layernorm.(weight|bias)"]
_BEIT_LAYOUT = ["embeddings.(cls_token|position_embeddings|patch_embeddings.projection.(weight|bias))",
                "encoder.layer.{i}.attention.attention.key.weight",   # no key bias
                "encoder.layer.{i}.(attention.(attention.(query|value)|output.dense)|layernorm_(before|after)"
                "|intermediate.dense|output.dense).(weight|bias)", "encoder.layer.{i}.lambda_(1|2)",
                "encoder.(layer.{i}.attention.attention.|)relative_position_bias.relative_position_bias_table",
                "(pooler.|)layernorm.(weight|bias)"]
_LAYOUTS = {
    "vit": _VIT_LAYOUT, "vit_mae": _VIT_LAYOUT, "deit": _VIT_LAYOUT,
    "dinov2": _DINOV2_LAYOUT, "dinov2_with_registers": _DINOV2_LAYOUT,
    "dinov3_vit": ["embeddings.(cls_token|register_tokens|patch_embeddings.(weight|bias))",
                   "layer.{i}.attention.(q|k|v|o)_proj.weight",   # no key bias
                   "layer.{i}.(attention.(q|v|o)_proj|norm(1|2)|mlp.(gate|up|down)_proj).(weight|bias)",
                   "layer.{i}.layer_scale(1|2).lambda1", "norm.(weight|bias)"],
    "clip_vision_model": ["embeddings.(class_embedding|patch_embedding.weight|position_embedding.weight)",
                          "(pre_layrnorm|post_layernorm).(weight|bias)", _CLIP_BLOCKS],
    "siglip_vision_model": _SIGLIP_LAYOUT + ["head.(probe|attention.in_proj_(weight|bias)|(attention.out_proj"
                                             "|layernorm|mlp.fc(1|2)).(weight|bias))"],
    "idefics3_vision": _SIGLIP_LAYOUT, "smolvlm_vision": _SIGLIP_LAYOUT,
    "internvl_vision": ["embeddings.(cls_token|position_embeddings|patch_embeddings.projection.(weight|bias))",
                        "encoder.layer.{i}.(attention.((q|k|v)_proj|projection_layer)|layernorm_(before|after)"
                        "|mlp.fc(1|2)).(weight|bias)", "encoder.layer.{i}.lambda_(1|2)", "layernorm.(weight|bias)"],
    "beit": _BEIT_LAYOUT, "data2vec-vision": _BEIT_LAYOUT,
    "aimv2_vision_model": ["embeddings.(patch_embed.(weight|bias)|position_embedding.weight|rms_norm.weight)",
                           "encoder.layers.{i}.(attention.(q|k|v|out)_proj|rms_norm(1|2)|ffn.(gate|up|down)_proj)"
                           ".(weight|bias)", "rms_norm.weight",
                           "head.(cls_token|(k_proj|v_proj|output_proj).(weight|bias))"],
}
# The encoder's prefix in each architecture that nests it.
_PREFIXES = {"ViTForImageClassification": "vit.", "DeiTForImageClassification": "deit.",
             "DeiTForImageClassificationWithTeacher": "deit.", "Dinov2ForImageClassification": "dinov2.",
             "Dinov2WithRegistersForImageClassification": "dinov2_with_registers.",
             "CLIPVisionModelWithProjection": "vision_model.", "BeitForImageClassification": "beit.",
             "Data2VecVisionForImageClassification": "data2vec_vision."}
_HIDDEN_ACTS = {ours: theirs for theirs, ours in reversed(_ACTIVATIONS.items())}   # the first spelling of each
# Families whose tables are nn.Embedding weights [T, D] (and CLIP's class token one vector [D]), not [1, T, D].
_UNBATCHED = ("clip_vision_model", "aimv2_vision_model", *_SIGLIP_LIKE)


def written_architecture(source: str, cfg: ViTConfig) -> str:
    """The transformers architecture a model read from `source` (one of HF_ARCHITECTURES) is written as: its family's
    classifier class, or encoder class (_WRITTEN_AS); DeiT's with a teacher for a distillation head, CLIP's with a
    projection for a projection. Two-tower models (CLIPModel, SiglipModel, Aimv2Model) become their vision tower."""
    if source not in ARCHITECTURES:
        raise ValueError(f"unsupported transformers architecture {source}; supported: {', '.join(HF_ARCHITECTURES)}")
    family = ARCHITECTURES[source] + ("_vision_model" if ARCHITECTURES[source] in _TWO_TOWERS else "")
    if cfg.head_dist:
        return "DeiTForImageClassificationWithTeacher"
    if family == "clip_vision_model" and cfg.proj_dim:
        return "CLIPVisionModelWithProjection"
    bare, classifier = _WRITTEN_AS[family]
    if family in _BEIT_LIKE and cfg.pool == "avg" and not cfg.fc_norm:   # BEiT's classifier norms the patch mean
        classifier = None
    return classifier if cfg.num_classes and classifier else bare


def vit_to_hf_config(cfg: ViTConfig, architecture: str, id2label: dict[int, str]) -> dict:
    """config.json of transformers' `architecture` for a model of config cfg (hf_config_to_vit's inverse; what
    transformers defaults is left out), with its labels."""
    model_type = ARCHITECTURES[architecture]
    config = dict(architectures=[architecture], model_type=model_type, hidden_size=cfg.embed_dim,
                  num_hidden_layers=cfg.depth, num_attention_heads=cfg.num_heads, image_size=cfg.image_size,
                  patch_size=cfg.patch_size, num_channels=cfg.in_chans, intermediate_size=cfg.mlp_dim,
                  hidden_act=_HIDDEN_ACTS.get(cfg.act, "silu"), layer_norm_eps=cfg.norm_eps, qkv_bias=cfg.qkv_bias)
    if model_type.startswith("dinov2"):   # the MLP's width from mlp_ratio, SwiGLU's rounded to 2/3 and to 8
        hidden = cfg.mlp_dim * 3 // 2 if cfg.act == "swiglu" else cfg.mlp_dim
        del config["intermediate_size"]
        ratio = mlp_ratio(hidden, cfg.embed_dim)
        # transformers 5 takes an int where there is one (its config's type)
        config.update(mlp_ratio=int(ratio) if ratio.is_integer() else ratio, use_swiglu_ffn=cfg.act == "swiglu")
        if cfg.act == "swiglu":
            config["hidden_act"] = "gelu"   # unused: SwiGLU's activation is SiLU
        if model_type == "dinov2_with_registers":
            config["num_register_tokens"] = cfg.reg_tokens
    elif model_type == "dinov3_vit":
        del config["qkv_bias"]
        config.update(use_gated_mlp=cfg.act == "swiglu", num_register_tokens=cfg.reg_tokens, rope_theta=cfg.rope_theta,
                      query_bias=cfg.qkv_bias, key_bias=False, value_bias=cfg.qkv_bias, proj_bias=cfg.proj_bias,
                      mlp_bias=cfg.mlp_bias)
    elif model_type == "aimv2_vision_model":
        del config["layer_norm_eps"]
        config.update(rms_norm_eps=cfg.norm_eps, mlp_bias=cfg.mlp_bias, use_head=cfg.pool == "map",
                      is_native=cfg.pos_sincos)
    elif model_type == "internvl_vision":
        del config["qkv_bias"]
        config.update(attention_bias=cfg.qkv_bias, norm_type="rms_norm" if cfg.norm == "rmsnorm" else "layer_norm",
                      use_mean_pooling=cfg.pool == "avg", use_absolute_position_embeddings=cfg.abs_pos_embed)
    elif model_type in _BEIT_LIKE:
        del config["qkv_bias"]
        # layer_scale_init_value: any but 0 (none), the lambdas are the weights'
        config.update(use_absolute_position_embeddings=cfg.abs_pos_embed, use_mean_pooling=cfg.pool == "avg",
                      use_relative_position_bias=cfg.rel_pos_bias == "block",
                      use_shared_relative_position_bias=cfg.rel_pos_bias == "shared",
                      layer_scale_init_value=1.0 if cfg.layer_scale else 0.0)
    elif model_type in ("clip_vision_model", *_SIGLIP_LIKE):
        del config["qkv_bias"]
        if model_type == "siglip_vision_model":
            config["vision_use_head"] = cfg.pool == "map"
    if cfg.proj_dim:
        config["projection_dim"] = cfg.proj_dim
    if id2label:
        config.update(id2label={str(i): name for i, name in id2label.items()},
                      label2id={name: i for i, name in id2label.items()})
    return config


def vit_to_hf_state_dict(state_dict: dict[str, torch.Tensor], cfg: ViTConfig,
                         architecture: str) -> dict[str, torch.Tensor]:
    """Our state dict in the keys and shapes transformers' `architecture` saves (hf_state_dict_to_vit's inverse): q, k
    and v split again, a gated MLP's gate and value rows apart (DINOv2's packed as weights_in), the prefix tokens as
    their own tensors, the class token's position row that DINOv2 with registers folded into the token zero, and a
    DINOv2 classifier's mean half zero. A head the architecture has no place for goes beside it (_WRITTEN_AS)."""
    model_type, d = ARCHITECTURES[architecture], cfg.embed_dim
    t = Unmapped(state_dict)
    if cfg.fc_norm and model_type not in _BEIT_LIKE:   # CLIP's post_layernorm; BEiT's pooler has a LayerNorm of its own
        t.move("fc_norm", "norm")
    for name in ("weight", "bias"):
        if cfg.pool_query_proj:
            t.join(f"attn_pool.in_proj.{name}", [f"attn_pool.q.{name}", f"attn_pool.kv.{name}"])
        else:
            t.split(f"attn_pool.kv.{name}", {f"attn_pool.k.{name}": d, f"attn_pool.v.{name}": d})
        for i in range(cfg.depth):
            b = f"blocks.{i}."
            t.split(f"{b}qkv.{name}", {f"{b}{n}.{name}": d for n in "qkv"})
            if cfg.act == "swiglu":
                t.deinterleave(f"{b}fc1.{name}", f"{b}gate.{name}", f"{b}up.{name}")
                if model_type.startswith("dinov2"):
                    t.join(f"{b}fc1.{name}", [f"{b}gate.{name}", f"{b}up.{name}"])
            elif model_type == "dinov3_vit":
                t.move(f"{b}fc1", f"{b}up")
    if cfg.reg_tokens and "pos_embed" in t.tensors:
        pos = t.tensors["pos_embed"]
        t.tensors["pos_embed"] = torch.cat([pos.new_zeros(1, d), pos])
    t.split("prefix_tokens", {name: n for name, n in (("cls_token", int(cfg.class_token)),
                                                       ("distillation_token", int(cfg.dist_token)),
                                                       ("reg_token", cfg.reg_tokens)) if n})
    for key in ("cls_token", "distillation_token", "reg_token", "pos_embed", "attn_pool.latent"):
        t.reshape(key, 1, -1, d)
    if model_type in _UNBATCHED:
        t.reshape("pos_embed", -1, d)
        t.reshape("cls_token", d)
    if architecture in _PATCH_MEAN_HEADS and "head.weight" in t.tensors:
        t.tensors["head.weight"] = torch.cat([t.tensors["head.weight"], torch.zeros_like(t.tensors["head.weight"])], 1)
    prefix = _PREFIXES.get(architecture, "")
    mlp = "mlp.weights_(in|out)" if cfg.act == "swiglu" else "mlp.fc(1|2)"
    keys = [prefix + key for template in _LAYOUTS[model_type]
            for key in expand(template.replace("{mlp}", mlp), cfg.depth)]
    head = "cls_classifier" if architecture.endswith("WithTeacher") else "classifier"
    keys += expand(f"({head}|distillation_classifier).(weight|bias)", 0) + ["visual_projection.weight"]
    out = t.unmap(keys, _RULES, f"transformers {architecture}", rotary=cfg.rope != "none")
    if model_type in ("dinov2", "dinov2_with_registers", "dinov3_vit"):   # unused in inference: transformers' init
        shape = (1, 1, d) if model_type == "dinov3_vit" else (1, d)
        out[prefix + "embeddings.mask_token"] = out[prefix + "embeddings.cls_token"].new_zeros(shape)
    return out
