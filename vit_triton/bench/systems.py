"""The systems `vit-triton bench` times: vit-triton and its peers, built on one model shape.

vit-triton (eager, and replayed as CUDA graphs by runtime.CUDAGraphRunner) takes the HF model's
weights (from_hf), so its output is checked against HF before any timing; timm and torch.compile(timm)
run timm's own random weights of the same shape (speed does not depend on the values). The HF model is
transformers' ViT, DINOv2 with registers, CLIP or SigLIP vision tower, whichever expresses the shape; where none
does, vit-triton takes timm's weights instead. The timm model is a VisionTransformer built from the
shape, or a timm architecture itself (bench --model with a timm name). A peer whose package is missing is
skipped with a note.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..model.config import ViTConfig
from ..runtime import CUDAGraphRunner
from .numerics import randomize_

COMPILE_MODES = ("default", "max-autotune-no-cudagraphs", "reduce-overhead")
# timm:exact-fp32: timm eager with PyTorch's default float32 matmuls (exact, no tf32), beside a tf32 run.
SYSTEMS = ("vit-triton", "vit-triton+cudagraph", "hf", "timm", "timm:exact-fp32",
           *(f"timm+compile:{m}" for m in COMPILE_MODES))


@dataclass
class System:
    name: str
    run: Callable[[torch.Tensor], torch.Tensor] | None
    note: str = ""


def hf_model(cfg: ViTConfig) -> torch.nn.Module | None:
    """transformers' model of `cfg`'s shape (random weights, sdpa attention): ViT, DINOv2 with registers, DINOv3,
    CLIP's or SigLIP's vision tower, or None where none of them expresses it."""
    import transformers

    act = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "quick_gelu": "quick_gelu", "swiglu": "silu"}[cfg.act]
    shape = dict(image_size=cfg.image_size, patch_size=cfg.patch_size, num_channels=cfg.in_chans,
                 hidden_size=cfg.embed_dim, num_hidden_layers=cfg.depth, num_attention_heads=cfg.num_heads,
                 layer_norm_eps=cfg.norm_eps, hidden_act=act, attn_implementation="sdpa")
    if (cfg.rope.startswith("centered") and cfg.rope_half and not cfg.abs_pos_embed and cfg.class_token
            and not cfg.dist_token and cfg.final_norm and not cfg.fc_norm and not cfg.mlp_norm and not cfg.attn_norm
            and cfg.norm == "layernorm" and not cfg.num_classes and not cfg.proj_dim):
        # DINOv3 (pooler_output: the class token); the key projection has no bias
        return transformers.DINOv3ViTModel(transformers.DINOv3ViTConfig(
            **shape, intermediate_size=cfg.mlp_dim, num_register_tokens=cfg.reg_tokens,
            use_gated_mlp=cfg.act == "swiglu", query_bias=cfg.qkv_bias, value_bias=cfg.qkv_bias,
            proj_bias=cfg.proj_bias, mlp_bias=cfg.mlp_bias, rope_theta=cfg.rope_theta))
    if (cfg.rope != "none" or cfg.act == "swiglu" or not cfg.abs_pos_embed or cfg.mlp_norm or cfg.attn_norm
            or cfg.norm != "layernorm" or cfg.pool_heads or cfg.pool_mlp_dim or cfg.pos_resample == "bucket"):
        return None
    if (not cfg.class_token and not cfg.reg_tokens and cfg.pool == "map" and cfg.patch_bias and not cfg.pre_norm
            and cfg.final_norm and not cfg.fc_norm and cfg.qkv_bias and not cfg.num_classes and not cfg.proj_dim):
        return transformers.SiglipVisionModel(transformers.SiglipVisionConfig(**shape, intermediate_size=cfg.mlp_dim))
    one_token = cfg.class_token and not cfg.dist_token and cfg.pool == "token" and not cfg.proj_dim
    if not one_token:
        return None
    if not cfg.reg_tokens and cfg.pos_embed_prefix and cfg.patch_bias and not cfg.pre_norm and cfg.final_norm \
            and not cfg.fc_norm:
        config = transformers.ViTConfig(**shape, intermediate_size=cfg.mlp_dim, qkv_bias=cfg.qkv_bias,
                                        num_labels=max(cfg.num_classes, 1))
        cls = transformers.ViTForImageClassification if cfg.num_classes else transformers.ViTModel
        return cls(config, add_pooling_layer=False) if cls is transformers.ViTModel else cls(config)
    if cfg.reg_tokens and not cfg.pos_embed_prefix and cfg.patch_bias and not cfg.pre_norm and cfg.final_norm \
            and not cfg.num_classes and cfg.mlp_dim % cfg.embed_dim == 0:
        return transformers.Dinov2WithRegistersModel(transformers.Dinov2WithRegistersConfig(
            **shape, mlp_ratio=cfg.mlp_dim // cfg.embed_dim, qkv_bias=cfg.qkv_bias, num_register_tokens=cfg.reg_tokens))
    if not cfg.reg_tokens and cfg.pos_embed_prefix and not cfg.patch_bias and cfg.pre_norm and cfg.final_norm \
            and cfg.qkv_bias and not cfg.num_classes:
        return transformers.CLIPVisionModel(transformers.CLIPVisionConfig(**shape, intermediate_size=cfg.mlp_dim))
    return None


def timm_model(cfg: ViTConfig) -> torch.nn.Module:
    """timm's VisionTransformer of the same shape as `cfg` (random weights)."""
    from functools import partial

    from timm.models.vision_transformer import VisionTransformer

    act = {"gelu": "gelu", "gelu_tanh": "gelu_tanh", "quick_gelu": "quick_gelu"}[cfg.act]
    return VisionTransformer(
        img_size=cfg.image_size, patch_size=cfg.patch_size, in_chans=cfg.in_chans, num_classes=cfg.num_classes,
        global_pool=cfg.pool, embed_dim=cfg.embed_dim, depth=cfg.depth, num_heads=cfg.num_heads,
        mlp_ratio=cfg.mlp_dim / cfg.embed_dim, qkv_bias=cfg.qkv_bias, class_token=cfg.class_token,
        no_embed_class=not cfg.pos_embed_prefix, reg_tokens=cfg.reg_tokens, pre_norm=cfg.pre_norm,
        final_norm=cfg.final_norm, fc_norm=cfg.fc_norm, act_layer=act,
        norm_layer=partial(torch.nn.LayerNorm, eps=cfg.norm_eps))


