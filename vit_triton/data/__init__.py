"""Image decoding and the checkpoint's own preprocessing (resize, center crop, rescale, normalize)."""

from .decode import UnreadableImage, decode_image, load_image, read_file
from .preprocess import Preprocess

__all__ = ["Preprocess", "UnreadableImage", "decode_image", "load_image", "read_file"]
