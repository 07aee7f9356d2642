"""Triton kernels, one fused operation per file, each with a launcher taking and returning tensors."""

from .activation import ACTIVATIONS
from .attention import attention_backward, fused_attention
from .chroma import fancy_upsample
from .common import LaunchOptions, current_launch_options, launch_options
from .layer_norm import add_layer_norm, layer_norm, layer_norm_backward
from .linear import linear, linear_backward, linear_partials, split_k
from .patch_embed import patch_embed, patch_embed_backward
from .resize import resize_crop
from .tf32 import round_to_tf32
from .token_mean import token_mean, token_mean_backward

__all__ = ["ACTIVATIONS", "LaunchOptions", "add_layer_norm", "attention_backward", "current_launch_options",
           "fancy_upsample", "fused_attention", "launch_options", "layer_norm", "layer_norm_backward", "linear",
           "linear_backward", "linear_partials", "patch_embed", "patch_embed_backward", "resize_crop", "round_to_tf32",
           "split_k", "token_mean", "token_mean_backward"]
