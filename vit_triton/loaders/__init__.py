"""Checkpoint loaders: HuggingFace, timm and OpenCLIP models and checkpoints to (ViTConfig, state dict in our names),
and save_pretrained, the way back into the source library's layout.

All key mapping lives here; the model knows nothing of checkpoints.
"""

from .files import CheckpointNotFound
from .hf import from_hf, hf_config_to_vit, hf_num_classes, hf_state_dict_to_vit
from .pretrained import CheckpointInfo, from_pretrained, read_checkpoint
from .save import save_pretrained
from .timm import from_timm, timm_config_to_vit, timm_state_dict_to_vit

__all__ = ["CheckpointInfo", "CheckpointNotFound", "from_hf", "from_pretrained", "from_timm", "hf_config_to_vit",
           "hf_num_classes", "hf_state_dict_to_vit", "read_checkpoint", "save_pretrained", "timm_config_to_vit",
           "timm_state_dict_to_vit"]
