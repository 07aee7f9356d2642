"""Checkpoint loaders: HuggingFace and timm models to (ViTConfig, state dict in our names)."""
