"""The ViT model: its config and the nn.Module built from the kernels."""

from .config import ViTConfig
from .vit import ViT

__all__ = ["ViT", "ViTConfig"]
