"""Reading an image file into a PIL image, or a reason why it cannot be read.

Decoding is the only place where a file's content can fail us, so it is the only place where errors
are caught and turned into a reason (UnreadableImage): a run over a million files skips the bad ones
and lists them, while a bug in the code after decoding still stops the run. The EXIF orientation is
applied (as transformers' load_image does), so that a phone's photo is seen upright.
"""

from __future__ import annotations

import io
import os

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
