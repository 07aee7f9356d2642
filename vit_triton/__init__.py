"""vit-triton: Vision Transformers from Triton kernels, numerically equal to HuggingFace and timm."""

from .model import ViT, ViTConfig

__version__ = "0.1.0"
__all__ = ["ViT", "ViTConfig", "__version__"]
