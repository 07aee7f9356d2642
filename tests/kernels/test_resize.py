"""Preprocess.resize_crop_batch (kernels/resize.py) against the CPU path, Preprocess.resize_crop of the same decoded
image: Pillow's resize (timm) or torch's uint8 interpolate (transformers), then the center crop. The kernel
reproduces both fixed-point pipelines, float64 weights included, so every pixel is equal."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from tests.checkpoints import image
from tests.kernels.checks import raises_value_error
from tests.numerics import DEVICE
from vit_triton.data import Preprocess
from vit_triton.kernels import resize_crop

# One batch: downscaled (odd sizes, one wide, two tall: Pillow 13 filters the columns of the narrow one first), and
# one upscaled and smaller than every crop.
SIZES = [(37, 53), (300, 171), (13, 19), (250, 41)]
GRAY = dict(mean=(0.5,), std=(0.5,))   # one channel: Preprocess.channels is the length of the mean

TIMM = {
    "bicubic-0.875": dict(input_size=(3, 32, 32)),
    "bicubic-0.9": dict(input_size=(3, 32, 32), crop_pct=0.9),
    "bicubic-1.0": dict(input_size=(3, 24, 24), crop_pct=1.0),
    "bilinear-squash": dict(input_size=(3, 32, 32), interpolation="bilinear", crop_mode="squash"),
    "keep-ratio-24x40": dict(input_size=(3, 24, 40), crop_pct=0.9),   # non-square: scaled to cover, then cropped
    "lanczos-padded": dict(input_size=(3, 24, 24), interpolation="lanczos", crop_pct=1.2),   # the crop pads
    "box": dict(input_size=(3, 24, 24), interpolation="box"),
    "hamming-gray": dict(input_size=(1, 24, 24), interpolation="hamming", **GRAY),
}
CLIP_PROCESSOR = dict(image_processor_type="CLIPImageProcessor", size={"shortest_edge": 36},
                      crop_size={"height": 32, "width": 32})
HF = {
    "clip": CLIP_PROCESSOR,
    "clip-gray": dict(CLIP_PROCESSOR, image_mean=[0.5], image_std=[0.5]),
    "vit-bilinear": dict(image_processor_type="ViTImageProcessor", size={"height": 40, "width": 33}),
    "siglip": dict(image_processor_type="SiglipImageProcessor", size={"height": 38, "width": 38}),
    "deit": dict(image_processor_type="DeiTImageProcessor", size={"height": 45, "width": 45},
                 crop_size={"height": 32, "width": 32}),
    "deit-padded-bilinear": dict(image_processor_type="DeiTImageProcessor", size={"shortest_edge": 26}, resample=2,
                                 crop_size={"height": 33, "width": 31}),
}


def decoded(img) -> torch.Tensor:
    """A PIL image's pixels as a decoder gives them: uint8 [C, H, W] on DEVICE."""
    pixels = torch.from_numpy(np.array(img))
    return (pixels[None] if pixels.dim() == 2 else pixels.permute(2, 0, 1)).contiguous().to(DEVICE)


def assert_equal_to_cpu_path(pre: Preprocess):
    seed = int(torch.randint(0, 2**16, ()))
    images = [image(seed + i, h, w, "RGB" if pre.channels == 3 else "L") for i, (h, w) in enumerate(SIZES)]
    want = torch.stack([pre.resize_crop(img) for img in images])
    got = pre.resize_crop_batch([decoded(img) for img in images])
    assert got.dtype == torch.uint8 and got.device.type == DEVICE.type and got.shape == want.shape
    diff = (got.cpu().int() - want.int()).abs()
    assert diff.max() == 0, (f"{pre.convention} {pre.resample}: up to {diff.max()} levels apart, "
                             f"{(diff > 0).float().mean():.2e} of the pixels")


@pytest.mark.parametrize("case", TIMM)
def test_equal_to_pillow_resize_and_crop(case):
    assert_equal_to_cpu_path(Preprocess.from_timm(TIMM[case]))


@pytest.mark.parametrize("case", HF)
def test_equal_to_torch_uint8_interpolate_and_crop(case):
    assert_equal_to_cpu_path(Preprocess.from_hf(HF[case]))


def resized(pixels: torch.Tensor, size: tuple[int, int], filter: str, fixed_point: str) -> torch.Tensor:
    """uint8 [C, H, W] resized by the library, its rows filtered first: Pillow's Image.resize (before Pillow 13, and
    in 13 where the height shrinks by at most twice the width), torch's antialiased uint8 interpolate."""
    if fixed_point == "torch":
        return F.interpolate(pixels[None], size=size, mode=filter, antialias=True)[0]
    planes = [Image.fromarray(plane.numpy()).resize(size[::-1], getattr(Image.Resampling, filter.upper()))
              for plane in pixels]
    return torch.stack([torch.from_numpy(np.array(plane)) for plane in planes])


