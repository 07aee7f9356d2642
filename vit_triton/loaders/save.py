"""save_pretrained: a model written back as a checkpoint of the library it came from, which that library loads as it
is and vit_triton.from_pretrained reads back as the same model, with its labels.

transformers: the architecture of the model's family (hf.written_architecture: its classifier class when the model
has a classifier that class computes, else its encoder class, the classifier beside it), config.json with the labels,
model.safetensors in the hub's key spelling, and preprocessor_config.json, the checkpoint's preprocessing. timm:
config.json as timm writes it (architecture, num_classes, num_features, global_pool, model_args, pretrained_cfg,
label_names) and model.safetensors. OpenCLIP: timm's layout of its tower (open_clip.open_clip_to_timm).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..model import ViT, ViTConfig
from ..utils import write_atomic
from .common import check_written
from .hf import vit_to_hf_config, vit_to_hf_state_dict, written_architecture
from .open_clip import open_clip_to_timm
from .pretrained import CheckpointInfo, hf_checkpoint, timm_checkpoint
from .timm import vit_to_timm

LIBRARIES = ("transformers", "timm", "open_clip")


def save_pretrained(model: ViT, directory: str | os.PathLike, *, info: CheckpointInfo | None = None) -> Path:
    """Writes `model` (its config, weights and labels) into `directory` in the layout of its source library, and
    returns the directory.

    info: the library, architecture, labels (id2label) and preprocessing to write; default model.checkpoint, which
    vit_triton.from_pretrained sets (dataclasses.replace it for new labels). transformers:
    AutoModelForImageClassification (for a classifier that its family's class computes: ViT, DeiT, DINOv2) or the
    architecture's own class loads it; timm: timm.create_model("local-dir:" + directory, pretrained=True). A model
    read from a two-tower checkpoint (CLIPModel, SiglipModel, Aimv2Model) is written as its vision tower; a
    classifier that the family's transformers class does not compute (CLIP, SigLIP, DINOv3, AIMv2), and AIMv2's
    projection, go beside the encoder as classifier.* and visual_projection.weight, which transformers leaves
    unused. Not written: ViTModel's pooler (no part of our forward; transformers initialises it afresh), and DINOv2's
    and DINOv3's mask token as transformers initialises it (zeros). An OpenCLIP tower is written as timm's CLIP tower,
    its projection as timm's head (a zero bias). Where a layout has no key bias (DINOv3, timm's Eva) the key third of
    qkv.bias is left out: it must be zero where rotary embeddings rotate it (else ValueError).

    Each file is written atomically, the weights first and config.json last. Raises ValueError without info or
    model.checkpoint, for labels that do not fit the classifier, and for a model that the layout cannot hold (naming
    what it would lose). ImportError for a timm layout without timm installed (timm builds the model to name its
    keys).
    """
    info = info if info is not None else getattr(model, "checkpoint", None)
    if info is None:
        raise ValueError("save_pretrained needs the layout to write: a model from vit_triton.from_pretrained (it sets "
                         "model.checkpoint) or info=CheckpointInfo(source, library, architecture, id2label, "
                         f"preprocessing), library one of {', '.join(LIBRARIES)}")
    if info.library not in LIBRARIES:
        raise ValueError(f"unsupported library {info.library!r}; supported: {', '.join(LIBRARIES)}")
    cfg = model.config
    if not set(info.id2label) <= set(range(cfg.num_classes)):
        raise ValueError(f"id2label names classes {sorted(info.id2label)}, expected classes 0 to "
                         f"{cfg.num_classes - 1} (the classifier's rows)")
    directory = Path(directory).expanduser()
    state_dict = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    writer = _transformers if info.library == "transformers" else _timm_layout
    files = writer(cfg, state_dict, info, str(directory))
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        write_atomic(directory / name, lambda f, data=data: f.write(data))
    return directory


def _weights(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    # Each tensor its own contiguous copy: safetensors refuses views that share memory (q, k and v of one qkv).
    return save({k: v.contiguous().clone() for k, v in tensors.items()}, metadata={"format": "pt"})


def _json(config: dict) -> bytes:
    return (json.dumps(config, indent=2) + "\n").encode()


def _transformers(cfg: ViTConfig, state_dict: dict, info: CheckpointInfo, source: str) -> dict[str, bytes]:
    """{file name: bytes} of the transformers layout; ValueError unless they read back as cfg."""
    architecture = written_architecture(info.architecture, cfg)
    labels = {i: info.id2label.get(i, f"LABEL_{i}") for i in range(cfg.num_classes)}
    config = vit_to_hf_config(cfg, architecture, labels)
    tensors = vit_to_hf_state_dict(state_dict, cfg, architecture)
    read_back, _, _ = hf_checkpoint(source, config, tensors, info.preprocessing)
    check_written(cfg, read_back, f"transformers {architecture}")
    files = {"model.safetensors": _weights(tensors)}
    if info.preprocessing:
        files["preprocessor_config.json"] = _json(info.preprocessing)
    return {**files, "config.json": _json(config)}


def _timm_layout(cfg: ViTConfig, state_dict: dict, info: CheckpointInfo, source: str) -> dict[str, bytes]:
    """_transformers' counterpart for timm's layout (an OpenCLIP tower's too)."""
    architecture, pretrained_cfg = info.architecture, dict(info.preprocessing)
    if info.library == "open_clip":
        architecture, cfg, state_dict, pretrained_cfg = open_clip_to_timm(state_dict, cfg, info.preprocessing,
                                                                          architecture)
    model_args, tensors = vit_to_timm(state_dict, cfg, architecture)
    for key in ("label_names", "label_descriptions", "label_offset"):   # the labels are config.json's own
        pretrained_cfg.pop(key, None)
    pretrained_cfg.update(num_classes=cfg.num_classes, input_size=[cfg.in_chans, cfg.image_size, cfg.image_size])
    # num_classes is config.json's own, not a model_arg: transformers' TimmWrapperModel, which reads timm's layout,
    # passes its own beside model_args
    model_args.pop("num_classes")
    config = dict(architecture=architecture, num_classes=cfg.num_classes, num_features=cfg.embed_dim,
                  global_pool=cfg.pool, model_args=model_args, pretrained_cfg=pretrained_cfg)
    if info.id2label:
        config["label_names"] = [info.id2label.get(i, f"LABEL_{i}") for i in range(cfg.num_classes)]
    read_back, _, _ = timm_checkpoint(source, config, tensors)
    check_written(cfg, read_back, f"timm {architecture}")
    return {"model.safetensors": _weights(tensors), "config.json": _json(config)}
