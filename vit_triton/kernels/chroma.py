"""nvJPEG's RGB of a chroma-subsampled JPEG made libjpeg-turbo's (the decoder of Pillow and torchvision).

nvJPEG (an H100's hardware decoder) computes the same luma and chroma samples as libjpeg-turbo and turns them into
RGB with the same integer tables, but repeats each chroma sample over its block (2 x 2 pixels in 4:2:0, 2 x 1 in
4:2:2), where libjpeg-turbo interpolates it ("fancy upsampling": 3/4 of the block's own sample and 1/4 of the next
one across each axis the chroma is halved on, with its own rounding; the edge samples repeated). That conversion
is invertible: a pixel with no channel clamped at 0 or 255 gives back its chroma sample (the two colour
differences R - B and G - R determine Cb and Cr) and then its luma. So, in two launches for the whole batch, each of
a program per tile of TILE chroma blocks, over every image's own tiles one after another:

- per chroma block, its (Cb, Cr) from its first unclamped pixel; a block with none is unknown, and one whose pixels
  disagree (a decoder that does not repeat samples) inconsistent; both counted per image;
- per pixel, Y from its own value and block, the chroma interpolated from the block and its neighbours as
  libjpeg-turbo does, and RGB again, written in place. A pixel of an unknown block keeps nvJPEG's value, and an
  unknown neighbour counts as the block itself: such pixels may still differ from libjpeg-turbo's.

Two launches, not one: a program reading its neighbours' chroma back from their pixels could find them already
rewritten by the programs they belong to.

Layout: pixels, the images' [3, H_i, W_i] uint8 RGB one after another in one flat buffer, rewritten in place;
table, int64 [B, 5] on the CPU, a row per image (TABLE_COLUMNS), the block 2 x 2 or 1 x 2 (rows x columns); on the
device, each image's offset, height, width, block rows, first code and first tile, a column after another (_tile);
the chroma codes (Cb * 256 + Cr, or -1) in an int32 buffer of every image's blocks. Returns int64 [B, 2] on the
device: each image's unknown and inconsistent blocks.

Cost per pixel: the first launch reads its 3 bytes, reads its chroma back (about 75 integer and float instructions)
and writes 4 bytes a block; the second reads the 3 bytes, its block's code and three neighbours' (from the cache) and
writes 3 bytes (about 85 instructions). With each program's own work (finding its image, summing its counts): about
11 bytes (13 in 4:2:2, whose blocks are half as large) and 200 instructions a pixel (more in 4:2:2, whose masked
second row still issues), as Triton 3.9 compiles them for sm_90: 9 MB for a 0.8-megapixel photo. On an H100 the
instructions take longer to issue than the bytes to move: 256 photos of 0.4 to 1.9 megapixels, half of them 4:2:0,
take about 4 ms (2 GB moved). Each thread loads and stores a byte at a time (an image's rows are not aligned).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import check_image_batch, next_power_of_2, pdl, start_next_kernel, wait_for_previous_kernel

TABLE_COLUMNS = ("offset", "height", "width", "block rows", "block columns")
TILE = (4, 64)   # a program's chroma blocks, rows x columns: 8 x 128 pixels in 4:2:0, 4 x 128 in 4:2:2
MIN_IMAGES = 256   # the table rows _tile reads at least: one compiled kernel for every batch up to this many images


@triton.jit
def _offsets(cb, cr):
    """libjpeg's YCbCr -> RGB tables (jdcolor.c), computed: what Cr adds to R, Cb and Cr to G, and Cb to B, in
    16-bit fixed point (FIX(1.402) = 91881, FIX(0.34414) = 22554, FIX(0.71414) = 46802, FIX(1.772) = 116130)."""
    r = (91881 * (cr - 128) + 32768) >> 16
    g = (-22554 * (cb - 128) + 32768 - 46802 * (cr - 128)) >> 16
    b = (116130 * (cb - 128) + 32768) >> 16
    return r, g, b


@triton.jit
def _tile(table_ptr, pixels_ptr, codes_ptr, images, IMAGES: tl.constexpr, TILE_R: tl.constexpr,
          TILE_C: tl.constexpr):
    """This program's tile of chroma blocks: its image, that image's pixels and chroma codes, height, width, block
    rows (1 or 2) and blocks down and across, and the tile's block rows [TILE_R, 1] and columns [1, TILE_C].

    The grid has a program for each tile of each image, the images' tiles one after another, row by row; the device
    table holds a column after another, so a program finds its image in one load: the number of images whose first
    tile is at or before its own, less one."""
    tile = tl.program_id(0)
    i = tl.arange(0, IMAGES)
    first_tiles = tl.load(table_ptr + 5 * images + i, mask=i < images)
    image = tl.sum(((i < images) & (first_tiles <= tile)).to(tl.int32)) - 1
    column = table_ptr + image   # then + k * images: the image's k-th field
    height = tl.load(column + images).to(tl.int32)
    width = tl.load(column + 2 * images).to(tl.int32)
    fy = tl.load(column + 3 * images).to(tl.int32)
    rows_b, cols_b = tl.where(fy == 2, (height + 1) // 2, height), (width + 1) // 2
    tiles_across = tl.cdiv(cols_b, TILE_C)
    in_image = tile - tl.load(column + 5 * images).to(tl.int32)
    by = in_image // tiles_across * TILE_R + tl.arange(0, TILE_R)[:, None]
    bx = in_image % tiles_across * TILE_C + tl.arange(0, TILE_C)[None, :]
    pixels = pixels_ptr + tl.load(column)
    codes = codes_ptr + tl.load(column + 4 * images)
    return image, pixels, codes, height, width, fy, rows_b, cols_b, by, bx


@triton.jit
def _rgb(at, plane, mask):
    """R, G and B (int32) of the pixels whose R is at `at`, the planes `plane` bytes apart."""
    r = tl.load(at, mask=mask).to(tl.int32)
    g = tl.load(at + plane, mask=mask).to(tl.int32)
    b = tl.load(at + 2 * plane, mask=mask).to(tl.int32)
    return r, g, b


@triton.jit
def _codes_kernel(pixels_ptr, table_ptr, codes_ptr, counts_ptr, images, IMAGES: tl.constexpr, TILE_R: tl.constexpr,
                  TILE_C: tl.constexpr, PDL: tl.constexpr):
    """Program t: the chroma codes of tile t's blocks (_tile), and their unknown and inconsistent blocks added to
    their image's counts."""
    wait_for_previous_kernel(PDL)
    image, pixels, codes, height, width, fy, rows_b, cols_b, by, bx = _tile(
        table_ptr, pixels_ptr, codes_ptr, images, IMAGES, TILE_R, TILE_C)
    inside = (by < rows_b) & (bx < cols_b)
    plane = height * width
    chosen = tl.full((TILE_R, TILE_C), -1, tl.int32)
    disagree = tl.zeros((TILE_R, TILE_C), tl.int32)
    # The block's pixels in order: its first row, then its second (4:2:0). Unrolled with the second row masked in
    # 4:2:2: Triton 3.6 compiles a loop bounded by the loaded block rows into wrong loads on sm_90.
    for dy in tl.static_range(2):
        y = by * fy + dy
        bottom = tl.where(fy > dy, height, 0)   # no second pixel row in 4:2:2
        for dx in tl.static_range(2):
            x = 2 * bx + dx
            here = (y < bottom) & (x < width)   # in the image, so is its block
            r, g, b = _rgb(pixels + y * width + x, plane, here)
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
    start_next_kernel(PDL)
    tl.store(codes + by * cols_b + bx, chosen, mask=inside)
    unknown = tl.sum((inside & (chosen < 0)).to(tl.int32))
    inconsistent = tl.sum((inside & (disagree > 0)).to(tl.int32))
    tl.atomic_add(counts_ptr + image * 2, unknown.to(tl.int64), sem="relaxed")
    tl.atomic_add(counts_ptr + image * 2 + 1, inconsistent.to(tl.int64), sem="relaxed")


