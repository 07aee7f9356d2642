"""patch_embed against F.conv2d + flatten + prefix tokens + position embedding, in timm's order."""

import pytest
import torch

from tests.numerics import DEVICE, DTYPES, assert_matches_torch
from vit_triton.bench.workloads import patch_embed_torch
from vit_triton.kernels import patch_embed

# (batch, channels, height, width, patch, prefix tokens, pos_embed covers: "all" | "patches" | None, bias)
CASES = [
    (1, 3, 32, 48, 16, 1, "all", True),          # ViT: class token, pos over all tokens
    (3, 3, 28, 42, 14, 5, "all", True),          # class + 4 registers
    (2, 3, 24, 40, 8, 5, "patches", True),       # timm no_embed_class
    (2, 1, 24, 16, 8, 0, "patches", False),      # no prefix, one channel, no bias (CLIP-style projection)
    (1, 3, 16, 32, 8, 2, None, True),            # class + distillation token, no position embedding
]


def make(batch, chans, h, w, patch, prefix, pos, bias, dtype, pixel_dtype):
    d = 40
    n = (h // patch) * (w // patch)
    k = chans * patch * patch

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=DEVICE) * scale).to(dtype)
    return (torch.randn(batch, chans, h, w, device=DEVICE).to(pixel_dtype), rand(d, chans, patch, patch, scale=k ** -0.5),
            rand(d) if bias else None, {"all": rand(prefix + n, d), "patches": rand(n, d), None: None}[pos],
            rand(prefix, d) if prefix else None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_patch_embed(dtype, case):
    torch.manual_seed(CASES.index(case))
    out = assert_matches_torch(patch_embed, patch_embed_torch, *make(*case, dtype, dtype))
    batch, _, h, w, patch, prefix = case[:6]
    assert out.shape == (batch, prefix + (h // patch) * (w // patch), 40)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_pixels_are_rounded_like_torch(dtype):
    # float32 pixels into a 16-bit weight: converted on load, equal to converting first.
    px, w, b, pos, pre = make(*CASES[0], dtype, torch.float32)
    torch.testing.assert_close(patch_embed(px, w, b, pos, pre), patch_embed(px.to(dtype), w, b, pos, pre),
                               rtol=0, atol=0)


def test_every_element_is_written():
    px, w, b, pos, pre = make(*CASES[1], torch.float32, torch.float32)
    out = torch.full((3, 5 + 6, 40), float("nan"), device=DEVICE)
    patch_embed(px, w, b, pos, pre, out=out)
    torch.testing.assert_close(out, patch_embed_torch(px, w, b, pos, pre), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change, match", [
    (dict(px=torch.randn(1, 3, 30, 48)), r"image size 30x48 must be a multiple of the patch size 16"),
    (dict(px=torch.randn(1, 4, 32, 48)), r"pixels must be \[B, 3, H, W\], got shape \(1, 4, 32, 48\)"),
    (dict(px=torch.randn(1, 3, 32, 48).double()), r"pixels must be float32 or torch.float32, got torch.float64"),
    (dict(pos=torch.randn(5, 40)), r"pos_embed must have shape \(6, 40\) or \(7, 40\) for a 32x48 image, got \(5, 40\)"),
    (dict(pre=torch.randn(1, 39)), r"prefix_tokens must have shape \(1, 40\), got \(1, 39\)"),
    (dict(w=torch.randn(40, 3, 16, 8)), r"weight must be \[D, C, S, S\], got shape \(40, 3, 16, 8\)"),
])
def test_bad_input(change, match):
    px, w, b, pos, pre = make(*CASES[0], torch.float32, torch.float32)
    args = dict(px=px, w=w, b=b, pos=pos, pre=pre)
    args.update({k: v.to(DEVICE) for k, v in change.items()})
    with pytest.raises(ValueError, match=match):
        patch_embed(args["px"], args["w"], args["b"], args["pos"], args["pre"])
