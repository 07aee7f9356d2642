"""kernels/chroma.py against libjpeg-turbo's chroma upsampling and colour conversion written out in NumPy (jdsample.c's
h2v2 and h2v1 "fancy" upsampling, jdcolor.c's tables): RGB made from random luma and chroma planes with each chroma
sample repeated over its block, as nvJPEG makes it, must come out as libjpeg-turbo makes it, pixel for pixel. On a
GPU, tests/test_gpu_decode.py checks the same against Pillow's decoding of real JPEGs decoded by nvJPEG."""

import numpy as np
import pytest
import torch

from tests.kernels.checks import raises_value_error
from tests.numerics import DEVICE
from vit_triton.kernels.chroma import TILE, fancy_upsample

ONE_HALF = 1 << 15
X = np.arange(256) - 128
CR_R = (91881 * X + ONE_HALF) >> 16
CB_B = (116130 * X + ONE_HALF) >> 16
CB_G = -22554 * X + ONE_HALF
CR_G = -46802 * X

SIZES = [(23, 37, (2, 2)), (9, 30, (1, 2)), (40, 17, (2, 2)), (1, 5, (2, 2)), (31, 3, (1, 2))]   # odd sizes
# A program takes TILE = (R, C) chroma blocks of one image: images of several tiles down and across, of exactly one
# and of one pixel, whose tiles follow each other in the grid; the largest first (or, reversed, last).
R, C = TILE
MIXED = [(2 * R + 5, 2 * C + 5, (2, 2)), (1, 1, (2, 2)), (2 * R + 1, 2 * C + 2, (1, 2)), (2, 3, (1, 2)),
         (2 * R + 3, 2 * C + 1, (2, 2)), (R, 2 * C, (1, 2))]


def to_rgb(y, cb, cr):
    return np.stack([y + CR_R[cr], y + ((CB_G[cb] + CR_G[cr]) >> 16), y + CB_B[cb]]).clip(0, 255).astype(np.uint8)


def repeated(c, block, height, width):
    return np.repeat(np.repeat(c, block[0], 0), block[1], 1)[:height, :width]


def fancy(c, block, height, width):
    """libjpeg-turbo's upsampling of one chroma plane: each output sample 3/4 of its own and 1/4 of the next one
    across (left of an even column, right of an odd one; above an even row, below an odd one, in 4:2:0), the edge
    samples repeated, rounded with its biases."""
    c = c.astype(np.int64)
    prev_col, next_col = np.hstack([c[:, :1], c[:, :-1]]), np.hstack([c[:, 1:], c[:, -1:]])
    if block == (1, 2):
        out = np.stack([(3 * c + prev_col + 1) >> 2, (3 * c + next_col + 2) >> 2], -1).reshape(len(c), -1)
        return out[:height, :width]
    rows = []
    for near in (np.vstack([c[:1], c[:-1]]), np.vstack([c[1:], c[-1:]])):   # even output rows, then odd ones
        s = 3 * c + near
        prev_s, next_s = np.hstack([s[:, :1], s[:, :-1]]), np.hstack([s[:, 1:], s[:, -1:]])
        rows.append(np.stack([(3 * s + prev_s + 8) >> 4, (3 * s + next_s + 7) >> 4], -1).reshape(len(c), -1))
    return np.stack(rows, 1).reshape(2 * len(c), -1)[:height, :width]


