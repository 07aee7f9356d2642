"""nvJPEG's RGB of a chroma-subsampled JPEG made libjpeg-turbo's (the decoder of Pillow and torchvision).

nvJPEG (an H100's hardware decoder) computes the same luma and chroma samples as libjpeg-turbo and turns them into
RGB with the same integer tables, but repeats each chroma sample over its block (2 x 2 pixels in 4:2:0, 2 x 1 in
4:2:2), where libjpeg-turbo interpolates it ("fancy upsampling": 3/4 of the block's own sample and 1/4 of the next
one across each axis the chroma is halved on, with its own rounding; the edge samples repeated). That conversion
is invertible: a pixel with no channel clamped at 0 or 255 gives back its chroma sample (the two colour
differences R - B and G - R determine Cb and Cr) and then its luma. So, in two launches for the whole batch:

- per chroma block, its (Cb, Cr) from its first unclamped pixel; a block with none is unknown, and one whose pixels
  disagree (a decoder that does not repeat samples) inconsistent; both counted per image;
- per pixel, Y from its own value and block, the chroma interpolated from the block and its neighbours as
  libjpeg-turbo does, and RGB again, written in place. A pixel of an unknown block keeps nvJPEG's value, and an
  unknown neighbour counts as the block itself: such pixels may still differ from libjpeg-turbo's.

Layout: pixels, the images' [3, H_i, W_i] uint8 RGB one after another in one flat buffer, rewritten in place;
table, int64 [B, 5] on the CPU, a row per image (TABLE_COLUMNS), the block 2 x 2 or 1 x 2 (rows x columns); the
chroma codes (Cb * 256 + Cr, or -1) in an int32 buffer of every image's blocks. Returns int64 [B, 2] on the
device: each image's unknown and inconsistent blocks.

Cost per pixel: the first launch reads its 3 bytes (until its block finds an unclamped pixel: about 25 integer and
float operations each) and writes 4 bytes a block; the second reads the 3 bytes and 4 codes (the neighbours' from
the cache) and writes 3 bytes. About 10 bytes and 60 operations a pixel: 8 MB for a 0.8-megapixel photo.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check_image_batch

TABLE_COLUMNS = ("offset", "height", "width", "block rows", "block columns")
BLOCK = 32   # tiles of BLOCK x BLOCK chroma blocks (first launch) or pixels (second)


@triton.jit
def _offsets(cb, cr):
    """libjpeg's YCbCr -> RGB tables (jdcolor.c), computed: what Cr adds to R, Cb and Cr to G, and Cb to B, in
    16-bit fixed point (FIX(1.402) = 91881, FIX(0.34414) = 22554, FIX(0.71414) = 46802, FIX(1.772) = 116130)."""
    r = (91881 * (cr - 128) + 32768) >> 16
    g = (-22554 * (cb - 128) + 32768 - 46802 * (cr - 128)) >> 16
    b = (116130 * (cb - 128) + 32768) >> 16
    return r, g, b


@triton.jit
def _image(table, image):
    """Image `image`'s row of the device table: its pixels' offset, height, width, block rows and columns, its first
    chroma code's index, and its blocks down and across."""
    row = table + image * 6
    height = tl.load(row + 1).to(tl.int32)
    width = tl.load(row + 2).to(tl.int32)
    fy = tl.load(row + 3).to(tl.int32)
    fx = tl.load(row + 4).to(tl.int32)
    return tl.load(row), height, width, fy, fx, tl.load(row + 5), (height + fy - 1) // fy, (width + fx - 1) // fx


