"""Checkpoint loaders: HuggingFace and timm models to (ViTConfig, state dict in our names).

All key mapping lives here; the model knows nothing of checkpoints.
"""

from .hf import from_hf, hf_config_to_vit, hf_num_classes, hf_state_dict_to_vit
from .timm import from_timm, timm_config_to_vit, timm_state_dict_to_vit

__all__ = ["from_hf", "from_timm", "hf_config_to_vit", "hf_num_classes", "hf_state_dict_to_vit",
           "timm_config_to_vit", "timm_state_dict_to_vit"]
