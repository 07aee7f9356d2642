"""Resize and crop a batch of uint8 images of any sizes to one size, as Pillow's `Image.resize` ("pillow" fixed
point) or torch's antialiased `F.interpolate` of uint8 ("torch" fixed point) resizes each of them, then a window of
the resized image (zero where it leaves the image, as a center crop pads). Equal to the libraries pixel for pixel.

Both libraries filter separably, with the same antialiased filters (bicubic's a = -0.5 in both). Along an axis of n
input and m output pixels (s = n / m, f = max(s, 1), support r = filter support * f), output i is centred at
c = s (i + 0.5) and sums the inputs x in [int(c - r + 0.5), int(c + r + 0.5)) clipped to the image, weighted by
filter((x - c + 0.5) / f) over the sum of those. The weights are computed in float64 and rounded to fixed point:
to 22 fractional bits (Pillow), or to int16 with as many fractional bits as the axis's largest weight allows, at
most 22 (torch). The sums are integers plus half a unit, shifted down and clamped to 0..255, one axis into a uint8
intermediate, then the other: the rows first (torch; Pillow before 13), or, per image, the columns first (Pillow 13,
where the height shrinks by more than twice the width).

Launches for the whole batch: the weights of every output row and column of every image (float64 as the libraries
compute them, floating-point contraction off); the first pass, over only the input rows (or columns) the second
reads, into the intermediate; the second pass into the output. Two passes more where a batch has images of both
orders.

Layout: pixels, the images' [C, H_i, W_i] uint8 tensors concatenated into one flat buffer; table, int64 [B, 8] on the
CPU, a row per image (TABLE_COLUMNS); output uint8 [B, C, h, w] contiguous.

Cost, per image and channel, rows first, for R input rows under the window and k_h, k_v taps an output pixel (about
2 r): R * w * k_h + h * w * k_v integer multiply-adds, each a one-byte load (the filters' overlap from the cache);
bytes: the R rows read once, the R x w intermediate written and read once, h * w written. 1600 x 1200 -> 341 x 256
-> 224 x 224, bicubic, 3 channels: R = 1070, k = 19, 16.6 M multiply-adds; 5.1 of the image's 5.8 MB read, 1.4 MB of
intermediate moved, 0.15 MB written.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .common import cdiv, check_image_batch, pdl, start_next_kernel, wait_for_previous_kernel

SUPPORT = {"box": 0.5, "bilinear": 1.0, "hamming": 1.0, "bicubic": 2.0, "lanczos": 3.0}   # in input pixels at scale 1
FILTERS = tuple(SUPPORT)   # _filter's FILTER is the index here
FIXED_POINT = ("pillow", "torch")
TABLE_COLUMNS = ("offset", "height", "width", "resized height", "resized width", "top", "left", "columns first")
_ROW = tl.constexpr(len(TABLE_COLUMNS) + 1)   # the device table adds the image's offset in the intermediate
_PILLOW_BITS = tl.constexpr(22)   # Pillow's fractional bits; torch's at most this many
BLOCK = 32   # the passes' tiles: BLOCK x BLOCK pixels of one channel
POSITIONS = 128   # output positions the weights kernel computes at once


@triton.jit
def _filter(x, FILTER: tl.constexpr):
    """The filter at x (float64), written as Resample.c writes it (torch's bilinear and a = -0.5 cubic are these)."""
    a = tl.abs(x)
    if FILTER == 0:   # box
        y = tl.where((x > -0.5) & (x <= 0.5), 1.0, 0.0).to(tl.float64)
    elif FILTER == 1:   # bilinear (triangle)
        y = tl.where(a < 1.0, 1.0 - a, 0.0)
    elif FILTER == 2:   # hamming; 0.54f and 0.46f are C floats
        t = tl.where(a == 0.0, 1.0, a * 3.141592653589793)
        y = tl.where(a == 0.0, 1.0, tl.where(a >= 1.0, 0.0, tl.sin(t) / t * (0.5400000214576721 + 0.46000000834465027
                                                                             * tl.cos(t))))
    elif FILTER == 3:   # bicubic, a = -0.5
        y = tl.where(a < 1.0, (1.5 * a - 2.5) * a * a + 1.0, tl.where(a < 2.0, (((a - 5.0) * a + 8.0) * a - 4.0) * -0.5,
                                                                      0.0))
    else:   # lanczos: sinc(x) sinc(x / 3) on [-3, 3)
        y = tl.where((x >= -3.0) & (x < 3.0), _sinc(x) * _sinc(x / 3.0), 0.0)
    return y


@triton.jit
def _sinc(x):
    t = tl.where(x == 0.0, 1.0, x * 3.141592653589793)
    return tl.where(x == 0.0, 1.0, tl.sin(t) / t)


@triton.jit
def _nonzero(total):
    return tl.where(total != 0.0, total, 1.0)


@triton.jit
def _weight(first, t, center, inverse, FILTER: tl.constexpr):
    """The weight, before normalizing, of input first + t in the output pixels centred at `center`."""
    return _filter(((first + t).to(tl.float64) - center + 0.5) * inverse, FILTER)


@triton.jit
def _taps(r, valid, n_in, scale, support, inverse, ksize, FILTER: tl.constexpr):
    """For output positions r of an axis (none where not valid): the first input they sum, how many, their centres
    and the sums of their weights."""
    center = scale * (r.to(tl.float64) + 0.5)
    first = tl.maximum((center - support + 0.5).to(tl.int32), 0)
    count = tl.minimum((center + support + 0.5).to(tl.int32), n_in) - first
    count = tl.where(valid, tl.minimum(tl.maximum(count, 0), ksize), 0)
    total = tl.zeros_like(center)
    for t in range(0, ksize):
        total += tl.where(t < count, _weight(first, t, center, inverse, FILTER), 0.0)
    return first, count, center, total


@triton.jit
def _resize_weights_kernel(
    table_ptr, first_ptr, taps_ptr, meta_ptr, out_h, out_w, L, KMAX,
    FILTER: tl.constexpr, SUPPORT: tl.constexpr, TORCH: tl.constexpr, POSITIONS: tl.constexpr, PDL: tl.constexpr,
):
    """Program (b, axis): image b's weights along rows (axis 0) or columns (1) for the window's L positions:
    first[b, axis, o], taps[b, axis, t, o] (zero past the taps used), meta[b, axis] = (fractional bits, taps,
    first and last + 1 input index used)."""
    wait_for_previous_kernel(PDL)
    b = tl.program_id(0)
    axis = tl.program_id(1)
    row = table_ptr + b.to(tl.int64) * _ROW
    n_in = tl.load(row + 1 + axis).to(tl.int32)
    n_out = tl.load(row + 3 + axis).to(tl.int32)
    start = tl.load(row + 5 + axis).to(tl.int32)
    length = tl.where(axis == 0, out_h, out_w)
    scale = n_in.to(tl.float64) / n_out.to(tl.float64)
    stretch = tl.maximum(scale, 1.0)
    support = SUPPORT * stretch
    inverse = 1.0 / stretch
    ksize = tl.minimum(tl.ceil(support).to(tl.int32) * 2 + 1, KMAX)
    positions = tl.arange(0, POSITIONS)
    bits = tl.full((), _PILLOW_BITS, tl.int32)
    if TORCH:   # as many bits as the largest weight of the whole axis leaves room for in an int16
        largest = tl.zeros((POSITIONS,), tl.float64)
        for p0 in range(0, n_out, POSITIONS):
            r = p0 + positions
            first, count, center, total = _taps(r, r < n_out, n_in, scale, support, inverse, ksize, FILTER)
            for t in range(0, ksize):
                w = _weight(first, t, center, inverse, FILTER) / _nonzero(total)
                largest = tl.maximum(largest, tl.where((t < count) & (total != 0.0), w, 0.0))
        wt_max = tl.max(largest, axis=0)
        for p in tl.static_range(_PILLOW_BITS):
            bits = tl.where((bits == _PILLOW_BITS) & (0.5 + wt_max * (2 << p) >= 32768.0), p, bits)
    unit = (1 << bits).to(tl.float64)
    lo = tl.full((), 2147483647, tl.int32)
    hi = tl.full((), 0, tl.int32)
    out = (b.to(tl.int64) * 2 + axis) * L
    for o0 in range(0, length, POSITIONS):
        o = o0 + positions
        r = o + start
        inside = (o < length) & (r >= 0) & (r < n_out)   # outside the resized image: no taps, a zero pixel
        first, count, center, total = _taps(r, inside, n_in, scale, support, inverse, ksize, FILTER)
        for t in range(0, ksize):
            # a zero sum leaves the weights as they are
            w = _weight(first, t, center, inverse, FILTER) / _nonzero(total) * unit
            q = tl.where(w < 0.0, -0.5 + w, 0.5 + w).to(tl.int32)   # rounded half away from zero, as both do
            tl.store(taps_ptr + (out * KMAX + t * L) + o, tl.where(t < count, q, 0), mask=o < length)
        tl.store(first_ptr + out + o, tl.where(inside, first, 0), mask=o < length)
        lo = tl.minimum(lo, tl.min(tl.where(count > 0, first, 2147483647), axis=0))
        hi = tl.maximum(hi, tl.max(tl.where(count > 0, first + count, 0), axis=0))
    start_next_kernel(PDL)
    meta = meta_ptr + (b * 2 + axis) * 4
    tl.store(meta, bits)
    tl.store(meta + 1, ksize)
    tl.store(meta + 2, lo)
    tl.store(meta + 3, hi)


@triton.jit
def _resize_pass_kernel(
    src_ptr, dst_ptr, table_ptr, images_ptr, first_ptr, taps_ptr, meta_ptr, C, out_h, out_w, L, KMAX,
    AXIS: tl.constexpr, FIRST: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr,
):
    """Program (i, j, k): rows j * BLOCK_R.. and columns k * BLOCK_C.. of a plane, filtered along its rows (AXIS 1)
    or columns (AXIS 0), for channel i % C of image images[i // C].

    FIRST: from the image into the intermediate. Filtering rows first: every window column, of the input rows the
    vertical pass reads (meta's lo..hi of the rows); columns first: every window row, of the input columns the
    horizontal pass reads. Else from the intermediate into the output."""
    wait_for_previous_kernel(PDL)
    i = tl.program_id(0)
    b = tl.load(images_ptr + i // C)
    c = i % C
    row = table_ptr + b.to(tl.int64) * _ROW
    height = tl.load(row + 1)
    width = tl.load(row + 2)
    meta = meta_ptr + b * 8   # rows' (bits, taps, lo, hi), then columns'
    bits = tl.load(meta + 4 * AXIS)
    ksize = tl.load(meta + 4 * AXIS + 1)
    r0 = tl.program_id(1) * BLOCK_R
    c0 = tl.program_id(2) * BLOCK_C
    rows = r0 + tl.arange(0, BLOCK_R)
    cols = c0 + tl.arange(0, BLOCK_C)
    row_ok = rows < out_h
    col_ok = cols < out_w
    if (AXIS == 0) == FIRST:   # columns filtered first: the intermediate is [C, out_h, width]
        tmp = tl.load(row + 8) + c * out_h * width
        tmp_stride = width
    else:   # rows first: [C, height, out_w]
        tmp = tl.load(row + 8) + c * height * out_w
        tmp_stride = out_w
    if FIRST:
        lo = tl.load(meta + 4 * (1 - AXIS) + 2)
        hi = tl.load(meta + 4 * (1 - AXIS) + 3)
        if AXIS == 1:
            row_ok = (rows >= lo) & (rows < hi)
            ksize = tl.where((r0 < hi) & (r0 + BLOCK_R > lo), ksize, 0)   # no work outside lo..hi
        else:
            col_ok = (cols >= lo) & (cols < hi)
            ksize = tl.where((c0 < hi) & (c0 + BLOCK_C > lo), ksize, 0)
        src = src_ptr + tl.load(row) + c * height * width
        src_stride = width
        dst = dst_ptr + tmp
        dst_stride = tmp_stride
    else:
        src = src_ptr + tmp
        src_stride = tmp_stride
        dst = dst_ptr + (b.to(tl.int64) * C + c) * out_h * out_w
        dst_stride = out_w
    taps = taps_ptr + (b.to(tl.int64) * 2 + AXIS) * KMAX * L
    acc = tl.zeros((BLOCK_R, BLOCK_C), tl.int32)
    # A zero weight reads nothing: taps past a pixel's last input, pixels outside the resized image.
    if AXIS == 1:
        first = tl.load(first_ptr + (b * 2 + 1) * L + cols, mask=col_ok, other=0)
        src += rows.to(tl.int64)[:, None] * src_stride + first[None, :]
        for t in range(0, ksize):
            w = tl.load(taps + t * L + cols, mask=col_ok, other=0)
            x = tl.load(src + t, mask=row_ok[:, None] & (w != 0)[None, :], other=0)
            acc += x.to(tl.int32) * w[None, :]
    else:
        first = tl.load(first_ptr + b * 2 * L + rows, mask=row_ok, other=0)
        src += first.to(tl.int64)[:, None] * src_stride + cols[None, :]
        for t in range(0, ksize):
            w = tl.load(taps + t * L + rows, mask=row_ok, other=0)
            x = tl.load(src + t * src_stride, mask=(w != 0)[:, None] & col_ok[None, :], other=0)
            acc += x.to(tl.int32) * w[:, None]
    y = tl.minimum(tl.maximum((acc + (1 << (bits - 1))) >> bits, 0), 255)
    start_next_kernel(PDL)
    tl.store(dst + rows.to(tl.int64)[:, None] * dst_stride + cols[None, :], y.to(tl.uint8),
             mask=row_ok[:, None] & col_ok[None, :])


def resize_crop(pixels: torch.Tensor, table: torch.Tensor, channels: int, size: tuple[int, int], filter: str,
                fixed_point: str) -> torch.Tensor:
    """Each image of a batch resized with `filter` and cropped to `size` = (h, w): uint8 [B, channels, h, w].

    pixels: uint8, 1-D: the images' [channels, H_i, W_i] pixels, one after another.
    table: int64 [B, 8] on the CPU, a row per image (TABLE_COLUMNS): the offset of its first pixel in `pixels`, H_i,
      W_i, the resized height and width, top and left: output pixel (y, x) is the resized image's (top + y,
      left + x), zero outside it; and 1 where the columns are filtered first (Pillow 13 does, where the height
      shrinks by more than twice the width), else 0.
    filter: one of FILTERS; fixed_point: "pillow" (Image.resize) or "torch" (F.interpolate of uint8, antialiased).
    """
    device = check_image_batch(pixels, table, TABLE_COLUMNS)
    if table.shape[0] == 0:
        raise ValueError("table must have a row for at least one image, got none")
    out_h, out_w = size
    if channels < 1 or out_h < 1 or out_w < 1:
        raise ValueError(f"channels and size must be positive, got {channels} and {tuple(size)}")
    if filter not in FILTERS:
        raise ValueError(f"filter must be one of {FILTERS}, got {filter!r}")
    if fixed_point not in FIXED_POINT:
        raise ValueError(f"fixed_point must be one of {FIXED_POINT}, got {fixed_point!r}")
    offset, (height, width), sides, columns_first = table[:, 0], table[:, 1:3].T, table[:, 1:5], table[:, 7]
    end = offset + channels * height * width
    bad = (sides < 1).any(1) | (offset < 0) | (end > pixels.numel()) | ((columns_first != 0) & (columns_first != 1))
    if bad.any():
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"table row {i}: the sizes must be positive, the image's {channels} x height x width pixels "
                         f"from its offset must lie in the {pixels.numel()} of pixels and the order must be 0 or 1, "
                         f"got {table[i].tolist()}")
    # Taps per output pixel, as the kernel counts them: 2 ceil(support * max(n_in / n_out, 1)) + 1.
    stretch = (sides[:, :2].double() / sides[:, 2:]).clamp(min=1.0)
    support = SUPPORT[filter]
    kmax = 2 * math.ceil((support * stretch).max().item()) + 1
    # The intermediate: each image's first pass, [channels, H_i, w] (rows first; rows the window needs are written) or
    # [channels, h, W_i] (columns first).
    planes = channels * torch.where(columns_first == 1, out_h * width, height * out_w)
    batch = table.shape[0]
    groups = [(columns_first == order).nonzero()[:, 0] for order in (0, 1)]
    device_table = torch.cat([table, (torch.cumsum(planes, 0) - planes)[:, None]], 1).to(device)   # + tmp offset
    images = torch.cat(groups).int().to(device)
    positions = max(out_h, out_w)
    first = torch.empty((batch, 2, positions), device=device, dtype=torch.int32)
    taps = torch.empty((batch, 2, kmax, positions), device=device, dtype=torch.int32)
    meta = torch.empty((batch, 2, 4), device=device, dtype=torch.int32)
    tmp = torch.empty(int(planes.sum()), device=device, dtype=torch.uint8)
    out = torch.empty((batch, channels, out_h, out_w), device=device, dtype=torch.uint8)
    # Weights in float64 with every multiply and add rounded on its own, as the libraries' C code computes them.
    _resize_weights_kernel[(batch, 2)](
        device_table, first, taps, meta, out_h, out_w, positions, kmax, FILTER=FILTERS.index(filter),
        SUPPORT=support, TORCH=fixed_point == "torch", POSITIONS=POSITIONS, num_warps=4, enable_fp_fusion=False,
        **pdl(device, batch * 2),
    )
    done = 0
    for order, group in enumerate(groups):   # rows first, then the images whose columns go first
        if len(group) == 0:
            continue
        members = images[done:done + len(group)]
        done += len(group)
        # The first pass covers the window along its axis and the whole input across it; the second, the window.
        first_extent = (out_h, int(width[group].max())) if order else (int(height[group].max()), out_w)
        for axis, src, dst, extent in ((1 - order, pixels, tmp, first_extent), (order, tmp, out, size)):
            grid = (len(group) * channels, cdiv(extent[0], BLOCK), cdiv(extent[1], BLOCK))
            _resize_pass_kernel[grid](
                src, dst, device_table, members, first, taps, meta, channels, out_h, out_w, positions, kmax,
                AXIS=axis, FIRST=src is pixels, BLOCK_R=BLOCK, BLOCK_C=BLOCK, num_warps=4,
                **pdl(device, math.prod(grid)),
            )
    return out
