"""A checkpoint's own preprocessing, reproduced operation for operation so that the pixels are equal.

Two conventions, as the libraries implement them:

- transformers (ViT, DeiT, CLIP (AIMv2's too), BiT (DINOv2's) and SigLIP image processors, with the torchvision
  backend that AutoImageProcessor picks in transformers 5): the uint8 image is resized by torch's antialiased
  `interpolate` (in uint8 where torchvision does so, else in float32 then rounded), center-cropped
  with the offset rounded down, and normalized as (x - mean/rescale) / (std/rescale) in float32.
- timm (`create_transform(**resolve_data_config(...))`, the eval transform): Pillow resizes the
  shorter side to floor(size / crop_pct) (crop_mode "center"; for a non-square size, the image just
  covers floor(side / crop_pct) on both sides, aspect kept) or both sides ("squash"), the center
  crop offset is rounded to nearest, then (x / 255 - mean) / std in float32. OpenCLIP's eval transform
  is the same torchvision pipeline (its preprocess_cfg: the shorter side to the image size, or "squash").

The work is split where it is cheapest to move: `resize_crop` (PIL image -> uint8 [C, H, W]) runs in
the DataLoader workers, and `normalize` (uint8 [..., C, H, W] -> float32) on the device, so a quarter
of the bytes cross to the GPU and the float arithmetic, elementwise and correctly rounded, is the same
there as on the CPU. Images decoded on the GPU are resized and cropped there, a batch at a time, by
`resize_crop_batch` (kernels/resize.py), to the same pixels.
"""

from __future__ import annotations

import math
import platform
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import NamedTuple

import numpy as np
import PIL
import torch
import torch.nn.functional as F
from PIL import Image

from .decode import upright

IMAGENET_DEFAULT_MEAN = (0.485, 0.456, 0.406)
IMAGENET_DEFAULT_STD = (0.229, 0.224, 0.225)
IMAGENET_STANDARD_MEAN = (0.5, 0.5, 0.5)
IMAGENET_STANDARD_STD = (0.5, 0.5, 0.5)
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

CONVENTIONS = ("transformers", "timm")
_PIL_FILTERS = {
    "nearest": Image.Resampling.NEAREST, "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC, "box": Image.Resampling.BOX,
    "hamming": Image.Resampling.HAMMING, "lanczos": Image.Resampling.LANCZOS,
}
# transformers' `resample` is a PIL enum value; its torchvision backend supports these three.
_HF_RESAMPLE = {0: "nearest", 2: "bilinear", 3: "bicubic"}
# Image processor classes by the name in preprocessor_config.json, with their class defaults.
_HF_PROCESSORS = {
    "ViTImageProcessor": dict(do_resize=True, size={"height": 224, "width": 224}, resample=2,
                              do_center_crop=False, crop_size=None),
    "DeiTImageProcessor": dict(do_resize=True, size={"height": 256, "width": 256}, resample=3,
                               do_center_crop=True, crop_size={"height": 224, "width": 224}),
    **{name: dict(do_resize=True, size={"shortest_edge": 224}, resample=3, do_center_crop=True,
                  crop_size={"height": 224, "width": 224}, image_mean=OPENAI_CLIP_MEAN, image_std=OPENAI_CLIP_STD)
       for name in ("CLIPImageProcessor", "BitImageProcessor")},
    **{name: dict(do_resize=True, size={"height": 224, "width": 224}, resample=3, do_center_crop=False,
                  crop_size=None) for name in ("SiglipImageProcessor", "BeitImageProcessor")},
    # DINOv3's rescales before it resizes (a float image, never rounded to uint8); here the resize comes first,
    # on uint8 as the others': each pixel within one uint8 step (before normalizing) of transformers'
    "DINOv3ViTImageProcessor": dict(do_resize=True, size={"height": 224, "width": 224}, resample=2,
                                    do_center_crop=False, crop_size=None, image_mean=IMAGENET_DEFAULT_MEAN,
                                    image_std=IMAGENET_DEFAULT_STD),
}
# The processor a transformers architecture gets without a preprocessor_config.json, by name prefix.
_HF_DEFAULT_PROCESSORS = {"DeiT": "DeiTImageProcessor", "CLIP": "CLIPImageProcessor", "Dinov2": "BitImageProcessor",
                          "Siglip": "SiglipImageProcessor", "DINOv3": "DINOv3ViTImageProcessor",
                          "Aimv2": "CLIPImageProcessor", "Beit": "BeitImageProcessor",
                          "Data2VecVision": "BeitImageProcessor"}
