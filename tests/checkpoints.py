"""Test-side helpers: tiny checkpoints saved the way transformers and timm save them, image files and tar shards."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tests.numerics import randomize_

TINY_HF = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=96,
               image_size=32, patch_size=8)
# timm's own architecture names, shrunk by the arguments a user would pass to create_model.
TINY_TIMM = dict(img_size=32, patch_size=8, depth=2)


def seeded(build, seed: int = 0) -> torch.nn.Module:
    """build(), a model with random weights, randomized (randomize_), as a function of `seed` alone: its
    initialisation draws from a generator seeded here, not from the global one, whose state depends on which tests
    ran before (a test passing or failing by its place in the run)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return randomize_(build(), seed=seed).eval()


def hf_model(cls_name: str, seed: int = 0, depth: int = TINY_HF["num_hidden_layers"], **kw) -> torch.nn.Module:
    """A randomized transformers model of TINY_HF's shape with `depth` blocks (a CLIPModel, SiglipModel or
    Aimv2Model: its vision tower's, with a small text tower), in eval mode."""
    import transformers

    cls = getattr(transformers, cls_name)
    vision = {**TINY_HF, "num_hidden_layers": depth}
    if cls in (transformers.CLIPModel, transformers.SiglipModel, transformers.Aimv2Model):
        text = dict(hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2)
        config = cls.config_class(vision_config=vision, text_config=text, **kw)
    else:
        config = cls.config_class(**{**vision, **kw})
    return seeded(lambda: cls(config), seed)


def family_outputs(model, pixels):
    """A transformers DINOv2, DINOv3, CLIP, SigLIP, ViT-MAE, AIMv2, Idefics3, SmolVLM, InternVL, BEiT or
    data2vec-vision encoder's last_hidden_state, the image embedding its library defines, and the pooled features
    before a projection; at any input size, as each resamples its position embedding (interpolate_pos_encoding;
    DINOv2, Idefics3, SmolVLM and InternVL always do; AIMv2 cannot, but for its native checkpoints' sin-cos table,
    built for any grid; BEiT's and data2vec-vision's relative position bias at the checkpoint's grid only). Where a
    model has no pooler_output (AIMv2 and SigLIP without their heads, Idefics3, SmolVLM), the mean of
    last_hidden_state stands for it (what timm's AIMv2 pools, and vit-triton); InternVL's, and data2vec-vision's
    without a pooler, is the one their docs give: the mean of the patch tokens (use_mean_pooling), else the class
    token."""
    import transformers

    # DINOv2 always resamples its position embedding; DINOv3 has none; BEiT and data2vec-vision run at their own grid
    # here; the others take no such argument
    fixed = ("Dinov2", "DINOv3", "Aimv2", "Idefics3", "SmolVLM", "InternVL", "Beit", "Data2VecVision")
    any_size = {} if type(model).__name__.startswith(fixed) else {"interpolate_pos_encoding": True}

    if isinstance(model, transformers.ViTMAEModel):   # no masking: mask_ratio 0 and the patches kept in order
        patches = (pixels.shape[2] // model.config.patch_size) * (pixels.shape[3] // model.config.patch_size)
        noise = torch.arange(patches, device=pixels.device).expand(len(pixels), -1)
        features = model(pixels, noise=noise.to(pixels.dtype), **any_size).last_hidden_state
        return features, features[:, 0], features[:, 0]
    if isinstance(model, (transformers.CLIPModel, transformers.CLIPVisionModelWithProjection, transformers.Aimv2Model)):
        out = model.vision_model(pixels, **any_size)
        return out.last_hidden_state, model.visual_projection(out.pooler_output), out.pooler_output
    out = (model.vision_model if isinstance(model, transformers.SiglipModel) else model)(pixels, **any_size)
    features = out.last_hidden_state
    pooled = getattr(out, "pooler_output", None)   # SmolVLM's output class has none in transformers 5.17
    if pooled is None and hasattr(model.config, "use_mean_pooling"):   # InternVL, data2vec-vision without a pooler
        pooled = features[:, 1:].mean(1) if model.config.use_mean_pooling else features[:, 0]
    pooled = features.mean(1) if pooled is None else pooled
    return features, pooled, pooled


def save_hf(model: torch.nn.Module, directory: Path, processor: dict | None = None, **save_kw) -> Path:
    """save_pretrained, plus a preprocessor_config.json written by the processor class itself."""
    import transformers

    model.save_pretrained(directory, **save_kw)
    if processor is not None:
        name = type(model).__name__
        cls = transformers.DeiTImageProcessor if name.startswith("DeiT") else transformers.CLIPImageProcessor \
            if name.startswith(("CLIP", "Aimv2")) else transformers.ViTImageProcessor
        cls(**processor).save_pretrained(directory)
    return directory


def timm_model(name: str, seed: int = 0, **kw) -> torch.nn.Module:
    import timm

    args = {**TINY_TIMM, **kw}
    model = seeded(lambda: timm.create_model(name, pretrained=False, **args), seed)
    model.create_args = args   # for save_timm: timm before 1.0.31 records no model_args
    return model


def save_timm(model: torch.nn.Module, directory: Path, weights: str = "model.safetensors",
              model_args: bool = True, **config) -> Path:
    """The layout of a timm hub repository: config.json (architecture, pretrained_cfg and, as timm
    records it now, model_args; without them as older hub configs are) and the weights."""
    from safetensors.torch import save_file
    from timm.models._hub import save_config_for_hf

    directory.mkdir(parents=True, exist_ok=True)
    save_config_for_hf(model, directory / "config.json")   # a Path: timm 1.0.29 calls .open() on it
    cfg = json.loads((directory / "config.json").read_text())
    # What timm 1.0.31 writes, and older versions did not: the input size of the model (they wrote the
    # architecture's default) and the arguments it was created with.
    cfg["pretrained_cfg"]["input_size"] = [model.patch_embed.proj.in_channels, *model.patch_embed.img_size]
    cfg.setdefault("model_args", model.create_args)
    if not model_args:
        cfg.pop("model_args", None)
    cfg.update(config)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if weights.endswith(".safetensors"):
        save_file(sd, directory / weights)
    else:
        torch.save(sd, directory / weights)
    return directory


# OpenCLIP towers whose trunk is a timm model, as OpenCLIP's TimmModel makes them: the trunk's head as the
# projection (EVA02-CLIP, PE-Core), or none (SigLIP), or a projection after the trunk (timm_proj "linear")
OPEN_CLIP_TIMM = {
    "eva02-clip-head": ("eva02_base_patch16_clip_224", "token", None),
    "pe-core-map-head": ("vit_pe_core_tiny_patch16_384", "map", None),
    "siglip-map-no-projection": ("vit_base_patch16_siglip_224", "map", "none"),
    "vit-linear-projection": ("vit_medium_patch16_gap_256", "", "linear"),
}


def open_clip_timm_tower(directory: Path, case: str, monkeypatch) -> torch.nn.Module:
    """A randomized OpenCLIP model of OPEN_CLIP_TIMM's `case`, in eval mode, saved in `directory` as OpenCLIP's hub
    repositories are. OpenCLIP's TimmModel passes timm no sizes: for the test, timm.create_model makes every
    architecture tiny (monkeypatch), for OpenCLIP and the loader alike."""
    import pytest
    import timm
    from safetensors.torch import save_file

    open_clip = pytest.importorskip("open_clip")   # a test extra
    name, pool, proj = OPEN_CLIP_TIMM[case]
    if not timm.is_model(name):
        pytest.skip(f"this timm has no {name}")
    create = timm.create_model
    tiny = dict(img_size=32, patch_size=8, embed_dim=64, num_heads=2, depth=1)
    monkeypatch.setattr(timm, "create_model", lambda arch, **kw: create(arch, **{
        **tiny, **(dict(attn_pool_num_heads=4) if arch.startswith("vit_pe_core") else {}), **kw}))
    model_cfg = dict(embed_dim=40, vision_cfg=dict(image_size=32, timm_model_name=name, timm_pool=pool,
                                                   timm_proj=proj, timm_proj_bias=proj == "linear"),
                     text_cfg=dict(context_length=8, vocab_size=50, width=32, heads=2, layers=1))
    ref = seeded(lambda: open_clip.CLIP(**model_cfg))
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "open_clip_config.json").write_text(json.dumps(dict(model_cfg=model_cfg, preprocess_cfg={})))
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()}, directory / "open_clip_model.safetensors")
    return ref


