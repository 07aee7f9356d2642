"""The ViT model: its config and the nn.Modules built from the kernels (the ViT, an attention-pool head)."""

from .attention_pool import AttentionPool
from .config import PRESETS, ViTConfig
from .vit import ViT

__all__ = ["PRESETS", "AttentionPool", "ViT", "ViTConfig"]