OPEN_CLIP_RESIZE_MODES = ("shortest", "squash")
_HF_COMMON = dict(do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
                  image_mean=IMAGENET_STANDARD_MEAN, image_std=IMAGENET_STANDARD_STD)
TIMM_CROP_MODES = ("center", "squash")
# Pillow 13's resize filters the columns first where the height shrinks by more than twice the width (Resample.c's
# horizontal_first), earlier versions always the rows first, as torch does.
_PILLOW_MAY_FILTER_COLUMNS_FIRST = int(PIL.__version__.split(".")[0]) >= 13


class Geometry(NamedTuple):
    """An image resized to height x width, then the window of Preprocess.size at (top, left) in it."""

    height: int
    width: int
    top: int
    left: int


@dataclass(frozen=True)
class Preprocess:
    """Image -> pixel tensor [C, H, W] as the checkpoint's own preprocessing makes it.

    resize: (height, width), or an int that the shorter side is resized to (aspect kept), or None.
    keep_ratio: a (height, width) resize scales the image, aspect kept, by the least factor that makes it cover
    that size, each side rounded (timm's ResizeKeepRatio, before a non-square center crop).
    crop: (height, width) of the center crop (zero-padded where the image is smaller), or None.
    rescale: the factor uint8 values are multiplied by (transformers; timm always divides by 255).
    mean, std: per-channel normalization after rescaling, or None for none.
    """

    convention: str
    resize: tuple[int, int] | int | None
    resample: str
    crop: tuple[int, int] | None
    rescale: float | None
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None
    keep_ratio: bool = False

    def __post_init__(self) -> None:
        if self.convention not in CONVENTIONS:
            raise ValueError(f"convention must be one of {CONVENTIONS}, got {self.convention!r}")
        supported = _PIL_FILTERS if self.convention == "timm" else _HF_RESAMPLE.values()
        if self.resample not in supported:
            raise ValueError(f"unsupported {self.convention} resample {self.resample!r}; supported: "
                             f"{', '.join(supported)}")
        if self.crop is None and (not isinstance(self.resize, tuple) or self.keep_ratio):
            raise ValueError("preprocessing must give a fixed image size: resize to (height, width) or crop")
        if (self.mean is None) != (self.std is None):
            raise ValueError("mean and std go together")

    @property
    def size(self) -> tuple[int, int]:
        """(height, width) of the pixels this preprocessing produces."""
        return self.crop or self.resize

    @property
    def channels(self) -> int:
        return len(self.mean) if self.mean is not None else 3

    @property
    def mode(self) -> str:
        """The PIL mode images are decoded to: "L" for a one-channel model, else "RGB"."""
        return "L" if self.channels == 1 else "RGB"

    # -- construction from a checkpoint's configuration --

    @classmethod
    def from_hf(cls, processor_config: dict, architecture: str = "ViTModel",
                image_size: int | None = None) -> Preprocess:
        """From preprocessor_config.json; an empty dict gives the defaults, at `image_size`, of the architecture's
        processor (_HF_DEFAULT_PROCESSORS; ViTImageProcessor for the rest)."""
        default = next((p for prefix, p in _HF_DEFAULT_PROCESSORS.items() if architecture.startswith(prefix)),
                       "ViTImageProcessor")
        kind = processor_config.get("image_processor_type") or processor_config.get("feature_extractor_type") or default
        name = kind.replace("FeatureExtractor", "ImageProcessor").removesuffix("Fast").removesuffix("Pil")
        if name not in _HF_PROCESSORS:
            raise ValueError(f"unsupported image processor {kind!r}; supported: {', '.join(_HF_PROCESSORS)} "
                             f"(and their FeatureExtractor, Fast and Pil spellings)")
        c = {**_HF_COMMON, **_HF_PROCESSORS[name]}
        if not processor_config and image_size:
            c["size"] = image_size * 256 // 224 if c["do_center_crop"] else image_size
            c["crop_size"] = image_size
        c.update({k: v for k, v in processor_config.items() if v is not None})
        if c["resample"] not in _HF_RESAMPLE:
            raise ValueError(f"unsupported resample {c['resample']!r} in the image processor; supported: "
                             + ", ".join(f"{k} ({v})" for k, v in _HF_RESAMPLE.items()))
        return cls(
            convention="transformers",
            resize=_hf_size(c["size"], "size", shortest_edge_ok=True) if c["do_resize"] else None,
            resample=_HF_RESAMPLE[c["resample"]],
            crop=_hf_size(c["crop_size"], "crop_size") if c["do_center_crop"] else None,
            rescale=c["rescale_factor"] if c["do_rescale"] else None,
            mean=tuple(c["image_mean"]) if c["do_normalize"] else None,
            std=tuple(c["image_std"]) if c["do_normalize"] else None,
        )

    @classmethod
    def from_timm(cls, pretrained_cfg: dict, image_size: int | None = None) -> Preprocess:
        """From a timm pretrained_cfg (config.json's "pretrained_cfg"), resolved as timm's
        resolve_data_config does; missing entries take timm's defaults (input size: `image_size`)."""
        input_size = pretrained_cfg.get("input_size") or (3, image_size or 224, image_size or 224)
        height, width = input_size[-2:]
        crop_pct = pretrained_cfg.get("crop_pct") or 0.875
        crop_mode = pretrained_cfg.get("crop_mode") or "center"
        if crop_mode not in TIMM_CROP_MODES:
            raise ValueError(f"unsupported timm crop_mode {crop_mode!r}; supported: {', '.join(TIMM_CROP_MODES)}")
        scale = (math.floor(height / crop_pct), math.floor(width / crop_pct))
        center = crop_mode == "center"
        return cls(
            convention="timm",
            resize=scale[0] if center and scale[0] == scale[1] else scale,
            keep_ratio=center and scale[0] != scale[1],
            resample=pretrained_cfg.get("interpolation") or "bicubic",
            crop=(height, width),
            rescale=1 / 255,
            mean=tuple(pretrained_cfg.get("mean") or IMAGENET_DEFAULT_MEAN),
            std=tuple(pretrained_cfg.get("std") or IMAGENET_DEFAULT_STD),
        )

    @classmethod
    def from_open_clip(cls, preprocess_cfg: dict, image_size: int | tuple[int, int]) -> Preprocess:
        """From OpenCLIP's preprocess_cfg (open_clip_config.json), as open_clip.image_transform builds its eval
        transform for image_size (an int or (height, width)): the shorter side resized to it and a center crop
        ("shortest"; a non-square size: the least bicubic resize that covers it, aspect kept), or both sides
        ("squash"); then (x / 255 - mean) / std."""
        mode = preprocess_cfg.get("resize_mode") or "shortest"
        interpolation = preprocess_cfg.get("interpolation") or "bicubic"
        if mode not in OPEN_CLIP_RESIZE_MODES or interpolation not in ("bicubic", "bilinear"):
            raise ValueError(f"unsupported OpenCLIP resize_mode {mode!r} or interpolation {interpolation!r}; "
                             f"supported: {', '.join(OPEN_CLIP_RESIZE_MODES)}, and bicubic or bilinear")
        size = _pair(image_size)
        shortest, square = mode == "shortest", size[0] == size[1]
        return cls(
            convention="timm",
            resize=size[0] if shortest and square else size,
            keep_ratio=shortest and not square,
            resample=interpolation if square or not shortest else "bicubic",
            crop=size if shortest else None,
            rescale=1 / 255,
            mean=tuple(preprocess_cfg.get("mean") or OPENAI_CLIP_MEAN),
            std=tuple(preprocess_cfg.get("std") or OPENAI_CLIP_STD),
        )

    @classmethod
    def for_model(cls, model: torch.nn.Module, image_size: int | tuple[int, int] | None = None) -> Preprocess:
        """The preprocessing of the checkpoint a model was loaded from by vit_triton.from_pretrained.

        image_size: an int or (height, width) to make images of that size instead of the checkpoint's (the model
        runs any multiple of its patch size): timm's eval transform at input_size (C, height, width), as
        resolve_data_config(args={"input_size": ...}) gives it (resize to the size / crop_pct, then center
        crop); the transformers processor with crop_size {"height", "width"} and the resize scaled as the crop
        is, side by side (an int resize as the crop's longer side), or, without a crop, size {"height", "width"}.
        """
        info = getattr(model, "checkpoint", None)
        if info is None:
            raise ValueError("the model was not loaded by vit_triton.from_pretrained, so its preprocessing is "
                             "unknown: build one with Preprocess.from_hf or Preprocess.from_timm")
        native = model.config.image_size
        if info.library == "timm":
            config = info.preprocessing
            if image_size is not None:
                config = {**config, "input_size": (model.config.in_chans, *_pair(image_size))}
            pre = cls.from_timm(config, native)
        elif info.library == "open_clip":
            pre = cls.from_open_clip(info.preprocessing, native if image_size is None else image_size)
        else:
            pre = cls.from_hf(info.preprocessing, info.architecture, native)
            if image_size is not None:
                pre = pre._hf_at(_pair(image_size))
        if image_size is None and pre.size != (native, native):
            raise ValueError(f"the checkpoint's preprocessing gives {pre.size[0]}x{pre.size[1]} images but the model "
                             f"takes {native}x{native}")
        model.grid(*pre.size)   # a size the model runs: multiples of its patch size
        return pre

    def _hf_at(self, size: tuple[int, int]) -> Preprocess:
        """This transformers preprocessing making `size` images: the crop becomes `size` and the resize is scaled
        as the crop is (floor), or without a crop the resize becomes `size`."""
        if self.crop is None:
            return replace(self, resize=size)
        if isinstance(self.resize, tuple):
            resize = tuple(r * new // old for r, new, old in zip(self.resize, size, self.crop))
        else:
            resize = self.resize * max(size) // max(self.crop)
        return replace(self, resize=resize, crop=size)

    # -- applying it --

    def geometry(self, height: int, width: int) -> Geometry:
        """Where resize_crop puts an image of height x width: the size it is resized to, and the top-left corner, in
        the resized image, of the `size` window it keeps (negative, or past the far edge: zero padding there)."""
        if self.resize is not None:
            height, width = _resized_size(height, width, self.resize, self.keep_ratio)
        if self.crop is None:
            return Geometry(height, width, 0, 0)
        # timm (torchvision.transforms.CenterCrop) rounds the offset, transformers truncates it; a crop larger than
        # the image pads it, the odd row or column at the bottom or right.
        to_int = round if self.convention == "timm" else int
        top, left = (-((crop - side) // 2) if crop > side else int(to_int((side - crop) / 2.0))
                     for side, crop in zip((height, width), self.crop))
        return Geometry(height, width, top, left)

    def resize_crop(self, image: Image.Image) -> torch.Tensor:
        """Resize and center-crop a PIL image, first turned upright and converted to `mode` as a decoded file is
        (decode.upright): uint8 [C, H, W], contiguous. TypeError for anything but a PIL image."""
        if not isinstance(image, Image.Image):
            raise TypeError(f"Preprocess takes a PIL image, got {type(image).__name__} (uint8 pixels [C, H, W] go to "
                            f"normalize)")
        image = upright(image, self.mode)
        g = self.geometry(image.height, image.width)
        if self.convention == "timm":
            if (g.height, g.width) != (image.height, image.width):
                image = image.resize((g.width, g.height), _PIL_FILTERS[self.resample])
            pixels = _to_uint8_chw(image)
        else:
            pixels = _resize_like_torchvision(_to_uint8_chw(image), (g.height, g.width), self.resample)
        return _window(pixels, g.top, g.left, self.size)

    @property
    def gpu_supported(self) -> bool:
        """Whether resize_crop_batch does this preprocessing: every resample but "nearest"."""
        return self.resample != "nearest"

    def resize_crop_batch(self, images: list[torch.Tensor]) -> torch.Tensor:
        """resize_crop of decoded images, the whole batch in a few launches: uint8 [C, H_i, W_i] tensors (C =
        channels), contiguous, on one device (CUDA, or the CPU under TRITON_INTERPRET=1) -> uint8 [B, C, height,
        width] there, equal to resize_crop's pixels (transformers' resize as torch's uint8 kernel computes it, which
        resize_crop runs but for bilinear on x86 CPUs without AVX2)."""
        from ..kernels.resize import resize_crop   # defining a kernel reads TRITON_INTERPRET: on first use

        if not self.gpu_supported:
            raise ValueError("resize_crop_batch does every resample but 'nearest' (see gpu_supported), got "
                             f"{self.resample!r}: use resize_crop")
        if not images:
            raise ValueError("images must hold at least one image, got an empty list")
        rows = []
        offset = 0
        for i, image in enumerate(images):
            if (image.dtype != torch.uint8 or image.dim() != 3 or image.shape[0] != self.channels
                    or not image.is_contiguous()):
                raise ValueError(f"images[{i}] must be a contiguous torch.uint8 tensor [{self.channels}, H, W], got "
                                 f"{image.dtype} of shape {tuple(image.shape)} and strides {image.stride()}")
            if image.device != images[0].device:
                raise ValueError(f"images must be on one device: images[0] is on {images[0].device}, images[{i}] "
                                 f"on {image.device}")
            height, width = image.shape[1:]
            g = self.geometry(height, width)
            shrink = height - g.height
            columns_first = (self.convention == "timm" and _PILLOW_MAY_FILTER_COLUMNS_FIRST and shrink > 0
                             and shrink > 2 * (width - g.width))
            rows.append((offset, height, width, *g, int(columns_first)))
            offset += image.numel()
        pixels = images[0].view(-1) if len(images) == 1 else torch.cat([image.view(-1) for image in images])
        return resize_crop(pixels, torch.tensor(rows, dtype=torch.int64), self.channels, self.size, self.resample,
                           "pillow" if self.convention == "timm" else "torch")

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 [..., C, H, W] on any device -> float32, in the checkpoint library's order of operations."""
        x = pixels.to(torch.float32)
        if self.convention == "timm":
            x = x.div_(255)
            if self.mean is None:
                return x
        elif self.mean is None:
            return x.mul_(self.rescale) if self.rescale is not None else x
        mean, std = _stats(self.convention, self.mean, self.std, self.rescale, pixels.device)
        return x.sub_(mean).div_(std)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """float32 pixels [C, H, W] of a PIL image (resize_crop, then normalize)."""
        return self.normalize(self.resize_crop(image))


def _hf_size(size, name: str, shortest_edge_ok: bool = False) -> tuple[int, int] | int:
    """A transformers size (int, [h, w] or dict) as (height, width), or an int shorter side."""
    if isinstance(size, int):  # ViT and DeiT processors read a bare int as a square
        return (size, size)
    if isinstance(size, (list, tuple)) and len(size) == 2:
        return (int(size[0]), int(size[1]))
    if isinstance(size, dict):
        if size.keys() == {"height", "width"}:
            return (size["height"], size["width"])
        if shortest_edge_ok and size.keys() == {"shortest_edge"}:
            return size["shortest_edge"]
    raise ValueError(f"unsupported image processor {name} {size!r}; supported: an int, "
                     f"{{'height', 'width'}}" + (", {'shortest_edge'}" if shortest_edge_ok else ""))


def _pair(size: int | tuple[int, int]) -> tuple[int, int]:
    """An image size given as an int (a square) or (height, width), as (height, width)."""
    return (size, size) if isinstance(size, int) else (int(size[0]), int(size[1]))


def _resized_size(height: int, width: int, size: tuple[int, int] | int, keep_ratio: bool) -> tuple[int, int]:
    if keep_ratio:   # timm's ResizeKeepRatio: the least scale that covers `size`
        ratio = min(height / size[0], width / size[1])
        return round(height / ratio), round(width / ratio)
    if isinstance(size, tuple):
        return size
    # The shorter side becomes `size`, the longer one is truncated (torchvision, transformers alike).
    if width <= height:
        return int(size * height / width), size
    return size, int(size * width / height)


def _to_uint8_chw(image: Image.Image) -> torch.Tensor:
    pixels = torch.from_numpy(np.array(image))
    return pixels.unsqueeze(0) if pixels.dim() == 2 else pixels.permute(2, 0, 1)


def _resize_like_torchvision(pixels: torch.Tensor, size: tuple[int, int], mode: str) -> torch.Tensor:
    """torchvision.transforms.v2.functional.resize of a uint8 CPU image, antialiased."""
    if tuple(pixels.shape[-2:]) == size:
        return pixels
    x = pixels.contiguous()[None]
    if mode == "nearest":  # transformers maps PIL's NEAREST to torchvision's NEAREST_EXACT
        return F.interpolate(x, size=size, mode="nearest-exact")[0]
    # torchvision resizes uint8 natively for bicubic, and for bilinear only where its kernel is vectorised.
    native = mode == "bicubic" or (torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
                                   or platform.machine() in ("aarch64", "arm64"))
    if native:
        return F.interpolate(x, size=size, mode=mode, align_corners=False, antialias=True)[0]
    y = F.interpolate(x.to(torch.float32), size=size, mode=mode, align_corners=False, antialias=True)
    if mode == "bicubic":
        y = y.clamp_(0, 255)
    return y.round_().to(torch.uint8)[0]


def _window(pixels: torch.Tensor, top: int, left: int, size: tuple[int, int]) -> torch.Tensor:
    """pixels[..., top:top + height, left:left + width] for size (height, width), zero where it leaves the image."""
    height, width = size
    h, w = pixels.shape[-2:]
    if top >= 0 and left >= 0 and top + height <= h and left + width <= w:
        return pixels[..., top:top + height, left:left + width].clone(memory_format=torch.contiguous_format)
    out = pixels.new_zeros((*pixels.shape[:-2], height, width))
    r0, c0 = max(top, 0), max(left, 0)
    r1, c1 = max(min(top + height, h), r0), max(min(left + width, w), c0)
    out[..., r0 - top:r1 - top, c0 - left:c1 - left] = pixels[..., r0:r1, c0:c1]
    return out


@lru_cache(maxsize=16)
def _stats(convention: str, mean: tuple[float, ...], std: tuple[float, ...], rescale: float | None,
           device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """mean and std as float32 [C, 1, 1]; transformers folds the rescale into them (x - m/r) / (s/r)."""
    m, s = torch.tensor(mean), torch.tensor(std)
    if convention == "transformers" and rescale is not None:
        m, s = m * (1.0 / rescale), s * (1.0 / rescale)
    return m.view(-1, 1, 1).to(device), s.view(-1, 1, 1).to(device)
