"""Triton kernels, one fused operation per file, each with a launcher taking and returning tensors."""

from .attention import fused_attention
from .layer_norm import layer_norm, layer_norm_stats
from .linear import ACTIVATIONS, fold_layer_norm, linear, norm_foldable
from .patch_embed import patch_embed
from .token_mean import token_mean

__all__ = ["ACTIVATIONS", "fold_layer_norm", "fused_attention", "layer_norm", "layer_norm_stats", "linear", "norm_foldable", "patch_embed",
           "token_mean"]