@pytest.mark.parametrize("fixed_point, filter", [("pillow", "lanczos"), ("pillow", "bilinear"), ("torch", "bicubic")])
def test_columns_first_is_rows_first_of_the_transposed_image(fixed_point, filter):
    # A batch of both orders (two launches each): a tall image whose columns go first, a wide one whose rows do,
    # each with a window that pads and one that crops.
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8) for h, w in ((131, 23), (29, 57))]
    geometry = [(37, 9, -2, 3, 1), (11, 19, 2, -1, 0)]   # resized height, width, top, left; columns first
    size = (17, 15)
    table = []
    for image, (rh, rw, top, left, columns_first) in zip(images, geometry):
        table.append([sum(i.numel() for i in images[:len(table)]), *image.shape[1:], rh, rw, top, left, columns_first])
    got = resize_crop(torch.cat([i.flatten() for i in images]).to(DEVICE), torch.tensor(table), 3, size, filter,
                      fixed_point).cpu()
    for image, out, (rh, rw, top, left, columns_first) in zip(images, got, geometry):
        if columns_first:
            want = resized(image.transpose(1, 2).contiguous(), (rw, rh), filter, fixed_point).transpose(1, 2)
        else:
            want = resized(image, (rh, rw), filter, fixed_point)
        # the window: zero-padded by enough, then sliced
        want = F.pad(want, (size[1],) * 2 + (size[0],) * 2)[:, size[0] + top:, size[1] + left:][:, :size[0], :size[1]]
        assert torch.equal(out, want), f"columns first {columns_first}: {(out.int() - want.int()).abs().max()} levels"


def test_nearest_is_left_to_the_cpu():
    timm = Preprocess.from_timm(dict(input_size=(3, 24, 24), interpolation="nearest"))
    hf = Preprocess.from_hf(dict(image_processor_type="ViTImageProcessor", resample=0))
    assert not timm.gpu_supported and not hf.gpu_supported
    assert Preprocess.from_timm(TIMM["box"]).gpu_supported and Preprocess.from_hf(CLIP_PROCESSOR).gpu_supported
    with raises_value_error("resize_crop_batch does every resample but 'nearest' (see gpu_supported), got 'nearest'"):
        hf.resize_crop_batch([pixels(3, 9, 9)])


def pixels(*shape: int) -> torch.Tensor:
    """A uint8 tensor whose values no test reads: the bad-input cases, rejected before any launch."""
    return torch.zeros(shape, dtype=torch.uint8, device=DEVICE)


@pytest.mark.parametrize("images, message", [
    ([], "images must hold at least one image, got an empty list"),
    ([pixels(3, 9, 9).float()], "images[0] must be a contiguous torch.uint8 tensor [3, H, W], got torch.float32 of "
                                "shape (3, 9, 9)"),
    ([pixels(3, 9, 9), pixels(1, 9, 9)], "images[1] must be a contiguous torch.uint8 tensor [3, H, W], got "
                                         "torch.uint8 of shape (1, 9, 9)"),
    ([pixels(9, 9)], "images[0] must be a contiguous torch.uint8 tensor [3, H, W], got torch.uint8 of shape (9, 9)"),
    ([pixels(9, 8, 3).permute(2, 0, 1)], "images[0] must be a contiguous torch.uint8 tensor [3, H, W], got "
                                         "torch.uint8 of shape (3, 9, 8) and strides (1, 24, 3)"),
])
def test_bad_images(images, message):
    with raises_value_error(message):
        Preprocess.from_timm(TIMM["box"]).resize_crop_batch(images)


TABLE = [[0, 5, 6, 4, 4, 0, 0, 0]]   # one 3 x 5 x 6 image, resized to 4 x 4, uncropped, rows filtered first


@pytest.mark.parametrize("change, message", [
    (dict(pixels=pixels(90).float()), "pixels must be a contiguous 1-D torch.uint8 tensor, got torch.float32 of "
                                      "shape (90,)"),
    (dict(pixels=pixels(3, 30)), "pixels must be a contiguous 1-D torch.uint8 tensor, got torch.uint8 of shape "
                                 "(3, 30)"),
    (dict(table=torch.tensor(TABLE, dtype=torch.int32)), "table must be an int64 CPU tensor [B, 8] of (offset, height, "
                                                         "width, resized height, resized width, top, left, columns "
                                                         "first), got torch.int32 of shape (1, 8)"),
    (dict(table=torch.tensor(TABLE)[:, :7]), "table must be an int64 CPU tensor [B, 8]"),
    (dict(table=torch.zeros(0, 8, dtype=torch.int64)), "table must have a row for at least one image, got none"),
    (dict(table=torch.tensor([[1, 5, 6, 4, 4, 0, 0, 0]])), "table row 0: the sizes must be positive, the image's 3 x "
                                                           "height x width pixels from its offset must lie in the 90 "
                                                           "of pixels and the order must be 0 or 1, got [1, 5, 6, 4, "
                                                           "4, 0, 0, 0]"),
    (dict(table=torch.tensor(TABLE + [[60, 5, 6, 4, 4, 0, 0, 0]])), "table row 1: the sizes must be positive"),
    (dict(table=torch.tensor([[0, 5, 6, 0, 4, 0, 0, 0]])), "table row 0: the sizes must be positive"),
    (dict(table=torch.tensor([[0, 5, 6, 4, 4, 0, 0, 2]])), "table row 0: the sizes must be positive"),
    (dict(size=(0, 4)), "channels and size must be positive, got 3 and (0, 4)"),
    (dict(filter="nearest"), "filter must be one of ('box', 'bilinear', 'hamming', 'bicubic', 'lanczos'), got "
                             "'nearest'"),
    (dict(fixed_point="opencv"), "fixed_point must be one of ('pillow', 'torch'), got 'opencv'"),
])
def test_bad_input(change, message):
    args = dict(pixels=pixels(90), table=torch.tensor(TABLE), channels=3, size=(4, 4), filter="bicubic",
                fixed_point="torch") | change
    with raises_value_error(message):
        resize_crop(**args)
