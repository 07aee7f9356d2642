"""A converted model of every family trains like its timm or transformers reference: from the same weights, on the
same batch, the losses of a few AdamW steps agree to float32 precision (the reference in PyTorch's float32 on the
CPU, vit-triton through its kernels), and so do the weights after them."""

import copy

import pytest
import torch
import torch.nn.functional as F

from tests.checkpoints import family_outputs, hf_model
from tests.numerics import DEVICE, FP32_TOL, randomize_
from vit_triton import from_hf, from_timm

TINY = dict(img_size=32, patch_size=8, embed_dim=64, num_heads=2, depth=1)   # one block: the interpreter is slow
STEPS = 3
# Each family's reference: a timm architecture (shrunk by create_model's arguments) or a transformers class.
TIMM = {
    "vit": ("vit_tiny_patch16_224", dict(num_classes=5)),
    "deit3-layer_scale": ("deit3_small_patch16_224", dict(num_classes=5)),
    "dinov2-registers": ("vit_small_patch14_reg4_dinov2", dict(num_classes=0)),
    "dinov3-rope": ("vit_small_patch16_dinov3", dict(num_classes=0)),
    "eva02-rope-swiglu": ("eva02_tiny_patch14_224", dict(num_classes=5)),
    "rope-mixed-learned-freqs": ("vit_small_patch16_rope_mixed_224", dict(num_classes=0, init_values=0.5)),
    "clip": ("vit_base_patch16_clip_224", dict(num_classes=5)),
    "siglip-map": ("vit_base_patch16_siglip_224", dict(num_classes=0)),
    "aimv2": ("aimv2_large_patch14_224", dict(num_classes=0, mlp_ratio=1.5)),
    # the attention pool's own heads and MLP width; the norm of the attention's output
    "pe-core-map": ("vit_pe_core_tiny_patch16_384", dict(num_classes=0, attn_pool_num_heads=4, mlp_ratio=1.5)),
    "eva02-clip-attn-norm": ("eva02_base_patch16_clip_224", dict(num_classes=5)),
    # a relative position bias table in every block (its gradient scattered back from the bias), LayerScale, no key bias
    "beit-rel_pos_bias": ("beit_base_patch16_224", dict(num_classes=5)),
}
HF = {
    "hf-vit": ("ViTForImageClassification", dict(num_labels=5)),
    # transformers' DINOv3 rescales the RoPE coordinates at random in training by default; vit-triton does not
    "hf-dinov3": ("DINOv3ViTModel", dict(layerscale_value=0.5, num_register_tokens=2, pos_embed_rescale=None)),
    "hf-siglip": ("SiglipVisionModel", {}),
    # the position rows picked by bucketing; InternVL's LayerScale, q, k, v without bias and patch mean
    "hf-smolvlm": ("SmolVLMVisionTransformer", dict(depth=1)),
    "hf-internvl": ("InternVLVisionModel", dict(depth=1)),
    # one table for both blocks, whose gradient sums theirs; a table in the block. transformers' BEiT drops paths by
    # default (drop_path_rate 0.1), vit-triton only where asked
    "hf-beit-shared-rel_pos_bias": ("BeitForImageClassification", dict(num_labels=5, drop_path_rate=0.0,
                                                                        use_shared_relative_position_bias=True)),
    "hf-data2vec-rel_pos_bias": ("Data2VecVisionModel", dict(depth=1, drop_path_rate=0.0,
                                                             use_relative_position_bias=True)),
}


def losses(model, run, pixels, target) -> list[float]:
    """The loss (MSE of run(model, pixels) to target) before each of STEPS AdamW steps, and after the last."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)
    out = []
    for _ in range(STEPS):
        loss = F.mse_loss(run(model, pixels).to(target.dtype), target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out.append(loss.item())
    with torch.no_grad():
        out.append(F.mse_loss(run(model, pixels).to(target.dtype), target).item())
    return out


def assert_trains_alike(reference, run_reference, ours, pixels):
    """Each loss of ours within the float32 rule of the reference's trajectory in float64: at most 1.5x the largest
    relative distance of the reference's own float32 losses from it over the steps (Adam's normalised steps carry
    each last-bit difference into every weight, so no fixed bound fits; one scalar's distance may be near zero by
    chance), or the float32 tolerance of a kernel (1e-5) where that is smaller."""
    reference.train(), ours.train()
    with torch.no_grad():
        target = torch.randn_like(run_reference(reference, pixels).float())
    exact = losses(copy.deepcopy(reference).double(), run_reference, pixels.double(), target.double())
    theirs = losses(reference, run_reference, pixels, target)
    mine = losses(ours, lambda m, px: m(px.to(DEVICE)).cpu(), pixels, target)
    assert exact[-1] < exact[0]   # it learns
    bound = max(max(abs(b - want) / want for b, want in zip(theirs, exact)) * 1.5, FP32_TOL)
    for step, (a, b, want) in enumerate(zip(mine, theirs, exact)):
        assert abs(a - want) <= bound * want, (f"step {step}: loss {a}, the reference's {b} in float32, {want} in "
                                               f"float64 (all: {mine} / {theirs} / {exact})")


@pytest.mark.slow
@pytest.mark.parametrize("family", TIMM)
def test_timm_families_train_alike(family):
    import timm

    name, kw = TIMM[family]
    torch.manual_seed(0)
    reference = randomize_(timm.create_model(name, pretrained=False, **{**TINY, **kw}), seed=1)
    ours = from_timm(reference).to(DEVICE, torch.float32)
    pixels = torch.randn(2, 3, 32, 32)
    assert_trains_alike(reference, lambda m, px: m(px), ours, pixels)


@pytest.mark.slow
@pytest.mark.parametrize("family", HF)
def test_transformers_families_train_alike(family):
    name, kw = HF[family]
    torch.manual_seed(0)
    reference = hf_model(name, seed=1, **kw)
    ours = from_hf(reference).to(DEVICE, torch.float32)
    pixels = torch.randn(2, 3, 32, 32)

    def run(model, px):
        out = model(px)
        return out.logits if hasattr(out, "logits") else family_outputs(model, px)[1]

    assert_trains_alike(reference, run, ours, pixels)
