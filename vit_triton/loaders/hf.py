"""HuggingFace transformers ViT (ViTModel, ViTForImageClassification) and DeiT (DeiTModel,
DeiTForImageClassification, DeiTForImageClassificationWithTeacher) -> vit-triton.

Keys come in two spellings: the hub's (transformers 4: encoder.layer.N.attention.attention.query,
intermediate.dense, output.dense, ...) and transformers 5's (layers.N.attention.q_proj, mlp.fc1,
...). Both map here. q, k and v are concatenated into one QKV weight; ViTModel's pooler
(dense + tanh over the class token) is not part of our forward, which returns the class token, and
neither is the mask token of ViTModel(use_mask_token=True).
DeiT is ViT with a distillation token after the class token, and with a teacher, a second
classifier on it (cls_classifier -> head, distillation_classifier -> head_dist).
"""

from __future__ import annotations

import torch

from ..model import ViT, ViTConfig
from .common import Mapped, build

_ACTIVATIONS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
                "quick_gelu": "quick_gelu"}

_LAYER = r"(?:encoder\.layer|layers)\.(\d+)\."
# ViTForImageClassification nests the model under "vit." (DeiT: "deit."); a bare ViTModel does not.
_RULES = [(r"(?:vit\.|deit\.)?" + pattern, repl) for pattern, repl in [
    (r"embeddings\.(cls_token|distillation_token)", r"\1"),
    (r"embeddings\.position_embeddings", "pos_embed"),
    (r"embeddings\.patch_embeddings\.projection\.(weight|bias)", r"patch_embed.\1"),
    (_LAYER + r"attention\.(?:attention\.)?(?:query|q_proj)\.(weight|bias)", r"blocks.\1.q.\2"),
    (_LAYER + r"attention\.(?:attention\.)?(?:key|k_proj)\.(weight|bias)", r"blocks.\1.k.\2"),
    (_LAYER + r"attention\.(?:attention\.)?(?:value|v_proj)\.(weight|bias)", r"blocks.\1.v.\2"),
    (_LAYER + r"attention\.(?:output\.dense|o_proj)\.(weight|bias)", r"blocks.\1.proj.\2"),
    (_LAYER + r"layernorm_before\.(weight|bias)", r"blocks.\1.norm1.\2"),
    (_LAYER + r"layernorm_after\.(weight|bias)", r"blocks.\1.norm2.\2"),
    (_LAYER + r"(?:intermediate\.dense|mlp\.fc1)\.(weight|bias)", r"blocks.\1.fc1.\2"),
    (_LAYER + r"(?:output\.dense|mlp\.fc2)\.(weight|bias)", r"blocks.\1.fc2.\2"),
    (r"layernorm\.(weight|bias)", r"norm.\1"),
]] + [(r"(?:cls_)?classifier\.(weight|bias)", r"head.\1"),
       (r"distillation_classifier\.(weight|bias)", r"head_dist.\1")]
# Not in our forward: the pooler, and the mask token that only masked image modelling inputs use.
_UNUSED = [(r"(?:vit\.|deit\.)?(?:pooler\.dense\.(?:weight|bias)|embeddings\.mask_token)", "")]


def _square(config: dict, key: str) -> int:
    """config[key] as one side: an int, or a [height, width] pair of equal sides."""
    size = config[key]
    if isinstance(size, int):
        return size
    if len(size) == 2 and size[0] == size[1]:
        return size[0]
    raise ValueError(f"unsupported {key} {size!r}; supported: square (an int or two equal sides)")


def hf_config_to_vit(config: dict, num_classes: int = 0, head_dist: bool = False) -> ViTConfig:
    """ViTConfig from a transformers ViT or DeiT config (config.json as a dict); the head size, and
    whether there is a distillation head (DeiTForImageClassificationWithTeacher), are separate."""
    if config.get("model_type") not in ("vit", "deit"):
        raise ValueError(f"unsupported HuggingFace model_type {config.get('model_type')!r}; supported: 'vit', 'deit'")
    act = config.get("hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {act!r}; supported: {', '.join(_ACTIVATIONS)}")
    return ViTConfig(
        image_size=_square(config, "image_size"), patch_size=_square(config, "patch_size"),
        in_chans=config.get("num_channels", 3), embed_dim=config["hidden_size"], depth=config["num_hidden_layers"],
        num_heads=config["num_attention_heads"], mlp_dim=config["intermediate_size"],
        qkv_bias=config.get("qkv_bias", True), norm_eps=config.get("layer_norm_eps", 1e-12),
        act=_ACTIVATIONS[act], num_classes=num_classes, dist_token=config["model_type"] == "deit",
        head_dist=head_dist, pos_resample="bicubic",   # interpolate_pos_encoding
    )


def hf_num_classes(state_dict: dict[str, torch.Tensor]) -> int:
    """Rows of the classifier (ViTForImageClassification, DeiT's), 0 for a bare ViTModel or DeiTModel."""
    head = state_dict.get("classifier.weight", state_dict.get("cls_classifier.weight"))
    return 0 if head is None else head.shape[0]


def hf_state_dict_to_vit(state_dict: dict[str, torch.Tensor], cfg: ViTConfig) -> dict[str, torch.Tensor]:
    """Our state dict from a HF ViT one (either key spelling); raises listing every mismatch by the
    checkpoint's own key names."""
    mapped = Mapped(state_dict, _RULES, _UNUSED)
    d = cfg.embed_dim
    mapped.concat("prefix_tokens", ["cls_token", "distillation_token"])
    mapped.reshape("pos_embed", -1, d)
    for i in range(cfg.depth):
        mapped.concat(f"blocks.{i}.qkv.weight", [f"blocks.{i}.{n}.weight" for n in "qkv"], shape=(d, d))
        mapped.concat(f"blocks.{i}.qkv.bias", [f"blocks.{i}.{n}.bias" for n in "qkv"], shape=(d,))
    return mapped.check(cfg, "HuggingFace ViT")


HF_ARCHITECTURES = ("ViTModel", "ViTForImageClassification", "DeiTModel", "DeiTForImageClassification",
                    "DeiTForImageClassificationWithTeacher")


def from_hf(module: torch.nn.Module) -> ViT:
    """vit-triton model with the weights, device and dtype of a transformers ViT or DeiT model
    (one of HF_ARCHITECTURES)."""
    name = type(module).__name__
    if name not in HF_ARCHITECTURES:
        raise ValueError(f"from_hf takes a transformers {', '.join(HF_ARCHITECTURES)}, got {name}")
    state_dict = module.state_dict()
    cfg = hf_config_to_vit(module.config.to_dict(), hf_num_classes(state_dict),
                           head_dist=name == "DeiTForImageClassificationWithTeacher")
    return build(cfg, hf_state_dict_to_vit(state_dict, cfg), next(module.parameters()))
