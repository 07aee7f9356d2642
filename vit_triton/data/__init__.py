"""Image decoding and the checkpoint's own preprocessing (resize, center crop, rescale, normalize)."""

from .decode import UnreadableImage, load_image
from .preprocess import Preprocess

__all__ = ["Preprocess", "UnreadableImage", "load_image"]
