"""patch_embed against F.conv2d + flatten + prefix tokens + position embedding, in timm's order; patch_embed_backward
against torch autograd through the same."""

import importlib

import pytest
import torch
import torch.nn.functional as F

from tests.kernels.checks import (
    TF32_WEIGHT_PATHS, assert_like_torch, assert_written_in_place, check, check_grads, empty, inference, nan_filled,
    rand, raises_value_error, reference, tf32_emulated, tf32_matmuls,
)
from tests.numerics import DEVICE
from vit_triton.kernels import patch_embed, patch_embed_backward
from vit_triton.kernels.tf32 import TF32_WEIGHT_ROWS
from vit_triton.kernels.common import sm_count

PATCH_EMBED = importlib.import_module("vit_triton.kernels.patch_embed")   # the module; the package exports the function
DIM = 45                                        # no multiple of any tile


def torch_patch_embed(px, w, b, pos, pre):
    """timm's PatchEmbed and _pos_embed: a pos_embed of the patches alone is added before the prefix
    tokens go in front (no_embed_class), one that covers the prefix too after."""
    x = F.conv2d(px.to(w.dtype), w, b, stride=w.shape[-1]).flatten(2).transpose(1, 2)
    covers_prefix = pos is not None and pos.shape[0] != x.shape[1]
    if pos is not None and not covers_prefix:
        x = x + pos
    if pre is not None:
        x = torch.cat([pre.expand(x.shape[0], -1, -1), x], dim=1)
    return x + pos if covers_prefix else x


def inputs(batch, chans, h, w, patch, prefix, pos, bias, dtype, pixel_dtype, channels_last=False):
    """pixels, conv weight, bias, pos_embed (over "all" tokens, the "patches" or None), prefix tokens."""
    patches = (h // patch) * (w // patch)
    pixels = rand(batch, h, w, chans, dtype=pixel_dtype).permute(0, 3, 1, 2) if channels_last else \
        rand(batch, chans, h, w, dtype=pixel_dtype)
    return (pixels, rand(DIM, chans, patch, patch, dtype=dtype, scale=(chans * patch * patch) ** -0.5),
            rand(DIM, dtype=dtype) if bias else None,
            None if pos is None else rand(patches + prefix * (pos == "all"), DIM, dtype=dtype),
            rand(prefix, DIM, dtype=dtype) if prefix else None)


def embed(*args):
    return check(patch_embed(*args), torch_patch_embed, *args)


# Each patch size with each prefix count (none, class token, class + 4 registers), the pos_embed kinds
# as a Latin square over the two; grids of 2x3 to 4x5 patches, never square.
CASES = [
    # batch, channels, height, width, patch, prefix, pos_embed, bias
    (1, 3, 16, 24, 8, 0, "all", True),
    (3, 1, 32, 40, 8, 1, "patches", False),
    (2, 3, 24, 32, 8, 5, None, True),
    (2, 3, 42, 28, 14, 0, "patches", False),
    (1, 3, 28, 70, 14, 1, None, True),
    (3, 1, 56, 42, 14, 5, "all", True),
    (3, 3, 48, 64, 16, 0, None, False),
    (1, 3, 32, 48, 16, 1, "all", True),
    (2, 1, 64, 48, 16, 5, "patches", True),
]
# (weight dtype, pixel dtype): pixels come as float32 or already in the weight's dtype.
PRECISIONS = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16),
              (torch.float16, torch.float32), (torch.float16, torch.float16)]


def each_precision(pairs):
    """A test once per (weight dtype, pixel dtype) pair."""
    return pytest.mark.parametrize("dtype, pixel_dtype", pairs,
                                   ids=[f"{str(w)[6:]}-pixels-{str(p)[6:]}" for w, p in pairs])


def each_case(cases):
    """A test once per case of CASES' layout."""
    return pytest.mark.parametrize("case", cases, ids=[
        f"B{b}-C{c}-{h}x{w}-S{s}-P{p}-pos_{pos}-{'bias' if bias else 'nobias'}"
        for b, c, h, w, s, p, pos, bias in cases])


precisions = each_precision(PRECISIONS)


