"""Reading an image file into a PIL image, or a reason why it cannot be read; and, for embed --decode gpu,
which JPEGs nvJPEG may decode instead and their decoding in batches on a CUDA device.

Decoding is the only place where a file's content can fail us, so it is the only place where errors
are caught and turned into a reason (UnreadableImage): a run over a million files skips the bad ones
and lists them, while a bug in the code after decoding still stops the run. The EXIF orientation is
applied (as transformers' load_image does), so that a phone's photo is seen upright.
"""

from __future__ import annotations

import functools
import io
import os

import torch
from PIL import Image, ImageOps, UnidentifiedImageError


class UnreadableImage(Exception):
    """A file that is not a decodable image; str() is the reason, written to the skipped-files list."""


def read_file(path: str | os.PathLike) -> bytes:
    """The bytes of the file at `path`. Raises UnreadableImage for a missing, unreadable or empty file."""
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as e:
        raise UnreadableImage(f"cannot read file: {e.strerror or e}") from None
    if not data:
        raise UnreadableImage("empty file")
    return data


def decode_image(data: bytes, mode: str = "RGB") -> Image.Image:
    """The fully decoded image in the encoded `data`, in PIL `mode` ("RGB", or "L" for one-channel models).

    Raises UnreadableImage for empty, non-image, truncated or corrupt data. Turned upright by its EXIF
    orientation tag, if any. Transparency is dropped (Pillow's convert), as timm's and torchvision's
    loaders do; only the first frame of an animation is used.
    """
    if not data:
        raise UnreadableImage("empty file")
    try:
        with Image.open(io.BytesIO(data)) as image:
            ImageOps.exif_transpose(image, in_place=True)  # decodes the whole image: truncation shows here
            return image.convert(mode)
    except UnidentifiedImageError:
        raise UnreadableImage("not an image (unrecognised format)") from None
    except Exception as e:  # noqa: BLE001 -- Pillow raises OSError, SyntaxError, ValueError, ... on bad data
        raise UnreadableImage(f"truncated or corrupt image: {e}") from None


def load_image(path: str | os.PathLike, mode: str = "RGB") -> Image.Image:
    """decode_image of the file at `path`; UnreadableImage also for a missing or unreadable file."""
    return decode_image(read_file(path), mode)


_EXIF_ORIENTATION = 0x0112


def nvjpeg_decodable(data: bytes) -> bool:
    """Whether nvJPEG should decode `data`: a baseline colour (YCbCr) JPEG with no EXIF turn, whole (it ends in the
    end-of-image marker), read from its header alone. Everything else (PNG, WebP, progressive, CMYK or grayscale
    JPEGs, whose RGB from nvJPEG was up to 237 levels off on an H100, a turned photo, a broken header, a truncated
    file, which nvJPEG would decode into grey without a word) is decode_image's, which also names what is wrong
    with a bad file."""
    if data[:3] != b"\xff\xd8\xff" or data.rstrip(b"\0")[-2:] != b"\xff\xd9":
        return False
    try:
        with Image.open(io.BytesIO(data)) as image:
            return (image.format == "JPEG" and image.mode == "RGB" and "progression" not in image.info
                    and image.getexif().get(_EXIF_ORIENTATION, 1) == 1)
    except Exception:  # noqa: BLE001 -- any header Pillow cannot read is decode_image's to report
        return False


def nvjpeg_available(device: torch.device) -> str | None:
    """None where torchvision decodes JPEGs with nvJPEG on `device` (a small one is tried there), else why not."""
    if device.type != "cuda":
        return f"nvJPEG decodes on a CUDA device, and this run is on {device}"
    try:
        from torchvision.io import decode_jpeg
    except ImportError:
        return "torchvision is not installed (pip install 'vit-triton[embed]')"
    probe = io.BytesIO()
    Image.new("RGB", (8, 8)).save(probe, "JPEG")
    try:
        decode_jpeg([torch.frombuffer(bytearray(probe.getvalue()), dtype=torch.uint8)], device=device)
    except RuntimeError as e:  # a torchvision built without nvJPEG, or a device it cannot use
        return f"torchvision cannot decode JPEGs on {device}: {e}"
    return None


def decode_jpegs(encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | str]:
    """JPEGs (uint8 [n] CPU tensors of their bytes) decoded by nvJPEG on `device`: uint8 RGB [3, H, W] each, ready
    for the current stream, or the error nvJPEG gave for that one (the batch is decoded one by one when it fails
    as a whole). On the CPU, torchvision's libjpeg-turbo decodes them instead."""
    if device.type != "cuda":
        return _decode_jpegs(encoded, device)
    # torchvision's nvJPEG decoder allocates its outputs on the current stream but writes them on a stream of its
    # own that waits for nothing there: memory freed on the current stream with reads still queued would be
    # overwritten. So they are allocated on a stream where nothing runs, and the current stream reads them.
    current = torch.cuda.current_stream(device)
    with torch.cuda.stream(_output_stream(device)):
        decoded = _decode_jpegs(encoded, device)
        current.wait_stream(torch.cuda.current_stream(device))   # which torchvision made wait for its decoding
    for image in decoded:
        if isinstance(image, torch.Tensor):
            image.record_stream(current)
    return decoded


@functools.lru_cache(maxsize=None)
def _output_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _decode_jpegs(encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | str]:
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return [image.contiguous() for image in decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)]
    except RuntimeError:
        pass
    decoded = []
    for data in encoded:
        try:
            decoded.append(decode_jpeg(data, mode=ImageReadMode.RGB, device=device).contiguous())
        except RuntimeError as e:
            decoded.append(str(e))
    return decoded
