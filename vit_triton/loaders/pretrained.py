"""Checkpoints on disk or on the HuggingFace hub -> a ViT, its labels and its preprocessing.

The config and the weights are read directly (loaders/files.py); transformers and timm are neither
needed nor imported, and no reference model is built. A transformers checkpoint (config.json with a
"model_type") maps through loaders/hf.py; a timm one (config.json with an "architecture") through
loaders/timm.py, its ViTConfig read from the tensors' shapes, as timm's config.json records only the
arguments that differ from the architecture's defaults; an OpenCLIP one (open_clip_config.json) through
loaders/open_clip.py. The exceptions, read from the architecture timm builds on the meta device (timm needed): a
timm Eva (EVA02, the RoPE ViTs, DINOv3, Perception Encoder), whose rotary settings neither its tensors nor its
config.json show, a timm Beit (BEiT, BEiT v2), whose architecture sets its pooling and norms, and an OpenCLIP tower
whose trunk is a timm model (EVA02-CLIP, PE-Core, SigLIP). transformers'
TimmWrapperModel saves a timm checkpoint (config.json with an "architecture") with its keys under timm_model.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..model import ViT, ViTConfig
from .common import TRAINING_FIELDS, build
from .files import OPEN_CLIP_CONFIG, CheckpointNotFound, find_checkpoint, read_json, read_weights
from .hf import ARCHITECTURES, HF_ARCHITECTURES, TIMM_WRAPPERS, hf_architecture_to_vit, hf_num_classes, refusal
from .open_clip import OPEN_CLIP_TOWER, open_clip_config_to_vit, open_clip_state_dict_to_vit, open_clip_timm_tower, \
    timm_trunk
from .timm import timm_config_to_vit, timm_meta_model, timm_refusal, timm_state_dict_to_vit

__all__ = ["CheckpointInfo", "CheckpointNotFound", "SUPPORTED", "from_pretrained", "read_checkpoint"]

TIMM_ARCHITECTURES = ("timm VisionTransformer and VisionTransformerDistilled (vit_*, deit_*, deit3_*, aimv2_*), Eva "
                      "(eva02_*, vit_*_rope_*, vit_*_dinov3, vit_pe_core_*), Beit (beit_*, beitv2_*)")
SUPPORTED = (f"transformers {', '.join(HF_ARCHITECTURES + TIMM_WRAPPERS)}; {TIMM_ARCHITECTURES}; OpenCLIP ViT "
             f"towers (their own, or a timm trunk of those)")


@dataclass(frozen=True)
class CheckpointInfo:
    """What a checkpoint says besides its weights; from_pretrained sets it as `model.checkpoint`."""

    source: str                 # the directory, file or hub id it was read from
    library: str                # "transformers", "timm" or "open_clip"
    architecture: str           # e.g. "ViTForImageClassification", "vit_base_patch16_224"
    id2label: Mapping[int, str]   # class index -> name; empty without a classifier
    preprocessing: dict         # preprocessor_config.json (transformers), pretrained_cfg (timm) or
                                # preprocess_cfg (OpenCLIP); {} if none


def read_checkpoint(name_or_path: str | os.PathLike) -> tuple[ViTConfig, dict[str, torch.Tensor], CheckpointInfo]:
    """(config, state dict in our names, info) of a checkpoint; see from_pretrained for what is accepted.

    Raises CheckpointNotFound when there is nothing at name_or_path, ValueError for an unsupported
    architecture (naming the supported ones) or weights that do not fit (listing every key that is
    missing, unexpected or mis-shaped).
    """
    files = find_checkpoint(name_or_path)
    config = read_json(files.config)
    state_dict = read_weights(files.weights)
    if files.config.name == OPEN_CLIP_CONFIG:
        trunk = timm_trunk(config)
        if trunk:
            cfg, ours = open_clip_timm_tower(config, state_dict)
        else:
            cfg = open_clip_config_to_vit(config)
            ours = open_clip_state_dict_to_vit(state_dict, cfg)
        return cfg, ours, CheckpointInfo(files.source, "open_clip", trunk or OPEN_CLIP_TOWER, {},
                                         config.get("preprocess_cfg") or {})
    if "architecture" in config:
        return timm_checkpoint(files.source, config, state_dict)
    preprocessing = read_json(files.preprocessor) if files.preprocessor else {}
    return hf_checkpoint(files.source, config, state_dict, preprocessing)


def from_pretrained(name_or_path: str | os.PathLike, *, device: torch.device | str | None = None,
                    dtype: torch.dtype | None = None, **training: float) -> ViT:
    """A ViT holding a checkpoint's weights, in eval mode, with `model.checkpoint` (CheckpointInfo:
    labels and preprocessing; vit_triton.data.Preprocess.for_model(model) applies the latter).

    name_or_path: a HuggingFace hub id ("google/vit-base-patch16-224", "facebook/deit-base-distilled-
    patch16-224", "timm/vit_base_patch16_224.augreg2_in21k_ft_in1k"), fetched through huggingface_hub
    and its cache; or a local directory in the same layout (config.json, model.safetensors or
    pytorch_model.bin, sharded with an index or not, preprocessor_config.json for transformers; or
    OpenCLIP's open_clip_config.json with open_clip_model.safetensors or open_clip_pytorch_model.bin); or a
    local weights file with its config beside it. device: default CUDA if there is one, else CPU
    (which needs TRITON_INTERPRET=1 to run). dtype: default bfloat16 on a GPU, float32 on the CPU. training: the
    regularization model.train() applies, timm's names (ViTConfig's drop_path_rate, drop_rate, pos_drop_rate),
    which no checkpoint records.
    """
    unknown = sorted(set(training) - set(TRAINING_FIELDS))
    if unknown:
        raise TypeError(f"from_pretrained() got unexpected keyword arguments {unknown}; the training settings it "
                        f"takes: {', '.join(TRAINING_FIELDS)}")
    cfg, state_dict, info = read_checkpoint(name_or_path)
    cfg = replace(cfg, **training)
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype is None:
        dtype = torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16
    model = build(cfg, state_dict, torch.empty(0, device=device, dtype=dtype))
    model.checkpoint = info
    return model


def _unsupported(what: str) -> ValueError:
    return ValueError(f"unsupported architecture {what}; supported: {SUPPORTED}")


def _timm_refusal(architecture: str) -> str:
    """Why timm's `architecture` is refused, where timm is installed and knows the reason (timm_refusal)."""
    try:
        import timm
    except ImportError:
        return ""
    return timm_refusal(timm.models.model_entrypoint(architecture).__module__) if timm.is_model(architecture) else ""


def hf_checkpoint(source: str, config: dict, state_dict: dict,
                  preprocessing: dict) -> tuple[ViTConfig, dict[str, torch.Tensor], CheckpointInfo]:
    """(config, state dict in our names, info) of a transformers checkpoint: its config.json, weights and
    preprocessor_config.json."""
    model_type = config.get("model_type")
    bare = next((a for a, t in ARCHITECTURES.items() if t == model_type), f"model_type {model_type!r}")
    architecture = (config.get("architectures") or [bare])[0]
    if ARCHITECTURES.get(architecture) != model_type:
        raise _unsupported(f"{architecture} (transformers, model_type {model_type!r}){refusal(model_type)}")
    id2label = {int(k): v for k, v in (config.get("id2label") or {}).items()}
    # An encoder's classifier is one that save_pretrained wrote beside it (its family's own pools otherwise).
    num_classes = hf_num_classes(state_dict)
    if architecture.endswith(("Classification", "WithTeacher")):
        # A classifier's missing head must be reported missing, not turn the model into a bare one.
        num_classes = num_classes or len(id2label) or config.get("num_labels", 2)
    if num_classes:
        if id2label and len(id2label) != num_classes:
            raise ValueError(f"{source}: config.json names {len(id2label)} labels (id2label), but the classifier "
                             f"has {num_classes} rows")
    cfg, ours = hf_architecture_to_vit(architecture, config, state_dict, num_classes)
    labels = {i: id2label.get(i, f"LABEL_{i}") for i in range(num_classes)}
    return cfg, ours, CheckpointInfo(source, "transformers", architecture, labels, preprocessing)


# timm's defaults that the weights do not show: heads per width (64-wide heads but for these).
_TIMM_HEADS = {1152: 16, 1280: 16, 1408: 16, 1664: 16}
_TIMM_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_tanh", "quick_gelu": "quick_gelu"}
_TIMM_UNSUPPORTED = {
    r"blocks\.\d+\.attn\.[qk]_norm\..*": "qk_norm (a norm of each head's q and k)",
    r"attn_pool\.(?:q_norm\..*|k_norm\..*|pos_embed)": "an attention pool with qk_norm or pos_embed",
    r"patch_embed\.backbone\..*": "a hybrid convolutional stem (a CNN before the patch projection)",
}


# The timm families whose config is read from the model timm builds, by their module, and their architectures' names.
_TIMM_BUILT = {"timm.models.eva": r"eva|vit_.*_(rope|dinov3)|vit_pe_", "timm.models.beit": r"beit"}


def _timm_built(architecture: str, config: dict, num_classes: int) -> ViTConfig | None:
    """The config of a timm Eva or Beit architecture, built by timm on the meta device with the checkpoint's
    model_args and the weights' num_classes; None for an architecture of another family."""
    if _plain_timm_vit(architecture):
        return None
    try:
        import timm
    except ImportError:
        if any(re.match(names, architecture) for names in _TIMM_BUILT.values()):
            raise ImportError(f"{architecture} is a timm Eva or Beit, whose settings come from timm's registry: "
                              f"pip install timm") from None
        return None
    if not timm.is_model(architecture) or timm.models.model_entrypoint(architecture).__module__ not in _TIMM_BUILT:
        return None
    args = {**(config.get("model_args") or {}), "num_classes": num_classes}
    size = (config.get("pretrained_cfg") or {}).get("input_size")
    if size and "img_size" not in args:
        args["img_size"] = tuple(size[-2:])
    try:
        module = timm_meta_model(architecture, **args)
    except TypeError:   # an argument this timm does not know
        return None
    return timm_config_to_vit(module)


def _plain_timm_vit(architecture: str) -> bool:
    """Whether timm's vision_transformer.py registers `architecture` (a @register_model function of that name), as
    its source says, read without importing timm: importing it takes seconds (through torchvision, torch._dynamo),
    and a plain VisionTransformer's config comes from its weights. False where the source does not say so: timm's
    registry is asked then."""
    spec = importlib.util.find_spec("timm")
    if spec is None or not spec.submodule_search_locations:
        return False
    try:
        source = (Path(next(iter(spec.submodule_search_locations))) / "models" / "vision_transformer.py").read_text()
    except OSError:
        return False
    return re.search(rf"^@register_model\n(?:@.*\n)*def {re.escape(architecture)}\(", source, re.M) is not None


def timm_checkpoint(source: str, config: dict,
                    state_dict: dict) -> tuple[ViTConfig, dict[str, torch.Tensor], CheckpointInfo]:
    """(config, state dict in our names, info) of a timm checkpoint: its config.json and weights (TimmWrapperModel's
    too)."""
    architecture = config["architecture"]
    if config.get("model_type") == "timm_wrapper":
        state_dict = {k.removeprefix("timm_model."): v for k, v in state_dict.items()}
    num_classes = state_dict["head.weight"].shape[0] if "head.weight" in state_dict else 0
    cfg = _timm_built(architecture, config, num_classes)
    if cfg is None and (not re.match(r"(vit|deit3?|aimv2)_", architecture)
                        or "patch_embed.proj.weight" not in state_dict):
        raise _unsupported(f"{architecture} (timm){_timm_refusal(architecture)}")
    found = {what for pattern, what in _TIMM_UNSUPPORTED.items() for k in state_dict if re.fullmatch(pattern, k)}
    if cfg is None and found:
        raise ValueError(f"unsupported timm VisionTransformer feature in {architecture}: {'; '.join(sorted(found))}")
    cfg = cfg or _timm_config(architecture, config, state_dict, num_classes)
    ours = timm_state_dict_to_vit(state_dict, cfg)
    return cfg, ours, CheckpointInfo(source, "timm", architecture, _timm_labels(source, config, cfg.num_classes),
                                     config.get("pretrained_cfg") or {})


def _timm_config(architecture: str, config: dict, sd: dict, num_classes: int) -> ViTConfig:
    """ViTConfig of a timm ViT checkpoint from its tensors' shapes, model_args and the architecture name: bias-free
    norms are RmsNorm (AIMv2's; timm's VisionTransformers with LayerNorm all have its bias)."""
    args = config.get("model_args") or {}
    embed_dim, in_chans, patch, _ = sd["patch_embed.proj.weight"].shape
    depth = 1 + max((int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k))), default=-1)
    class_token, dist_token = "cls_token" in sd, "dist_token" in sd
    reg_tokens = sd["reg_token"].shape[1] if "reg_token" in sd else 0
    prefix = int(class_token) + int(dist_token) + reg_tokens
    pos = sd["pos_embed"].shape[1] if "pos_embed" in sd else 0
    size = args.get("img_size") or (config.get("pretrained_cfg") or {}).get("input_size", [None])[-1]
    if isinstance(size, (list, tuple)):
        if size[-2] != size[-1]:
            raise ValueError(f"unsupported non-square img_size {list(size[-2:])} in {architecture}: the checkpoint's "
                             f"own grid must be square (inputs of any size run)")
        size = size[-1]
    if size:
        pos_embed_prefix = pos != (size // patch) ** 2 or not prefix
    else:  # the grid is square: of pos and pos - prefix, the square one is the patch count
        pos_embed_prefix = args.get("no_embed_class") is not True and round((pos - prefix) ** 0.5) ** 2 == pos - prefix
        size = round((pos - prefix * pos_embed_prefix) ** 0.5) * patch
    act = args.get("act_layer") or ("quick_gelu" if "quickgelu" in architecture else "gelu")
    # SwiGLU's fc1_g and fc1_x (AIMv2), or an fc1 twice as tall as fc2 is wide: SwiGLUPacked (DINOv2 ViT-g/14), gate
    # then value; SiLU either way
    gated = depth and ("blocks.0.mlp.fc1_g.weight" in sd
                       or sd["blocks.0.mlp.fc1.weight"].shape[0] == 2 * sd["blocks.0.mlp.fc2.weight"].shape[1])
    if not gated and act not in _TIMM_ACTIVATIONS:
        raise ValueError(f"unsupported timm act_layer {act!r}; supported: {', '.join(_TIMM_ACTIVATIONS)}")
    pool = config.get("global_pool", args.get("global_pool", "map" if "attn_pool.latent" in sd
                                              else "token" if class_token else "avg"))
    if pool not in ("token", "avg", "map"):
        raise ValueError(f"unsupported timm global_pool {pool!r} in {architecture}; supported: token, avg, map")
    return ViTConfig(
        image_size=size, patch_size=patch, in_chans=in_chans, embed_dim=embed_dim, depth=depth,
        num_heads=args.get("num_heads") or _TIMM_HEADS.get(embed_dim, max(embed_dim // 64, 1)),
        mlp_dim=sd["blocks.0.mlp.fc2.weight"].shape[1] if depth else 4 * embed_dim,
        qkv_bias="blocks.0.attn.qkv.bias" in sd,
        # CLIP towers use nn.LayerNorm's default, AIMv2's RmsNorm the same
        norm_eps=1e-5 if "_clip_" in architecture or architecture.startswith("aimv2_") else 1e-6,
        act="swiglu" if gated else _TIMM_ACTIVATIONS[act], class_token=class_token, dist_token=dist_token,
        reg_tokens=reg_tokens,
        pos_embed_prefix=pos_embed_prefix, patch_bias="patch_embed.proj.bias" in sd,
        pre_norm="norm_pre.weight" in sd, final_norm="norm.weight" in sd or "fc_norm.weight" in sd,
        fc_norm="fc_norm.weight" in sd, pool=pool, num_classes=num_classes, head_dist="head_dist.weight" in sd,
        pos_resample="bicubic_float32_antialias",
        norm="rmsnorm" if "blocks.0.norm1.weight" in sd and "blocks.0.norm1.bias" not in sd else "layernorm",
        proj_bias="blocks.0.attn.proj.bias" in sd, mlp_bias="blocks.0.mlp.fc2.bias" in sd,
        embed_norm="patch_embed.norm.weight" in sd,
        layer_scale=any(re.fullmatch(r"blocks\.\d+\.ls[12]\.gamma", k) for k in sd),
        attn_norm="blocks.0.attn.norm.weight" in sd, mlp_norm="blocks.0.mlp.norm.weight" in sd,
    )


def _timm_labels(source: str, config: dict, num_classes: int) -> Mapping[int, str]:
    """Names from config.json's label_names (and label_descriptions), else ImageNet's if timm is installed (looked
    up when first asked for: LazyLabels)."""
    if not num_classes:
        return {}
    if config.get("num_classes", num_classes) != num_classes:
        raise ValueError(f"{source}: config.json says num_classes {config['num_classes']}, but the classifier has "
                         f"{num_classes} rows")
    names = config.get("label_names")
    if isinstance(names, dict):
        names = {int(k): v for k, v in names.items()}
    elif names:
        names = dict(enumerate(names))
    else:
        return LazyLabels(functools.partial(_imagenet_labels, config, num_classes))
    if len(names) != num_classes:
        raise ValueError(f"{source}: config.json names {len(names)} labels (label_names), but the classifier has {num_classes} "
                         f"rows")
    return _named(config, names, num_classes)


def _imagenet_labels(config: dict, num_classes: int) -> dict[int, str]:
    return _named(config, _imagenet_names(num_classes), num_classes)


def _named(config: dict, names: dict[int, str], num_classes: int) -> dict[int, str]:
    """Each class's name (its label_descriptions entry where config.json has one), LABEL_i where none."""
    descriptions = config.get("label_descriptions") or {}
    return {i: descriptions.get(names.get(i), names.get(i, f"LABEL_{i}")) for i in range(num_classes)}


class LazyLabels(Mapping):
    """A class index -> name mapping computed when first used: ImageNet's names come from timm, whose import takes
    seconds, which a run that never names a class (embed) does not pay."""

    def __init__(self, compute: Callable[[], dict[int, str]]) -> None:
        self._compute = compute
        self._labels: dict[int, str] | None = None

    def _get(self) -> dict[int, str]:
        if self._labels is None:
            self._labels = self._compute()
        return self._labels

    def __getitem__(self, index: int) -> str:
        return self._get()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


def _imagenet_names(num_classes: int) -> dict[int, str]:
    try:
        from timm.data import ImageNetInfo, infer_imagenet_subset
    except ImportError:
        return {}
    subset = infer_imagenet_subset({"num_classes": num_classes})
    return dict(enumerate(ImageNetInfo(subset).label_descriptions())) if subset else {}
