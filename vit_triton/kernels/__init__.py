"""Triton kernels, one fused operation per file, each with a launcher taking and returning tensors."""

from .attention import fused_attention
from .layer_norm import layer_norm
from .linear import ACTIVATIONS, linear
from .patch_embed import patch_embed
from .token_mean import token_mean

__all__ = ["ACTIVATIONS", "fused_attention", "layer_norm", "linear", "patch_embed", "token_mean"]