def image(seed: int, height: int, width: int, mode: str = "RGB") -> Image.Image:
    """A smooth gradient with noise, so that resampling filters differ from each other."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([np.sin(x / (5.0 + c) + seed) * 90 + np.cos(y / 6.0) * 40 + 120 for c in range(3)], -1)
    pixels = np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels).convert(mode)


def write_images(directory: Path, count: int, start: int = 0) -> list[Path]:
    """`count` good images of assorted sizes, alternating PNG and JPEG, some in a subfolder."""
    paths = []
    for i in range(start, start + count):
        sub = directory / ("sub" if i % 3 == 2 else "")
        sub.mkdir(parents=True, exist_ok=True)
        path = sub / f"img{i:03d}.{'png' if i % 2 else 'jpg'}"
        image(i, 30 + 7 * (i % 5), 28 + 11 * (i % 4)).save(path)
        paths.append(path)
    return paths


def write_bad_files(directory: Path) -> dict[Path, str]:
    """One file of each kind a run must skip, with the start of the reason it must give."""
    directory.mkdir(parents=True, exist_ok=True)
    jpeg, png = io.BytesIO(), io.BytesIO()
    image(99, 40, 40).save(jpeg, "JPEG")
    image(98, 40, 40).save(png, "PNG")
    corrupt = bytearray(png.getvalue())
    middle = len(corrupt) // 2
    corrupt[middle:middle + 64] = bytes(b ^ 0x5A for b in corrupt[middle:middle + 64])
    bad = {
        directory / "empty.jpg": b"",
        directory / "notes.txt": b"not an image at all\n",
        directory / "truncated.jpg": jpeg.getvalue()[: len(jpeg.getvalue()) // 2],
        directory / "corrupt.png": bytes(corrupt),
    }
    for path, data in bad.items():
        path.write_bytes(data)
    reasons = ["empty file", "not an image", "truncated or corrupt", "truncated or corrupt"]
    return dict(zip(bad, reasons))


def write_shard(path: Path, members: list[tuple[str, bytes]]) -> bytes:
    """A tar shard as webdataset and img2dataset write it, of (member name, bytes) in order; returns its bytes."""
    import tarfile

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buffer.getvalue())
    return buffer.getvalue()
