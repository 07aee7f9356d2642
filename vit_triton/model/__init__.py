"""The ViT model: its config and the nn.Module built from the kernels."""

from .config import PRESETS, ViTConfig
from .vit import ViT

__all__ = ["PRESETS", "ViT", "ViTConfig"]