@triton.jit
def _chroma_kernel(pixels, table, codes, counts, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    image = tl.program_id(0)
    offset, height, width, fy, fx, first_code, rows_b, cols_b = _image(table, image)
    by = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    bx = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    inside = (by < rows_b) & (bx < cols_b)
    plane = height * width
    chosen = tl.full((BLOCK_R, BLOCK_C), -1, tl.int32)
    disagree = tl.zeros((BLOCK_R, BLOCK_C), tl.int32)
    for dy in tl.static_range(2):
        for dx in tl.static_range(2):
            y = by * fy + dy
            x = bx * fx + dx
            here = inside & (y < tl.minimum(height, (by + 1) * fy)) & (x < tl.minimum(width, (bx + 1) * fx))
            at = pixels + offset + y.to(tl.int64) * width + x
            r = tl.load(at, mask=here, other=0).to(tl.int32)
            g = tl.load(at + plane, mask=here, other=0).to(tl.int32)
            b = tl.load(at + 2 * plane, mask=here, other=0).to(tl.int32)
            free = here & (r > 0) & (r < 255) & (g > 0) & (g < 255) & (b > 0) & (b < 255)
            # The conversion's colour differences, R - B = 1.402 (Cr - 128) - 1.772 (Cb - 128) and G - R =
            # -0.34414 (Cb - 128) - 2.11614 (Cr - 128), solved and rounded: exact for every (Cb, Cr) pair (each lies
            # within 0.495 of its integer), which the integer tables then confirm.
            d_rb = (r - b).to(tl.float32)
            d_gr = (g - r).to(tl.float32)
            det = -4.23228436   # 1.402 * -0.34414 - 1.772 * 2.11614
            cr = tl.floor((-0.34414 * d_rb + 1.772 * d_gr) / det + 0.5).to(tl.int32) + 128
            cb = tl.floor((1.402 * d_gr + 2.11614 * d_rb) / det + 0.5).to(tl.int32) + 128
            cr = tl.minimum(tl.maximum(cr, 0), 255)
            cb = tl.minimum(tl.maximum(cb, 0), 255)
            off_r, off_g, off_b = _offsets(cb, cr)
            valid = free & (off_r - off_b == r - b) & (off_g - off_r == g - r)
            code = tl.where(valid, cb * 256 + cr, -1)
            disagree += (free & (((code != chosen) & (chosen >= 0)) | ~valid)).to(tl.int32)
            chosen = tl.where(chosen < 0, code, chosen)
    tl.store(codes + first_code + by * cols_b + bx, chosen, mask=inside)
    tl.atomic_add(counts + image * 2, tl.sum(tl.sum((inside & (chosen < 0)).to(tl.int64), 1), 0))
    tl.atomic_add(counts + image * 2 + 1, tl.sum(tl.sum((inside & (disagree > 0)).to(tl.int64), 1), 0))


@triton.jit
def _code(codes, first_code, cols_b, by, bx, own, mask):
    code = tl.load(codes + first_code + by * cols_b + bx, mask=mask, other=-1)
    return tl.where(code < 0, own, code)


@triton.jit
def _upsample_kernel(pixels, table, codes, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    image = tl.program_id(0)
    offset, height, width, fy, fx, first_code, rows_b, cols_b = _image(table, image)
    y = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
    x = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)[None, :]
    inside = (y < height) & (x < width)
    by, bx = y // fy, x // fx
    own = tl.load(codes + first_code + by * cols_b + bx, mask=inside, other=-1)
    known = inside & (own >= 0)
    # The neighbours libjpeg-turbo reads: the block row above for an even row, below for an odd one (4:2:0 only),
    # and the block column left of an even column, right of an odd one; the edge blocks repeated.
    by_next = tl.where(fy == 2, tl.minimum(tl.maximum(tl.where(y % 2 == 0, by - 1, by + 1), 0), rows_b - 1), by)
    bx_next = tl.minimum(tl.maximum(tl.where(x % 2 == 0, bx - 1, bx + 1), 0), cols_b - 1)
    across = _code(codes, first_code, cols_b, by, bx_next, own, known)
    down = _code(codes, first_code, cols_b, by_next, bx, own, known)
    diagonal = _code(codes, first_code, cols_b, by_next, bx_next, own, known)
    even = x % 2 == 0
    # 4:2:0 (jdsample.c h2v2_fancy_upsample): column sums 3 * this row + the next row, then
    # (3 * this column + the next column + 8 or 7) >> 4; 4:2:2 (h2v1): (3 * this + the next + 1 or 2) >> 2.
    this_cb = 3 * (own >> 8) + (down >> 8)
    this_cr = 3 * (own & 255) + (down & 255)
    next_cb = 3 * (across >> 8) + (diagonal >> 8)
    next_cr = 3 * (across & 255) + (diagonal & 255)
    cb = tl.where(fy == 2, (3 * this_cb + next_cb + tl.where(even, 8, 7)) >> 4,
                  (3 * (own >> 8) + (across >> 8) + tl.where(even, 1, 2)) >> 2)
    cr = tl.where(fy == 2, (3 * this_cr + next_cr + tl.where(even, 8, 7)) >> 4,
                  (3 * (own & 255) + (across & 255) + tl.where(even, 1, 2)) >> 2)
    plane = height * width
    at = pixels + offset + y.to(tl.int64) * width + x
    r = tl.load(at, mask=known, other=0).to(tl.int32)
    g = tl.load(at + plane, mask=known, other=0).to(tl.int32)
    b = tl.load(at + 2 * plane, mask=known, other=0).to(tl.int32)
    # Y from an unclamped channel and the block's own sample (nvJPEG's conversion); all three clamped: 255 or 0.
    own_r, own_g, own_b = _offsets(own >> 8, own & 255)
    luma = tl.where((r > 0) & (r < 255), r - own_r,
                    tl.where((b > 0) & (b < 255), b - own_b,
                             tl.where((g > 0) & (g < 255), g - own_g, tl.where(r == 255, 255, 0))))
    off_r, off_g, off_b = _offsets(cb, cr)
    tl.store(at, tl.minimum(tl.maximum(luma + off_r, 0), 255).to(tl.uint8), mask=known)
    tl.store(at + plane, tl.minimum(tl.maximum(luma + off_g, 0), 255).to(tl.uint8), mask=known)
    tl.store(at + 2 * plane, tl.minimum(tl.maximum(luma + off_b, 0), 255).to(tl.uint8), mask=known)


def fancy_upsample(pixels: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """Each image's RGB, decoded with its chroma samples repeated over their blocks, rewritten in place as
    libjpeg-turbo upsamples chroma; returns each image's (unknown, inconsistent) block counts, int64 [B, 2]."""
    device = check_image_batch(pixels, table, TABLE_COLUMNS)
    offset, height, width, fy, fx = table.T
    bad = ((height < 1) | (width < 1) | (offset < 0) | (offset + 3 * height * width > pixels.numel())
           | ~(((fy == 2) & (fx == 2)) | ((fy == 1) & (fx == 2))))
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"table row {i}: an image's 3 x height x width pixels from its offset must lie in the "
                         f"{pixels.numel()} of pixels and its block must be 2 x 2 or 1 x 2, got {table[i].tolist()}")
    rows_b, cols_b = -(-height // fy), -(-width // fx)   # each image's chroma blocks down and across
    blocks = rows_b * cols_b
    counts = torch.zeros((len(table), 2), dtype=torch.int64, device=device)
    if not len(table):
        return counts
    device_table = torch.cat([table, (torch.cumsum(blocks, 0) - blocks)[:, None]], 1).to(device)
    codes = torch.empty(int(blocks.sum()), dtype=torch.int32, device=device)
    grid = (len(table), triton.cdiv(int(rows_b.max()), BLOCK), triton.cdiv(int(cols_b.max()), BLOCK))
    _chroma_kernel[grid](pixels, device_table, codes, counts, BLOCK_R=BLOCK, BLOCK_C=BLOCK, num_warps=4)
    grid = (len(table), triton.cdiv(int(height.max()), BLOCK), triton.cdiv(int(width.max()), BLOCK))
    _upsample_kernel[grid](pixels, device_table, codes, BLOCK_R=BLOCK, BLOCK_C=BLOCK, num_warps=4)
    return counts