def planes(seed: int, height: int, width: int, block, low: int, high: int, chroma_low: int, chroma_high: int):
    rng = np.random.default_rng(seed)
    y = rng.integers(low, high + 1, (height, width))
    shape = (-(-height // block[0]), -(-width // block[1]))
    return y, rng.integers(chroma_low, chroma_high + 1, shape), rng.integers(chroma_low, chroma_high + 1, shape)


def run(images: list[np.ndarray], blocks) -> tuple[list[np.ndarray], list[list[int]]]:
    flat = torch.cat([torch.from_numpy(i).reshape(-1) for i in images]).to(DEVICE)
    offsets = np.cumsum([0] + [i.size for i in images])
    table = torch.tensor([[o, i.shape[1], i.shape[2], *b] for o, i, b in zip(offsets, images, blocks)])
    counts = fancy_upsample(flat, table).tolist()
    out = flat.cpu().numpy()
    return [out[o:o + i.size].reshape(i.shape) for o, i in zip(offsets, images)], counts


def consistent(seed: int, height: int, width: int, block) -> tuple[np.ndarray, tuple[np.ndarray, ...]]:
    """nvJPEG's RGB of values no conversion clamps (luma 60-195, chroma 100-156), and its (Y, Cb, Cr) planes."""
    y, cb, cr = made = planes(seed, height, width, block, 60, 195, 100, 156)
    return to_rgb(y, repeated(cb, block, height, width), repeated(cr, block, height, width)), made


@pytest.mark.parametrize("sizes", [SIZES, MIXED, MIXED[::-1]], ids=["small", "largest-first", "largest-last"])
def test_repeated_chroma_is_upsampled_as_libjpeg_turbo_does(sizes):
    # Every block's chroma can be read back.
    images, made = zip(*(consistent(seed, h, w, block) for seed, (h, w, block) in enumerate(sizes)))
    blocks = [block for _, _, block in sizes]
    out, counts = run(images, blocks)
    assert counts == [[0, 0]] * len(sizes)
    for got, (y, cb, cr), b in zip(out, made, blocks):
        np.testing.assert_array_equal(got, to_rgb(y, fancy(cb, b, *y.shape), fancy(cr, b, *y.shape)))


def test_clamped_blocks_are_counted_and_everything_they_do_not_touch_is_exact():
    y, cb, cr = planes(7, 26, 33, (2, 2), 0, 255, 0, 255)   # full range: many pixels clamp
    image = to_rgb(y, repeated(cb, (2, 2), 26, 33), repeated(cr, (2, 2), 26, 33))
    # Between two images (of several tiles) with no unknown blocks: the counts go to each program's image.
    before, after = consistent(1, 3 * R, 2 * C + 9, (2, 2))[0], consistent(2, 5, 7, (1, 2))[0]
    [_, got, _], [first, [unknown, inconsistent], last] = run([before, image, after], [(2, 2), (2, 2), (1, 2)])
    assert first == last == [0, 0]
    free = ((image > 0) & (image < 255)).all(0)
    known = np.pad(free, ((0, 0), (0, 1))).reshape(13, 2, 17, 2).any((1, 3))   # a block with an unclamped pixel
    assert inconsistent == 0 and unknown == (~known).sum() > 0
    # A pixel reads its block and the three next to it: exact wherever all four are known.
    padded = np.pad(known, 1, mode="edge")
    untouched = np.ones((26, 34), bool)
    for dy in (-1, 0, 1):
        for dx in (-1, 0, 1):
            untouched &= np.repeat(np.repeat(padded[1 + dy:14 + dy, 1 + dx:18 + dx], 2, 0), 2, 1)
    untouched = untouched[:, :33] & ((image > 0) & (image < 255)).any(0)   # and its luma readable from a channel
    want = to_rgb(y, fancy(cb, (2, 2), 26, 33), fancy(cr, (2, 2), 26, 33))
    np.testing.assert_array_equal(got[:, untouched], want[:, untouched])
    unknown_pixels = ~np.repeat(np.repeat(known, 2, 0), 2, 1)[:, :33]
    np.testing.assert_array_equal(got[:, unknown_pixels], image[:, unknown_pixels])   # kept as they were


def test_chroma_that_was_not_repeated_is_reported():
    y, cb, cr = planes(8, 18, 21, (2, 2), 60, 195, 100, 156)
    already = to_rgb(y, fancy(cb, (2, 2), 18, 21), fancy(cr, (2, 2), 18, 21))   # libjpeg-turbo's own pixels
    _, [first, [unknown, inconsistent]] = run([consistent(9, 7, 5, (1, 2))[0], already], [(1, 2), (2, 2)])
    assert first == [0, 0] and unknown == 0 and inconsistent > 0


@pytest.mark.parametrize("table, message", [
    ([[0, 4, 4, 2, 1]], "its block must be 2 x 2 or 1 x 2, got [0, 4, 4, 2, 1]"),
    ([[0, 4, 5, 2, 2]], "must lie in the 48 of pixels"),
    ([[0, 0, 4, 2, 2]], "table row 0: an image's 3 x height x width pixels"),
])
def test_bad_tables_are_refused(table, message):
    with raises_value_error(message):
        fancy_upsample(torch.zeros(48, dtype=torch.uint8, device=DEVICE), torch.tensor(table))