@triton.jit
def _code(codes, cols_b, by, bx, own, mask):
    """The code of block (by, bx), or `own` where that block is unknown."""
    code = tl.load(codes + by * cols_b + bx, mask=mask, other=-1)
    return tl.where(code < 0, own, code)


@triton.jit
def _upsample_kernel(pixels_ptr, table_ptr, codes_ptr, images, IMAGES: tl.constexpr, TILE_R: tl.constexpr,
                     TILE_C: tl.constexpr, PDL: tl.constexpr):
    """Program t: the pixels of tile t's blocks (_tile), upsampled and written in place."""
    wait_for_previous_kernel(PDL)
    _, pixels, codes, height, width, fy, rows_b, cols_b, by, bx = _tile(
        table_ptr, pixels_ptr, codes_ptr, images, IMAGES, TILE_R, TILE_C)
    inside = (by < rows_b) & (bx < cols_b)
    own = tl.load(codes + by * cols_b + bx, mask=inside, other=-1)
    start_next_kernel(PDL)
    own_r, own_g, own_b = _offsets(own >> 8, own & 255)
    plane = height * width
    for dy in tl.static_range(2):   # unrolled, as in _codes_kernel
        y = by * fy + dy
        # The neighbours libjpeg-turbo reads: the block row above for an even pixel row, below for an odd one (4:2:0
        # only), and the block column left of an even pixel column, right of an odd one; the edge blocks repeated.
        by_next = tl.where(fy == 2, tl.minimum(tl.maximum(by + 2 * dy - 1, 0), rows_b - 1), by)
        down = _code(codes, cols_b, by_next, bx, own, inside)
        bottom = tl.where(fy > dy, height, 0)   # no second pixel row in 4:2:2
        for dx in tl.static_range(2):
            x = 2 * bx + dx
            here = (y < bottom) & (x < width)   # in the image, so is its block
            bx_next = tl.minimum(tl.maximum(bx + 2 * dx - 1, 0), cols_b - 1)
            across = _code(codes, cols_b, by, bx_next, own, here)
            diagonal = _code(codes, cols_b, by_next, bx_next, own, here)
            # 4:2:0 (jdsample.c h2v2_fancy_upsample): column sums 3 * this row + the next row, then
            # (3 * this column + the next column + 8 or 7) >> 4. 4:2:2 (h2v1) is (3 * this + the next + 1 or 2) >> 2:
            # the same, its next row being its own (by_next = by: down = own, diagonal = across), with 4 or 8 added:
            # (3 (4 c) + 4 n + 4 (1 or 2)) >> 4.
            bias = tl.where(fy == 2, 8 - dx, 4 + 4 * dx)
            cb = (3 * (3 * (own >> 8) + (down >> 8)) + 3 * (across >> 8) + (diagonal >> 8) + bias) >> 4
            cr = (3 * (3 * (own & 255) + (down & 255)) + 3 * (across & 255) + (diagonal & 255) + bias) >> 4
            at = pixels + y * width + x
            r, g, b = _rgb(at, plane, here)
            # Y from an unclamped channel and the block's own sample (nvJPEG's conversion); all three clamped: 255 or 0.
            luma = tl.where((r > 0) & (r < 255), r - own_r,
                            tl.where((b > 0) & (b < 255), b - own_b,
                                     tl.where((g > 0) & (g < 255), g - own_g, tl.where(r == 255, 255, 0))))
            off_r, off_g, off_b = _offsets(cb, cr)
            known = here & (own >= 0)   # a pixel of an unknown block keeps its value
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
    tiles = -(-rows_b // TILE[0]) * -(-cols_b // TILE[1])
    counts = torch.zeros((len(table), 2), dtype=torch.int64, device=device)
    if not len(table):
        return counts
    # Each image's offset, height, width, block rows, first code and first tile, a column after another (_tile).
    device_table = torch.stack([offset, height, width, fy, torch.cumsum(blocks, 0) - blocks,
                                torch.cumsum(tiles, 0) - tiles]).to(device)
    codes = torch.empty(int(blocks.sum()), dtype=torch.int32, device=device)
    grid = (int(tiles.sum()),)
    launch = dict(IMAGES=max(MIN_IMAGES, next_power_of_2(len(table))), TILE_R=TILE[0], TILE_C=TILE[1],
                  num_warps=4, **pdl(device, grid[0]))
    _codes_kernel[grid](pixels, device_table, codes, counts, len(table), **launch)
    _upsample_kernel[grid](pixels, device_table, codes, len(table), **launch)
    return counts