def _perturbed(module: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """Random weights everywhere, in dtype, in eval mode."""
    return randomize_(module).to(device=device, dtype=dtype).eval()


def build_systems(cfg: ViTConfig, dtype: torch.dtype, device: torch.device, names: tuple[str, ...] = SYSTEMS,
                  timm_module: torch.nn.Module | None = None) -> tuple[list[System], torch.nn.Module, torch.nn.Module]:
    """The systems to time, and (reference module, vit-triton model) for the correctness check.

    The reference is HF's model when it can express the config, else timm's: `timm_module` (a timm
    architecture that cfg describes) or a VisionTransformer of cfg's shape.
    """
    from .. import from_hf, from_timm

    systems: list[System] = []
    hf = timm_ref = None
    try:
        hf = hf_model(cfg)
        if hf is None:
            systems.append(System("hf", None, "no transformers model of this shape"))
        else:
            hf = _perturbed(hf, dtype, device)
            systems.append(System("hf", lambda px: _hf_output(hf, px)))
    except ImportError:
        systems.append(System("hf", None, "transformers is not installed"))
    try:
        if hf is None or any(n.startswith("timm") for n in names):
            timm_ref = _perturbed(timm_module if timm_module is not None else timm_model(cfg), dtype, device)
            systems.append(System("timm", timm_ref))
            systems.append(System("timm:exact-fp32", _exact_fp32(timm_ref)) if dtype == torch.float32 else
                           System("timm:exact-fp32", None, "float32 runs only"))
            if any(n.startswith("timm+compile") for n in names):
                allow_recompiles()
            for mode in COMPILE_MODES:
                if f"timm+compile:{mode}" in names:
                    systems.append(System(f"timm+compile:{mode}", torch.compile(copy.deepcopy(timm_ref), mode=mode,
                                                                                 dynamic=False)))
    except ImportError:
        systems += [System(n, None, "timm is not installed") for n in SYSTEMS if n.startswith("timm")]
    reference = hf if hf is not None else timm_ref
    if reference is None:
        raise RuntimeError("bench needs transformers or timm to check vit-triton's output against")
    ours = from_hf(hf) if hf is not None else from_timm(timm_ref)
    graphed = (System("vit-triton+cudagraph", CUDAGraphRunner(ours)) if device.type == "cuda"
               else System("vit-triton+cudagraph", None, "CUDA graphs need a CUDA device"))
    systems[:0] = [System("vit-triton", ours), graphed]
    return [s for s in systems if s.name in names], reference, ours


def _exact_fp32(model: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    """model's forward with float32 matmuls exact whatever the run's precision: what PyTorch gives a
    float32 user who has not opted in to tf32 (its default; convolutions follow cudnn.allow_tf32)."""
    def run(pixels: torch.Tensor) -> torch.Tensor:
        before = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            return model(pixels)
        finally:
            torch.set_float32_matmul_precision(before)
    return run


def allow_recompiles(limit: int = 64) -> None:
    """Every compile mode at every batch size compiles timm's one forward anew, and dynamo falls back
    to eager once a code object has been compiled recompile_limit (8) times: it would time eager
    timm under a compile label. Raise the limit, and make hitting it an error rather than a fallback."""
    import torch._dynamo

    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # the newer name, then the older
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), limit))
            break
    if hasattr(config, "fail_on_recompile_limit_hit"):
        config.fail_on_recompile_limit_hit = True


def _hf_output(model: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """Logits, else the pooled output (DINOv2's normalized class token, CLIP's post-normed one; a ViTModel built
    without its pooler: the class token), which is our forward's output."""
    out = model(pixels)
    if hasattr(out, "logits"):
        return out.logits
    return out.pooler_output if out.pooler_output is not None else out.last_hidden_state[:, 0]


def reference_output(reference: torch.nn.Module, pixels: torch.Tensor) -> torch.Tensor:
    """The output vit-triton must match: HF's logits / class token, or timm's forward."""
    if hasattr(reference, "config") and hasattr(reference.config, "model_type"):
        return _hf_output(reference, pixels)
    return reference(pixels)
