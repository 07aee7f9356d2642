"""The ViT module: parity with the PyTorch reference over config variants, and bad input."""

import os
import subprocess
import sys

import pytest
import torch

from tests.kernels.checks import tf32_matmuls
from tests.numerics import DEVICE, assert_close, randomize_
from tests.test_training import assert_grads_close, grads, reference_grads
from vit_triton import ops
from vit_triton.model import ViT, ViTConfig, vit
from vit_triton.model.reference import reference_forward
from vit_triton.model.rel_pos_bias import relative_position_index

SMALL = dict(image_size=24, patch_size=8, embed_dim=64, depth=2, num_heads=2, mlp_dim=96)

# Heads of 50 classes: a relative error over 3 x 50 logits is a stable measure in bf16; over a dozen
# values, it swings past the 1.5x rule by chance in a few percent of draws.
VARIANTS = {
    "cls-head": dict(num_classes=50),
    "avg-fc_norm-registers": dict(pool="avg", fc_norm=True, reg_tokens=3, num_classes=50, act="gelu_tanh"),
    "clip-pre_norm-no_patch_bias": dict(pre_norm=True, patch_bias=False, act="quick_gelu", norm_eps=1e-5),
    "no-class-no_embed_class": dict(class_token=False, pool="avg", pos_embed_prefix=False, reg_tokens=1,
                                    qkv_bias=False, final_norm=False),
    "deit-distilled": dict(dist_token=True, head_dist=True, num_classes=50),
    "deit-dist_token-registers": dict(dist_token=True, reg_tokens=2, num_classes=50),
    "siglip-map-no-class": dict(class_token=False, pool="map", act="gelu_tanh"),
    "clip-projection": dict(pre_norm=True, patch_bias=False, fc_norm=True, proj_dim=40),
    "eva02-swiglu-mlp_norm-rope-axial": dict(act="swiglu", mlp_norm=True, rope="axial", rope_ref_grid=(16, 16),
                                             pool="avg", fc_norm=True, num_classes=50),
    "dinov3-rope-centered-half-registers-no-pos": dict(rope="centered", rope_theta=100.0, rope_half=True,
                                                       abs_pos_embed=False, reg_tokens=4),
    "rope-mixed-xy-head": dict(rope="mixed", rope_xy=True, rope_theta=10.0, num_classes=50),
    "rmsnorm-swiglu-no-biases": dict(norm="rmsnorm", act="swiglu", qkv_bias=False, proj_bias=False,
                                     mlp_bias=False, class_token=False, pool="avg"),
    # AIMv2 native: the patch embeddings normalised, then a sin-cos table added; the head's query is its latent
    "aimv2-embed_norm-sincos-map-no-q-no-mlp": dict(norm="rmsnorm", act="swiglu", qkv_bias=False, proj_bias=False,
                                                    mlp_bias=False, class_token=False, embed_norm=True,
                                                    pos_sincos=True, pool="map", pool_query_proj=False,
                                                    pool_mlp=False),
    # EVA02-CLIP: a norm of the attention's output before proj
    "eva02-clip-attn_norm": dict(attn_norm=True, act="swiglu", mlp_norm=True, rope="axial", num_classes=50),
    # Perception Encoder: the attention pool's own heads and MLP width; OpenCLIP's timm towers: a biased projection
    "pe-map-own-heads-projection-bias": dict(pool="map", pool_heads=4, pool_mlp_dim=80, pre_norm=True,
                                             patch_bias=False, rope="axial", rope_xy=True, rope_offset=1.0,
                                             proj_dim=40, embed_proj_bias=True),
    # BEiT: a relative position bias table in every block (or one for all), LayerScale, no key bias, no absolute
    # position embedding, the patch mean normed after pooling
    "beit-rel_pos_bias-block": dict(rel_pos_bias="block", layer_scale=True, key_bias=False, abs_pos_embed=False,
                                    pool="avg", fc_norm=True, num_classes=50),
    "beit-rel_pos_bias-shared-abs_pos": dict(rel_pos_bias="shared", key_bias=False),
}


def _model(dtype, **kw) -> ViT:
    return randomize_(ViT(ViTConfig(**SMALL, **kw), device=DEVICE)).to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", VARIANTS)
def test_forward_matches_reference(variant, dtype):
    model = _model(dtype, **VARIANTS[variant])
    cfg = model.config
    pixels = torch.randn(3, 3, cfg.image_size, cfg.image_size, device=DEVICE).to(dtype)
    params = {k: v for k, v in model.state_dict().items()}
    params64 = {k: v.double() for k, v in params.items()}
    for features_only, ours in ((True, model.forward_features(pixels)), (False, model(pixels))):
        ref = reference_forward(cfg, params64, pixels.double(), features_only)
        theirs = reference_forward(cfg, params, pixels, features_only)
        assert_close(ours, ref, dtype, theirs)
    assert model(pixels).shape == (3, cfg.num_classes or cfg.embedding_dim)


