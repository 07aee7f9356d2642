"""Triton kernels, one fused operation per file, each with a launcher taking and returning tensors."""

from .attention import fused_attention
from .layer_norm import add_layer_norm, layer_norm
from .linear import ACTIVATIONS, linear, linear_partials, split_k
from .patch_embed import patch_embed
from .tf32 import round_to_tf32
from .token_mean import token_mean

__all__ = ["ACTIVATIONS", "add_layer_norm", "fused_attention", "layer_norm", "linear", "linear_partials", "patch_embed",
           "round_to_tf32", "split_k", "token_mean"]