@precisions
@each_case(CASES)
def test_patch_embed(dtype, pixel_dtype, case):
    out = embed(*inputs(*case, dtype, pixel_dtype))
    batch, _, h, w, patch, prefix = case[:6]
    assert out.shape == (batch, prefix + (h // patch) * (w // patch), DIM) and out.dtype == dtype


@precisions
def test_channels_last_pixels_are_read_in_place(dtype, pixel_dtype):
    embed(*inputs(*CASES[5], dtype, pixel_dtype, channels_last=True))


@precisions
def test_every_element_is_written_in_place(dtype, pixel_dtype):
    args = inputs(*CASES[5], dtype, pixel_dtype)
    buffer = nan_filled(3, 5 + 12 + 3, DIM, dtype=dtype)
    out = buffer[:, 1:-2]                               # [B, T, D] with images T + 3 rows apart
    result = patch_embed(*args, out=out)
    assert_written_in_place(result, out, buffer)
    check(result, torch_patch_embed, *args)


@TF32_WEIGHT_PATHS
def test_tf32(large, inference_weight):
    # 96 patches an image. Held to 1.5x the error of PyTorch's convolution on operands rounded to tf32
    # (cuDNN may not pick a tf32 algorithm for a small convolution, so tf32 is emulated on every device).
    px, w, *rest = args = inputs(-(-TF32_WEIGHT_ROWS // 96) if large else 1, 3, 64, 96, 8, 1, "all", True,
                                 torch.float32, torch.float32)
    with tf32_matmuls():
        out = patch_embed(px, inference(w) if inference_weight else w, *rest)
    assert_like_torch(out, reference(torch_patch_embed, *args),
                      torch_patch_embed(tf32_emulated(px), tf32_emulated(w), *rest))


@pytest.mark.parametrize("change, message", [
    (dict(px=empty(1, 3, 15, 48)), "image size 15x48 must be at least the patch size 16"),
    (dict(px=empty(1, 3, 32, 9)), "image size 32x9 must be at least the patch size 16"),
    (dict(px=empty(1, 1, 32, 48)), "pixels must be [B, 3, H, W], got shape (1, 1, 32, 48)"),
    (dict(px=empty(3, 32, 48)), "pixels must be [B, 3, H, W], got shape (3, 32, 48)"),
    (dict(px=empty(1, 3, 32, 48, dtype=torch.float64)), "pixels must be float32 or torch.float32, got torch.float64"),
    (dict(w=empty(DIM, 3, 16, 16, dtype=torch.bfloat16), px=empty(1, 3, 32, 48, dtype=torch.float16)),
     "pixels must be float32 or torch.bfloat16, got torch.float16"),
    (dict(w=empty(DIM, 3, 16, 8)), "weight must be [D, C, S, S], got shape (45, 3, 16, 8)"),
    (dict(w=empty(DIM, 3 * 16 * 16)), "weight must be [D, C, S, S], got shape (45, 768)"),
    (dict(w=empty(DIM, 3, 16, 16).int()), "weight must be float32, float16 or bfloat16, got torch.int32"),
    (dict(b=empty(DIM, dtype=torch.float16)), "bias must be torch.float32, got torch.float16"),
    (dict(b=empty(DIM - 1)), "bias must have shape (45,), got (44,)"),
    (dict(pos=empty(5, DIM)), "pos_embed must have shape (6, 45) or (7, 45) for a 32x48 image, got (5, 45)"),
    (dict(pos=empty(7, DIM, dtype=torch.bfloat16)), "pos_embed must be torch.float32, got torch.bfloat16"),
    (dict(pre=empty(1, DIM - 1)), "prefix_tokens must have shape (1, 45), got (1, 44)"),
    (dict(pre=empty(1, DIM, dtype=torch.float16)), "prefix_tokens must be torch.float32, got torch.float16"),
    (dict(out=empty(1, 6, DIM)), "out must have shape (1, 7, 45), got (1, 6, 45)"),
    (dict(out=empty(1, 7, DIM, dtype=torch.bfloat16)), "out must be torch.float32, got torch.bfloat16"),
    (dict(out=empty(1, DIM, 7).transpose(1, 2)), "out must have unit stride along D, got strides (315, 1, 7)"),
])
def test_bad_input(change, message):
    args = dict(zip(("px", "w", "b", "pos", "pre"), inputs(*CASES[7], torch.float32, torch.float32)), out=None) | change
    with raises_value_error(message):
        patch_embed(args["px"], args["w"], args["b"], args["pos"], args["pre"], out=args["out"])


def test_nearby_grids_share_a_tuning_key(monkeypatch):
    # 3 x 3 and 2 x 5 patches key the autotuner alike (size_bucket: 10), 4 x 5 do not; each is embedded right.
    kernel = PATCH_EMBED._patch_embed_kernel
    buckets = []
    run = kernel.run
    monkeypatch.setattr(kernel, "run",
                        lambda *args, **kwargs: buckets.append(kwargs["patches_bucket"]) or run(*args, **kwargs))
    for h, w in ((24, 24), (16, 40), (32, 40)):
        embed(*inputs(1, 3, h, w, 8, 1, "all", True, torch.bfloat16, torch.float32))
    assert "patches_bucket" in kernel.keys and buckets[0] == buckets[1] != buckets[2]


# Images with pixels past the last whole patch (37 x 45 at patch 8, 30 x 44 at 14); 1 or 5 prefix tokens, pos_embed
# over all tokens, the patches or none; C = 1, whose few weight-gradient tiles split the sum over the patch rows.
BACKWARD_CASES = [
    # batch, channels, height, width, patch, prefix, pos_embed, bias
    (2, 3, 37, 45, 8, 1, "all", True),
    (3, 1, 32, 40, 8, 5, "patches", False),
    (1, 1, 30, 44, 14, 0, None, True),
]
BACKWARD_PRECISIONS = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                       (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)]


def embed_backward(dtokens, px, w, b, pos, pre, **needs):
    return patch_embed_backward(dtokens, px, w, num_prefix=0 if pre is None else pre.shape[0], has_bias=b is not None,
                                pos_rows=0 if pos is None else pos.shape[0], **needs)


@each_precision(BACKWARD_PRECISIONS)
@each_case(BACKWARD_CASES)
def test_backward(dtype, pixel_dtype, case):
    args = inputs(*case, dtype, pixel_dtype)
    batch, _, h, w, patch, prefix = case[:6]
    dtokens = rand(batch, prefix + (h // patch) * (w // patch), DIM, dtype=dtype)
    grads = embed_backward(dtokens, *args, need_pixels=True)
    assert [g is None for g in grads] == [t is None for t in args]
    check_grads(grads, torch_patch_embed, dtokens, *args)


def test_backward_splits_the_weight_gradient():
    # Slices of at least SPLIT_MIN_ROWS rows, while the grid of 45 x 64 (C = 1 at patch 8) stays within
    # SPLIT_PROGRAMS programs an SM; none where the tiles alone fill that.
    rows = 2 * PATCH_EMBED.SPLIT_MIN_ROWS
    assert PATCH_EMBED.dweight_splits(rows, DIM, 64, DEVICE) == 2
    assert PATCH_EMBED.dweight_splits(rows - 1, DIM, 64, DEVICE) == 1
    wide = (PATCH_EMBED.SPLIT_PROGRAMS * sm_count(DEVICE) + 1) * PATCH_EMBED.DW_TILE
    assert PATCH_EMBED.dweight_splits(rows, DIM, wide, DEVICE) == 1


NEEDS = ("need_pixels", "need_weight", "need_bias", "need_pos", "need_prefix")


@pytest.mark.parametrize("needed", [(), ("need_pixels",), ("need_weight",), ("need_bias",), ("need_pos",),
                                    ("need_prefix",), ("need_bias", "need_prefix")],
                         ids=lambda needed: "-".join(needed) or "none")
def test_backward_computes_only_what_is_needed(monkeypatch, needed):
    # What is not asked for is None and no kernel runs for it: the weight and pixel GEMMs only when asked, the sums
    # over the batch only for the rows bias, pos and prefix need. What is computed is the full call's, bit for bit.
    args = inputs(*BACKWARD_CASES[1][:6], "all", True, torch.bfloat16, torch.float32)
    dtokens = rand(3, 5 + 20, DIM, dtype=torch.bfloat16)
    full = embed_backward(dtokens, *args, need_pixels=True)
    launches = {}   # kernel name -> the keyword arguments of its launch

    def recorded(name, run):
        def launch(*args, **kwargs):
            launches[name] = kwargs
            return run(*args, **kwargs)
        return launch

    for name in ("_patch_embed_dweight_kernel", "_patch_embed_dpixels_kernel", "_patch_embed_token_sums_kernel"):
        kernel = getattr(PATCH_EMBED, name)
        monkeypatch.setattr(kernel, "run", recorded(name, kernel.run))
    grads = embed_backward(dtokens, *args, **{need: need in needed for need in NEEDS})
    for need, ours, whole in zip(NEEDS, grads, full):
        assert (ours is None) != (need in needed), need
        if ours is not None:
            torch.testing.assert_close(ours, whole, rtol=0, atol=0)
    assert ("_patch_embed_dpixels_kernel" in launches) == ("need_pixels" in needed)
    assert ("_patch_embed_dweight_kernel" in launches) == ("need_weight" in needed)
    sums = launches.get("_patch_embed_token_sums_kernel")
    assert (sums is None) == (not {"need_bias", "need_pos", "need_prefix"} & set(needed))
    if sums is not None:
        assert (sums["HAS_BIAS"], sums["HAS_POS"], sums["HAS_PREFIX"]) == tuple(
            need in needed for need in ("need_bias", "need_pos", "need_prefix"))


@pytest.mark.parametrize("change, message", [
    (dict(dt=empty(1, 6, DIM)), "dtokens must have shape (1, 7, 45), got (1, 6, 45)"),
    (dict(dt=empty(1, 7, DIM, dtype=torch.bfloat16)), "dtokens must be torch.float32, got torch.bfloat16"),
    (dict(dt=empty(1, DIM, 7).transpose(1, 2)), "dtokens must have unit stride along D, got strides (315, 1, 7)"),
    (dict(pos_rows=5), "pos_rows must be 0, 6 or 7 for a 32x48 image with 1 prefix tokens, got 5"),
    (dict(num_prefix=-1), "num_prefix must be at least 0, got -1"),
    (dict(px=empty(1, 3, 15, 48)), "image size 15x48 must be at least the patch size 16"),
    (dict(w=empty(DIM, 3, 16, 8)), "weight must be [D, C, S, S], got shape (45, 3, 16, 8)"),
])
def test_backward_bad_input(change, message):
    px, w, *_ = inputs(*CASES[7], torch.float32, torch.float32)
    args = dict(dt=empty(1, 7, DIM), px=px, w=w, num_prefix=1, pos_rows=7) | change
    with raises_value_error(message):
        patch_embed_backward(args["dt"], args["px"], args["w"], num_prefix=args["num_prefix"], has_bias=True,
                             pos_rows=args["pos_rows"])