# Each variant at images of 2 x 5 patches (the model's own grid is 3 x 3), with one of the resampling styles.
ANY_SIZE = [("cls-head", "bicubic"), ("avg-fc_norm-registers", "bicubic_float32_antialias"),
            ("no-class-no_embed_class", "bicubic_float32"), ("deit-distilled", "bicubic_float32_antialias"),
            ("dinov3-rope-centered-half-registers-no-pos", "bicubic"), ("rope-mixed-xy-head", "bicubic"),
            ("eva02-swiglu-mlp_norm-rope-axial", "bicubic_float32_antialias"),
            ("aimv2-embed_norm-sincos-map-no-q-no-mlp", "bicubic"),   # a sin-cos table is built, not resampled
            ("siglip-map-no-class", "bucket")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant, style", ANY_SIZE)
def test_another_non_square_size_matches_reference(variant, style, dtype):
    model = _model(dtype, **VARIANTS[variant], pos_resample=style)
    cfg = model.config
    pixels = torch.randn(3, 3, 16, 40, device=DEVICE).to(dtype)
    params = model.state_dict()
    params64 = {k: v.double() for k, v in params.items()}
    for features_only, ours in ((True, model.forward_features(pixels)), (False, model(pixels))):
        ref = reference_forward(cfg, params64, pixels.double(), features_only)
        assert_close(ours, ref, dtype, reference_forward(cfg, params, pixels, features_only))
    assert model.forward_features(pixels).shape == (3, cfg.num_prefix_tokens + 10, cfg.embed_dim)


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("variant", ["cls-head", "avg-fc_norm-registers", "no-class-no_embed_class"])
def test_forward_with_split_residual_gemms(monkeypatch, variant, splits):
    # Whatever the shapes: proj and fc2 cut along K, their sums left to the next LayerNorm, or not
    # cut at all. With no final norm to add them (fc_norm, final_norm=False) the last fc2 is not cut.
    asked = []
    monkeypatch.setattr(ops, "split_k", lambda *shape: asked.append(shape[:3]) or splits)
    model = _model(torch.bfloat16, **VARIANTS[variant])
    cfg = model.config
    pixels = torch.randn(2, 3, cfg.image_size, cfg.image_size, device=DEVICE).bfloat16()
    with torch.no_grad():   # split K is an inference plan: a stream autograd records is never split
        ours = model.forward_features(pixels)
    params = model.state_dict()
    ref = reference_forward(cfg, {k: v.double() for k, v in params.items()}, pixels.double(), True)
    assert_close(ours, ref, torch.bfloat16, reference_forward(cfg, params, pixels, True))
    m, d = 2 * cfg.num_tokens, cfg.embed_dim
    deferred_last = model.norm is not None
    fc2_deferred = [(m, d, cfg.mlp_dim)] * deferred_last
    assert asked == [(m, d, d), (m, d, cfg.mlp_dim)] * (cfg.depth - 1) + [(m, d, d)] + fc2_deferred


@pytest.mark.parametrize("variant", ["cls-head", "clip-pre_norm-no_patch_bias"])
def test_tf32_operands_rounded_by_their_producers_change_no_bit(monkeypatch, one_config, variant):
    # With float32 matmuls on tf32, the norms, qkv, attention and fc1 store their outputs rounded to tf32
    # and the GEMMs and attention after them do not round again: the same bits as every kernel rounding
    # its own operands. One launch config each (one_config): on a GPU the tuner may pick other tiles for
    # other flags, and other tiles sum in another order.
    model = _model(torch.float32, **VARIANTS[variant])
    pixels = torch.randn(2, 3, model.config.image_size, model.config.image_size, device=DEVICE)
    with tf32_matmuls():
        rounded_once = model(pixels)
        # On an H100 this test failed at times: a second forward of each kind tells a
        # forward that changes bits from call to call (or a first call, which rounds the weights' copies, from
        # the next) from flags that change them.
        assert torch.equal(model(pixels), rounded_once), "a second forward with the flags gave other bits"
        flagged = [m for m in model.modules() if isinstance(m, (vit.Linear, vit.LayerNorm))
                   and (getattr(m, "tf32_input", False) or m.tf32_output)]
        assert len(flagged) == 6 * model.config.depth   # norm1, qkv, proj, norm2, fc1 and fc2 of each block
        for m in flagged:
            m.tf32_output = False
            if isinstance(m, vit.Linear):
                m.tf32_input = False
        monkeypatch.setattr(vit, "attention", lambda qkv, q=None, **flags: ops.attention(qkv, q))
        rounded_by_consumers = model(pixels)
        assert torch.equal(model(pixels), rounded_by_consumers), "a second forward without the flags gave other bits"
        assert torch.equal(rounded_by_consumers, rounded_once)


def test_tf32_follows_weights_loaded_in_place():
    # tf32 GEMMs read rounded copies of the weights kept from the first call (kernels/tf32.py); loading
    # other weights into the model must reach them.
    model, other = _model(torch.float32), _model(torch.float32)
    pixels = torch.randn(2, 3, model.config.image_size, model.config.image_size, device=DEVICE)
    with tf32_matmuls():
        before = model(pixels)
        model.load_state_dict(other.state_dict())
        after = model(pixels)
        assert not torch.equal(after, before) and torch.equal(after, other(pixels))


@pytest.mark.parametrize("variant, checkpointed", [("beit-rel_pos_bias-block", False),
                                                  ("beit-rel_pos_bias-shared-abs_pos", True)])
def test_relative_position_bias_tables_get_the_references_gradients(variant, checkpointed):
    # The gather's gradient scattered back into each table: the shared one sums every block's
    model = _model(torch.float32, **VARIANTS[variant])
    model.set_grad_checkpointing(checkpointed)
    pixels = torch.randn(2, 3, 24, 24, device=DEVICE)
    weights = torch.randn(2, model.config.num_classes or model.config.embed_dim, device=DEVICE)
    got = grads(model, pixels, weights)
    tables = {name for name in got if "rel_pos_table" in name}
    assert tables and tables <= model.no_weight_decay()   # exempt from weight decay, as timm's Beit has them
    assert_grads_close(got, reference_grads(model, pixels, weights), torch.float32)


@pytest.mark.parametrize("grid", [(1, 1), (3, 3), (2, 5), (14, 14)])
def test_relative_position_index_is_timms(grid):
    from timm.models.beit import gen_relative_position_index

    assert torch.equal(relative_position_index(grid), gen_relative_position_index(grid))


def test_a_relative_position_bias_needs_the_checkpoints_grid():
    model = _model(torch.float32, **VARIANTS["beit-rel_pos_bias-block"])
    assert model.forward_features(torch.randn(1, 3, 31, 26, device=DEVICE)).shape == (1, 10, 64)   # 3 x 3 patches
    with pytest.raises(ValueError, match=r"the relative position bias is learned for 3 x 3 patches of 8 \(24 x 24 "
                                         r"images\): pixels must make that grid, got 24x32 \(3 x 4 patches\)"):
        model(torch.randn(1, 3, 24, 32, device=DEVICE))


def test_distilled_pre_logits_is_the_mean_of_class_and_distillation_tokens():
    model = _model(torch.float32, **VARIANTS["deit-distilled"])
    pixels = torch.randn(3, 3, 24, 24, device=DEVICE)
    features = model.forward_features(pixels)
    assert features.shape[1] == 2 + model.config.num_patches
    assert_close(model.forward_head(features, pre_logits=True), (features[:, 0] + features[:, 1]).double() / 2,
                 torch.float32)


@pytest.mark.parametrize("variant", ["cls-head", "deit-distilled", "no-class-no_embed_class"])
def test_an_empty_batch_gives_empty_outputs_of_the_right_shape(variant):
    model = _model(torch.float32, **VARIANTS[variant])
    cfg = model.config
    pixels = torch.randn(0, 3, cfg.image_size, cfg.image_size, device=DEVICE)
    tokens = model.forward_features(pixels)
    assert tokens.shape == (0, cfg.num_tokens, cfg.embed_dim) and tokens.dtype == torch.float32
    assert model(pixels).shape == (0, cfg.num_classes or cfg.embed_dim)
    assert model.forward_head(tokens, pre_logits=True).shape == (0, cfg.embed_dim)
    if DEVICE.type == "cuda":
        import vit_triton

        assert vit_triton.compile(model)(pixels).shape == (0, cfg.num_classes or cfg.embed_dim)


def test_float32_pixels_into_a_bf16_model():
    model = _model(torch.bfloat16, num_classes=3)
    pixels = torch.randn(2, 3, 24, 24, device=DEVICE)
    assert_close(model(pixels), model(pixels.bfloat16()), torch.float32)


@pytest.mark.parametrize(
    "shape, dtype, match",
    [
        ((3, 24, 24), torch.float32, r"4-D \[B, 3, H, W\]"),
        ((1, 1, 24, 24), torch.float32, r"3 channels"),
        ((1, 3, 32, 7), torch.float32, r"at least the patch size 8, got 32x7"),
        ((1, 3, 24, 24), torch.float64, r"float32 or torch.float16"),
        ((1, 3, 24, 24), torch.uint8, r"float32 or torch.float16"),
    ],
)
def test_bad_pixels(shape, dtype, match):
    model = _model(torch.float16)
    with pytest.raises(ValueError, match=match):
        model(torch.zeros(shape, dtype=dtype, device=DEVICE))


def test_pixels_on_another_device():
    model = _model(torch.float32)
    with pytest.raises(ValueError, match="model's device"):
        model(torch.randn(1, 3, 24, 24, device="meta"))


@pytest.mark.parametrize("kw, match", [
    (dict(image_size=7), "image_size 7 must be at least patch_size 8"),
    (dict(num_heads=3), "multiple of num_heads 3"),
    (dict(act="relu"), "act must be one of"),
    (dict(pool="max"), "pool must be one of"),
    (dict(pos_resample="bilinear"), r"pos_resample must be one of \('bicubic_float32_antialias', 'bicubic_float32', "
                                    r"'bicubic', 'bucket'\), got 'bilinear'"),
    (dict(class_token=False), "needs class_token=True"),
    (dict(dist_token=True, class_token=False, pool="avg"), "dist_token follows the class token"),
    (dict(head_dist=True, num_classes=3), "head_dist needs dist_token=True"),
    (dict(head_dist=True, dist_token=True), "head_dist needs dist_token=True, num_classes > 0"),
    (dict(norm="batchnorm"), r"norm must be one of \('layernorm', 'rmsnorm'\), got 'batchnorm'"),
    (dict(embed_norm=True), r"need no prefix tokens, got 1 \(class_token, dist_token, reg_tokens\)"),
    (dict(pos_sincos=True, class_token=False, pool="avg", embed_dim=66, num_heads=3),
     "pos_sincos needs abs_pos_embed=True and embed_dim a multiple of 4, got abs_pos_embed True and embed_dim 66"),
    (dict(pool_mlp=False), "pool_mlp=False needs pool 'map', got pool 'token'"),
    (dict(pool_heads=4), r"pool_heads and pool_mlp_dim shape the attention pool: they need pool 'map' \(pool_mlp_dim "
                         r"also pool_mlp\), got pool 'token' and pool_mlp True"),
    (dict(pool="map", pool_mlp=False, pool_mlp_dim=80), "got pool 'map' and pool_mlp False"),
    (dict(pool="map", pool_heads=3), "pool_heads must divide embed_dim 64 into heads of 16 to 256, got 3"),
    (dict(pool="map", pool_heads=8), "pool_heads must divide embed_dim 64 into heads of 16 to 256, got 8"),
    (dict(embed_proj_bias=True), "embed_proj_bias is the bias of the embedding projection: it needs proj_dim > 0"),
    (dict(rel_pos_bias="layer"), r"rel_pos_bias must be one of \('none', 'block', 'shared'\), got 'layer'"),
    (dict(rel_pos_bias="block", reg_tokens=1), r"rel_pos_bias needs the class token as the only prefix token \(its "
                                               r"table has rows for it alone\), got class_token True, dist_token "
                                               r"False and reg_tokens 1"),
])
def test_bad_config(kw, match):
    with pytest.raises(ValueError, match=match):
        ViTConfig(**{**SMALL, **kw})


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the CPU-without-interpreter error needs a machine without CUDA")
def test_cpu_without_interpreter_is_a_clear_error():
    code = ("import torch, vit_triton\n"
            "m = vit_triton.ViT(vit_triton.ViTConfig(image_size=16, patch_size=8, embed_dim=32, depth=1, "
            "num_heads=1, mlp_dim=32))\n"
            "m(torch.randn(1, 3, 16, 16))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode != 0
    assert "ValueError: CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1" in result.stderr


def test_the_models_activations_are_the_kernels_epilogues():
    from vit_triton.kernels import ACTIVATIONS
    from vit_triton.model.config import ACTIVATIONS as MLP_ACTIVATIONS

    assert set(MLP_ACTIVATIONS) == set(ACTIVATIONS) - {"none"}


def test_a_pending_split_update_is_read_only_through_a_norm(monkeypatch):
    monkeypatch.setattr(ops, "split_k", lambda *shape: 2)
    model = _model(torch.float32, **VARIANTS["cls-head"])
    block, x = model.blocks[0], torch.randn(2 * model.config.num_tokens, model.config.embed_dim, device=DEVICE)
    with torch.no_grad():
        stream = block(ops.ResidualStream(x, batch=2))
    with pytest.raises(RuntimeError, match="pending split-K update: read it through norm"):
        stream.tensor()
    normed = stream.norm(model.norm)
    assert torch.equal(normed, model.norm(stream.tensor()))   # the stream now holds the sum
