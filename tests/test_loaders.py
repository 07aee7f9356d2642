"""from_hf and from_timm: parity with the reference models, both HF key spellings, and errors."""

import copy
import inspect
import re
from functools import partial

import pytest
import timm
import torch
import transformers
from packaging.version import Version
from timm.layers import RmsNorm, SwiGLUPacked
from timm.models.vision_transformer import VisionTransformer

from tests.checkpoints import family_outputs, hf_model, save_hf, save_timm, timm_model
from tests.numerics import DEVICE, assert_close, randomize_
from tests.test_save import LABELS, _assert_reads_back, _finetuned, _hf_load, _timm_load, _zero_key_bias
from vit_triton import from_hf, from_timm
from vit_triton.loaders import hf_config_to_vit, hf_num_classes, hf_state_dict_to_vit, save_pretrained, \
    timm_config_to_vit

TINY_HF = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=96,
               image_size=24, patch_size=8)
TINY_TIMM = dict(img_size=24, patch_size=8, embed_dim=64, depth=2, num_heads=2, mlp_ratio=1.5)


def _check_parity(ref: torch.nn.Module, run_ref, convert, dtype: torch.dtype, size: int | tuple[int, int] = 24,
                  in_chans: int = 3) -> None:
    """Features, outputs and pre-logits of convert(ref) against ref in float64, in `dtype` (16-bit: vs ref
    in dtype), on images of `size` (an int: square). run_ref(model, pixels) returns the reference's (features,
    output, pre-logits)."""
    ref = randomize_(ref).to(DEVICE).eval()
    ref64 = copy.deepcopy(ref).double()
    ref_lp = ref.to(dtype)
    ours = convert(ref_lp)
    assert next(ours.parameters()).dtype == dtype and next(ours.parameters()).device.type == DEVICE.type
    pixels = torch.randn(3, in_chans, *((size, size) if isinstance(size, int) else size), device=DEVICE)
    with torch.no_grad():
        want, theirs = run_ref(ref64, pixels.double()), run_ref(ref_lp, pixels.to(dtype))
        features = ours.forward_features(pixels.to(dtype))
        got = (features, ours.forward_head(features), ours.forward_head(features, pre_logits=True))
    for g, t, w in zip(got, theirs, want):
        assert_close(g, w, dtype, t)


def _hf_outputs(model, pixels):
    """last_hidden_state, logits (ViTModel: the class token), and the class token (the classifier's input)."""
    if isinstance(model, transformers.ViTForImageClassification):
        features = model.vit(pixels).last_hidden_state
        return features, model(pixels).logits, features[:, 0]
    features = model(pixels).last_hidden_state
    return features, features[:, 0], features[:, 0]


HF_VARIANTS = {
    "classifier": (transformers.ViTForImageClassification, dict(num_labels=50)),
    "model-no-qkv-bias-tanh": (transformers.ViTModel, dict(qkv_bias=False, hidden_act="gelu_pytorch_tanh",
                                                            layer_norm_eps=1e-6)),
    "classifier-quick-gelu": (transformers.ViTForImageClassification,
                              dict(num_labels=3, hidden_act="quick_gelu", num_channels=1)),
}


@pytest.mark.parametrize("variant, dtype", [(v, torch.float32) for v in HF_VARIANTS] + [("classifier", torch.bfloat16)])
def test_from_hf_matches_transformers(variant, dtype):
    cls, kw = HF_VARIANTS[variant]
    cfg = transformers.ViTConfig(**TINY_HF, **kw)
    _check_parity(cls(cfg), _hf_outputs, from_hf, dtype, cfg.image_size, cfg.num_channels)


TINY_VISION = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=24, patch_size=8)
FAMILIES = {
    "dinov2": (transformers.Dinov2Model, transformers.Dinov2Config, dict(mlp_ratio=2, layerscale_value=0.5)),
    "dinov2-giant-swiglu": (transformers.Dinov2Model, transformers.Dinov2Config, dict(mlp_ratio=3,
                                                                                   use_swiglu_ffn=True)),
    "dinov2-registers": (transformers.Dinov2WithRegistersModel, transformers.Dinov2WithRegistersConfig,
                         dict(mlp_ratio=2, num_register_tokens=4, qkv_bias=False)),
    "dinov2-registers-giant-swiglu": (transformers.Dinov2WithRegistersModel, transformers.Dinov2WithRegistersConfig,
                                      dict(mlp_ratio=3, use_swiglu_ffn=True, num_register_tokens=4)),
    "clip": (transformers.CLIPVisionModel, transformers.CLIPVisionConfig, dict(intermediate_size=96)),
    "clip-projection": (transformers.CLIPVisionModelWithProjection, transformers.CLIPVisionConfig,
                        dict(intermediate_size=96, projection_dim=40, hidden_act="gelu")),
    "clip-model": (transformers.CLIPModel, transformers.CLIPConfig, dict(projection_dim=40, text_config=dict(
        hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2))),
    "vit-mae": (transformers.ViTMAEModel, transformers.ViTMAEConfig, dict(intermediate_size=96, mask_ratio=0.0)),
    "siglip": (transformers.SiglipVisionModel, transformers.SiglipVisionConfig, dict(intermediate_size=96)),
    # rotary tables and no position embedding, registers, layer scale, no key bias; the "plus" sizes gate the MLP
    "dinov3": (transformers.DINOv3ViTModel, transformers.DINOv3ViTConfig, dict(intermediate_size=96,
                                                                               num_register_tokens=4)),
    "dinov3-gated": (transformers.DINOv3ViTModel, transformers.DINOv3ViTConfig, dict(
        intermediate_size=96, use_gated_mlp=True, hidden_act="silu", num_register_tokens=2, mlp_bias=False)),
    "siglip-model": (transformers.SiglipModel, transformers.SiglipConfig, dict(text_config=dict(
        hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2))),
    # vision towers of vision-language models, without a pooling head: what users take is last_hidden_state.
    # PaliGemma's SigLIP; Idefics3's and SmolVLM's (each patch's position row picked by bucketing, no patch mask);
    # InternVL's (LayerScale always, the patch mean without a final norm, or the class token after one)
    "siglip-no-head": (transformers.SiglipVisionModel, transformers.SiglipVisionConfig, dict(
        intermediate_size=96, vision_use_head=False)),
    "idefics3": (transformers.Idefics3VisionTransformer, transformers.Idefics3VisionConfig, dict(intermediate_size=96)),
    "smolvlm": (transformers.SmolVLMVisionTransformer, transformers.SmolVLMVisionConfig, dict(intermediate_size=96)),
    "internvl": (transformers.InternVLVisionModel, transformers.InternVLVisionConfig, dict(intermediate_size=96)),
    "internvl-biases-token": (transformers.InternVLVisionModel, transformers.InternVLVisionConfig, dict(
        intermediate_size=96, attention_bias=True, use_mean_pooling=False)),
}


def _family_model(family: str) -> torch.nn.Module:
    cls, config_cls, kw = FAMILIES[family]
    if config_cls in (transformers.CLIPConfig, transformers.SiglipConfig):
        return cls(config_cls(vision_config=dict(TINY_VISION, intermediate_size=96), **kw))
    return cls(config_cls(**TINY_VISION, **kw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", [24, (24, 40)])   # the checkpoint's 3 x 3 patches, and 3 x 5 resampled
@pytest.mark.parametrize("family", FAMILIES)
def test_from_hf_families_match_transformers(family, size, dtype):
    _check_parity(_family_model(family), family_outputs, from_hf, dtype, size)


# AIMv2: RMSNorm, the patch embeddings normalised before the position table is added, SwiGLU, the head's learned
# query itself against k_proj and v_proj (then output_proj); biases everywhere or nowhere; an Aimv2Model projects the
# head's output. transformers runs a learned table at its own grid only (elsewhere the add fails on the shapes),
# the native checkpoints' sin-cos table at any grid: the 3 x 5 grid here. A learned table at another grid is
# resampled as timm's AIMv2 does (test_from_timm_aimv2_at_another_size_matches_timm).
AIMV2 = {
    "vision-head-biases": lambda: transformers.Aimv2VisionModel(transformers.Aimv2VisionConfig(
        **TINY_VISION, intermediate_size=96, qkv_bias=True, mlp_bias=True)),
    "vision-native-no-head": lambda: transformers.Aimv2VisionModel(transformers.Aimv2VisionConfig(
        **TINY_VISION, intermediate_size=96, is_native=True, use_head=False)),
    "model-projection": lambda: transformers.Aimv2Model(transformers.Aimv2Config(
        vision_config=dict(TINY_VISION, intermediate_size=96), projection_dim=40, text_config=dict(
            hidden_size=32, intermediate_size=40, num_hidden_layers=1, num_attention_heads=2))),
}


@pytest.mark.parametrize("variant, dtype, size", [
    ("vision-head-biases", torch.float32, 24), ("vision-head-biases", torch.bfloat16, 24),
    ("vision-native-no-head", torch.float32, (24, 40)), ("vision-native-no-head", torch.bfloat16, (24, 40)),
    ("model-projection", torch.float32, 24)])
def test_from_hf_aimv2_matches_transformers(variant, dtype, size):
    model = AIMV2[variant]()
    if variant != "vision-native-no-head":
        with pytest.raises(RuntimeError, match="must match the size"):
            family_outputs(model, torch.randn(1, 3, 24, 40))
    _check_parity(model, family_outputs, from_hf, dtype, size)


# BEiT and data2vec-vision: a relative position bias table in every block (use_relative_position_bias) or one for all
# (use_shared_relative_position_bias), LayerScale (or none), q and v biases without k's; the patch mean through the
# pooler's LayerNorm (Data2VecVisionModel has no pooler: the plain mean), or the class token after a final norm; an
# absolute position embedding or none. At the checkpoints' own grids of 3 x 3 and 5 x 5 patches: another is refused
# (the table is learned for one grid).
BEIT = {
    "beit-block": (transformers.BeitModel, transformers.BeitConfig, dict(use_relative_position_bias=True)),
    "beit-shared-classifier": (transformers.BeitForImageClassification, transformers.BeitConfig, dict(
        use_shared_relative_position_bias=True, num_labels=50)),
    "beit-shared-token-abs_pos-no-layer-scale": (transformers.BeitModel, transformers.BeitConfig, dict(
        use_shared_relative_position_bias=True, use_mean_pooling=False, use_absolute_position_embeddings=True,
        layer_scale_init_value=0.0)),
    "data2vec-block-no-pooler": (transformers.Data2VecVisionModel, transformers.Data2VecVisionConfig, dict(
        use_relative_position_bias=True)),
    "data2vec-block-classifier": (transformers.Data2VecVisionForImageClassification,
                                  transformers.Data2VecVisionConfig, dict(use_relative_position_bias=True,
                                                                          num_labels=50)),
}


def _beit_outputs(model, pixels):
    """family_outputs, or a classifier's: its encoder's last_hidden_state, logits, and pooler_output."""
    if not hasattr(model, "classifier"):
        return family_outputs(model, pixels)
    encoder = model.beit if isinstance(model, transformers.BeitForImageClassification) else model.data2vec_vision
    out = encoder(pixels)
    return out.last_hidden_state, model(pixels).logits, out.pooler_output


@pytest.mark.parametrize("variant, dtype, size", [(v, d, 24) for v in BEIT for d in (torch.float32, torch.bfloat16)]
                         + [("beit-block", torch.float32, 40), ("data2vec-block-classifier", torch.bfloat16, 40)])
def test_from_hf_beit_and_data2vec_match_transformers(variant, dtype, size):
    cls, config, kw = BEIT[variant]
    model = cls(config(**{**TINY_VISION, "image_size": size}, intermediate_size=96, **kw))
    cfg = from_hf(model).config
    assert (cfg.rel_pos_bias, cfg.key_bias) == ("shared" if "shared" in variant else "block", False)
    _check_parity(model, _beit_outputs, from_hf, dtype, size)


def test_smolvlm_picks_position_rows_as_transformers_even_at_its_own_grid():
    # At 19 patches a side, transformers' bucketing (float32 fractions against the cells' lower edges) does not give
    # each patch its own row: even at its own grid the table is not used as it is
    config = transformers.SmolVLMVisionConfig(**{**TINY_VISION, "image_size": 152})
    model = transformers.SmolVLMVisionTransformer(config)
    ours = from_hf(model)
    with torch.no_grad():
        model.embeddings.patch_embedding.weight.zero_(), model.embeddings.patch_embedding.bias.zero_()
        for grid in ((19, 19), (7, 30)):
            rows = model.embeddings(torch.zeros(1, 3, 8 * grid[0], 8 * grid[1]), torch.ones(1, *grid, dtype=torch.bool))
            assert torch.equal(ours.pos_tables(ours.pos_embed, grid), rows[0]), grid
        assert not torch.equal(ours.pos_tables(ours.pos_embed, (19, 19)), ours.pos_embed)


def test_internvl_qk_norm_is_refused():
    config = transformers.InternVLVisionConfig(**TINY_VISION, intermediate_size=96, use_qk_norm=True)
    with pytest.raises(ValueError, match=r"unsupported InternVL vision feature: use_qk_norm \(an RMSNorm of q and of "
                                         r"k over all heads, which no kernel applies"):
        hf_config_to_vit(config.to_dict())


def test_from_hf_takes_a_timm_wrapper():
    # transformers' wrapper of a timm model: its timm model, converted as from_timm converts it
    config = transformers.TimmWrapperConfig(architecture="vit_tiny_patch16_224", num_labels=50,
                                            model_args=dict(TINY_TIMM, embed_dim=64, num_heads=2))
    model = transformers.TimmWrapperForImageClassification(config)
    assert from_hf(model).config == from_timm(model.timm_model).config

    def run(m, pixels):
        features = m.timm_model.forward_features(pixels)
        return features, m(pixels).logits, m.timm_model.forward_head(features, pre_logits=True)

    _check_parity(model, run, from_hf, torch.float32)


def test_hf_families_return_what_their_users_want():
    """DINOv2: the normalized class token; CLIP: the projected, post-normed class token (image_embeds)."""
    dinov2, clip = from_hf(_family_model("dinov2")), from_hf(_family_model("clip-model"))
    assert (dinov2.config.num_classes, dinov2.config.proj_dim, dinov2.config.embedding_dim) == (0, 0, 64)
    assert clip.config.fc_norm and clip.config.pre_norm and clip.config.embedding_dim == 40
    assert clip.norm is None and clip.fc_norm is not None   # last_hidden_state is not normalized


def test_layer_scale_is_kept_and_checked():
    model = randomize_(transformers.Dinov2Model(transformers.Dinov2Config(**TINY_VISION, layerscale_value=0.5)))
    sd = dict(model.state_dict())
    cfg = hf_config_to_vit(model.config.to_dict())
    assert cfg.layer_scale
    ours = hf_state_dict_to_vit(sd, cfg)
    gamma = next(v for k, v in sd.items() if k.endswith("1.layer_scale2.lambda1"))
    fc2 = next(v for k, v in sd.items() if k.endswith("1.mlp.fc2.weight"))
    assert torch.equal(ours["blocks.1.ls2"], gamma) and torch.equal(ours["blocks.1.fc2.weight"], fc2)
    missing = next(k for k in sd if k.endswith("0.layer_scale1.lambda1"))
    sd[next(k for k in sd if k.endswith("1.layer_scale1.lambda1"))] = torch.ones(63)
    del sd[missing]
    with pytest.raises(ValueError) as err:
        hf_state_dict_to_vit(sd, cfg)
    assert f"missing: {missing} (for blocks.0.ls1 [64])" in str(err.value)
    assert re.search(r"wrong shape: \S+1\.layer_scale1\.lambda1 is \[63\], expected \[64\]", str(err.value))


def _hf_any_size_outputs(model, pixels):
    """_hf_outputs with interpolate_pos_encoding=True; DeiT with a teacher averages its two heads."""
    if isinstance(model, transformers.DeiTForImageClassificationWithTeacher):
        features = model.deit(pixels, interpolate_pos_encoding=True).last_hidden_state
        logits = model(pixels, interpolate_pos_encoding=True).logits
        return features, logits, (features[:, 0] + features[:, 1]) / 2
    features = model.vit(pixels, interpolate_pos_encoding=True).last_hidden_state
    return features, model(pixels, interpolate_pos_encoding=True).logits, features[:, 0]


# The checkpoints' own 4 x 4 patches, and 3 x 5 patches: fewer rows and more columns, resampled.
SIZES = {"native": 32, "3x5": (24, 40)}
HF_ANY_SIZE = {"vit": (transformers.ViTForImageClassification, transformers.ViTConfig),
               "deit-teacher": (transformers.DeiTForImageClassificationWithTeacher, transformers.DeiTConfig)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("variant", HF_ANY_SIZE)
def test_from_hf_at_any_size_matches_interpolate_pos_encoding(variant, size, dtype):
    cls, config = HF_ANY_SIZE[variant]
    model = cls(config(**{**TINY_HF, "image_size": 32}, num_labels=50))
    assert from_hf(model).config.pos_resample == "bicubic"
    _check_parity(model, _hf_any_size_outputs, from_hf, dtype, SIZES[size])


def _old_hf_spelling(key: str) -> str:
    """transformers 5 key -> the hub's transformers-4 spelling (the inverse of its renaming)."""
    for new, old in ((r"layers\.(\d+)\.", r"encoder.layer.\1."), (r"attention\.q_proj", "attention.attention.query"),
                     (r"attention\.k_proj", "attention.attention.key"),
                     (r"attention\.v_proj", "attention.attention.value"),
                     (r"attention\.o_proj", "attention.output.dense"), (r"mlp\.fc1", "intermediate.dense"),
                     (r"mlp\.fc2", "output.dense")):
        key = re.sub(new, old, key)
    return key


def test_hub_key_spelling_maps_to_the_same_weights():
    model = randomize_(transformers.ViTForImageClassification(transformers.ViTConfig(**TINY_HF, num_labels=4)))
    sd = model.state_dict()
    old = {_old_hf_spelling(k): v for k, v in sd.items()}
    assert any(".encoder.layer.0.attention.attention.query.weight" in k for k in old)
    cfg = hf_config_to_vit(model.config.to_dict(), hf_num_classes(sd))
    ours_new, ours_old = hf_state_dict_to_vit(sd, cfg), hf_state_dict_to_vit(old, cfg)
    assert ours_new.keys() == ours_old.keys()
    for k in ours_new:
        assert torch.equal(ours_new[k], ours_old[k]), k
    q, k, v = (sd[f"vit.layers.1.attention.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(ours_new["blocks.1.qkv.weight"], torch.cat([q, k, v]))


def test_hf_pooler_and_mask_token_are_dropped():
    model = transformers.ViTModel(transformers.ViTConfig(**TINY_HF), add_pooling_layer=True, use_mask_token=True)
    assert {"pooler.dense.weight", "embeddings.mask_token"} <= set(model.state_dict())
    ours = from_hf(model)
    assert ours.config.num_classes == 0 and not ours.training


@pytest.mark.parametrize("hidden_act, act", [("gelu", "gelu"), ("gelu_pytorch_tanh", "gelu_tanh"),
                                             ("gelu_new", "gelu_tanh"), ("quick_gelu", "quick_gelu")])
def test_hf_activations(hidden_act, act):
    assert hf_config_to_vit(transformers.ViTConfig(**TINY_HF, hidden_act=hidden_act).to_dict()).act == act


def test_hf_size_pairs():
    config = transformers.ViTConfig(**TINY_HF).to_dict()
    assert hf_config_to_vit({**config, "image_size": [24, 24], "patch_size": (8, 8)}).image_size == 24
    with pytest.raises(ValueError, match=r"unsupported image_size \[24, 32\]; supported: square"):
        hf_config_to_vit({**config, "image_size": [24, 32]})


def _run_timm(m, px):
    f = m.forward_features(px)
    return f, m.forward_head(f), m.forward_head(f, pre_logits=True)


TIMM_VARIANTS = {
    "token-head": dict(num_classes=50),
    "avg-fc_norm-registers-no_embed_class": dict(global_pool="avg", reg_tokens=2, no_embed_class=True, num_classes=50),
    "clip-pre_norm-quickgelu-no-head": dict(pre_norm=True, act_layer="quick_gelu", num_classes=0,
                                            norm_layer=partial(torch.nn.LayerNorm, eps=1e-5)),
    "no-class-token-tanh-no-qkv-bias": dict(class_token=False, global_pool="avg", act_layer="gelu_tanh",
                                             qkv_bias=False, num_classes=2),
    "token-no-final-norm": dict(final_norm=False, num_classes=0),
    "layer-scale-registers-no_embed_class": dict(init_values=0.5, reg_tokens=4, no_embed_class=True, num_classes=0),
    # 50 classes: over a handful of logits a bf16 relative error swings past the rule by chance
    "siglip-map-head": dict(class_token=False, global_pool="map", act_layer="gelu_tanh", num_classes=50),
    "scale-norms": dict(scale_attn_norm=True, scale_mlp_norm=True, num_classes=50),
    "dinov2-giant-swiglu-packed": dict(mlp_layer=SwiGLUPacked, act_layer=torch.nn.SiLU, init_values=0.5,
                                       num_classes=0),
}


@pytest.mark.parametrize("variant, dtype", [(v, torch.float32) for v in TIMM_VARIANTS]
                         + [(v, torch.bfloat16) for v in list(TIMM_VARIANTS)[:2]
                            + ["layer-scale-registers-no_embed_class", "siglip-map-head"]])
def test_from_timm_matches_timm(variant, dtype):
    _check_parity(VisionTransformer(**TINY_TIMM, **TIMM_VARIANTS[variant]), _run_timm, from_timm, dtype)


TIMM_ANY_SIZE = {
    "token-registers": dict(reg_tokens=2, num_classes=50),
    "avg-registers-no_embed_class": dict(reg_tokens=1, no_embed_class=True, global_pool="avg", fc_norm=True,
                                         num_classes=50),
    "dinov2-layer-scale-registers": dict(init_values=0.5, reg_tokens=4, no_embed_class=True, num_classes=0),
    "siglip-map": dict(class_token=False, global_pool="map", num_classes=0),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("variant", TIMM_ANY_SIZE)
def test_from_timm_with_dynamic_img_size_matches_timm(variant, size, dtype):
    model = VisionTransformer(**{**TINY_TIMM, "img_size": 32}, dynamic_img_size=True, **TIMM_ANY_SIZE[variant])
    assert from_timm(model).config.pos_resample == "bicubic_float32_antialias"
    _check_parity(model, _run_timm, from_timm, dtype, SIZES[size])


# timm's own architectures, shrunk (head dim 32). VisionTransformer: DINOv2 (layer scale; ViT-g/14's packed SwiGLU),
# CLIP's tower (pre-norm, no patch bias), DeiT III (layer scale, no_embed_class). Eva: EVA02 (rotary "axial" on a
# 16 x 16 reference grid, GluMlp's packed SwiGLU; Base/Large: separate q, k, v and SwiGLU with its sub-norm), the
# RoPE ViTs (axial with registers and no class token, mixed with learned per-layer frequencies and layer scale),
# DINOv3 (centered, half pairs, registers, layer scale; the "plus" sizes with SwiGLU).
TINY_EVA = dict(img_size=32, patch_size=8, embed_dim=64, num_heads=2, depth=2)
TIMM_FAMILIES = {   # the VisionTransformers with one block: the interpreter is slow, and the variants above have two
    "dinov2": ("vit_small_patch14_dinov2", dict(depth=1, num_classes=0)),
    "dinov2-giant-swiglu": ("vit_giant_patch14_dinov2", dict(depth=1, num_classes=0, mlp_ratio=3)),   # fc1: 2 x 96 rows
    "clip": ("vit_base_patch16_clip_224", dict(depth=1, num_classes=40)),
    "deit3": ("deit3_small_patch16_224", dict(depth=1, num_classes=50)),
    "eva02-tiny": ("eva02_tiny_patch14_224", dict(num_classes=7)),
    "eva02-base-swiglu-subnorm": ("eva02_base_patch14_448", dict(num_classes=0)),
    "rope-axial-reg4-gap": ("vit_betwixt_patch16_rope_reg4_gap_256", dict(num_classes=5)),
    "rope-mixed": ("vit_small_patch16_rope_mixed_224", dict(num_classes=0, init_values=0.5)),
    "dinov3": ("vit_small_patch16_dinov3", dict(num_classes=0)),
    "dinov3-plus-swiglu-token": ("vit_huge_plus_patch16_dinov3", dict(num_classes=0, global_pool="token")),
    # Perception Encoder: pre-norm, rotary "axial" in (x, y) order offset by 1, the attention pool's own heads and
    # MLP width; EVA02-CLIP: a LayerNorm of the attention's output before proj
    "pe-core-map": ("vit_pe_core_tiny_patch16_384", dict(num_classes=0, attn_pool_num_heads=4, mlp_ratio=1.5)),
    "eva02-clip-attn-norm": ("eva02_base_patch16_clip_224", dict(num_classes=40)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("variant", TIMM_FAMILIES)
def test_from_timm_families_match_timm(variant, size, dtype):
    name, kw = TIMM_FAMILIES[variant]
    if variant == "rope-mixed" and size == "native" and Version(timm.__version__) < Version("1.0.31"):
        pytest.skip("timm before 1.0.31 cannot run RoPE-mixed at its own grid in float64, the reference's dtype")
    # At another size timm needs dynamic_img_size (its rotary tables then come from the device, not the CPU).
    model = timm.create_model(name, pretrained=False, **{**TINY_EVA, **kw}, dynamic_img_size=size != "native")
    _check_parity(model, _run_timm, from_timm, dtype, SIZES[size])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_from_timm_aimv2_at_another_size_matches_timm(dtype):
    # timm's AIMv2: RmsNorm, the norm in the patch embedding, SwiGLU, no projection biases, the patch mean
    model = timm.create_model("aimv2_large_patch14_224", pretrained=False, **TINY_EVA, mlp_ratio=1.5,
                              dynamic_img_size=True)
    cfg = from_timm(model).config
    assert (cfg.norm, cfg.embed_norm, cfg.act, cfg.proj_bias, cfg.pool, cfg.norm_eps) == (
        "rmsnorm", True, "swiglu", False, "avg", 1e-5)
    _check_parity(model, _run_timm, from_timm, dtype, SIZES["3x5"])


# timm's Beit: BEiT (a table in every block, LayerScale, the patch mean normed after pooling), BEiT v2 made to share one
# table and add an absolute position embedding, pooling the class token; SwiGLU with its sub-norm (swiglu_mlp,
# scale_mlp).
TIMM_BEIT = {
    "beit-block": ("beit_base_patch16_224", dict(num_classes=50)),
    "beitv2-shared-abs_pos-token": ("beitv2_base_patch16_224", dict(
        use_rel_pos_bias=False, use_shared_rel_pos_bias=True, use_abs_pos_emb=True, global_pool="token",
        num_classes=0)),
    "beit-swiglu-scale_mlp": ("beit_base_patch16_224", dict(swiglu_mlp=True, scale_mlp=True, num_classes=0)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("variant", TIMM_BEIT)
def test_from_timm_beit_matches_timm(variant, dtype):
    name, kw = TIMM_BEIT[variant]
    _check_parity(timm.create_model(name, pretrained=False, **TINY_EVA, **kw), _run_timm, from_timm, dtype, 32)


@pytest.mark.parametrize("make, match", [
    (lambda: timm.create_model("beit_base_patch16_224", pretrained=False, **TINY_EVA, use_shared_rel_pos_bias=True),
     r"unsupported timm Beit feature: a relative position bias table in every block and a shared one"),
    (lambda: timm.create_model("beit_base_patch16_224", pretrained=False, **TINY_EVA, global_pool=""),
     r"unsupported timm Beit feature: global_pool '' \(supported: token, avg\)"),
    (lambda: transformers.BeitModel(transformers.BeitConfig(**TINY_VISION, use_relative_position_bias=True,
                                                            use_shared_relative_position_bias=True)),
     r"unsupported beit feature: use_relative_position_bias with use_shared_relative_position_bias \(a table in "
     r"every block and a shared one"),
])
def test_beit_with_two_kinds_of_table_or_no_pooling_is_refused(make, match):
    with torch.device("meta"):
        model = make()
    with pytest.raises(ValueError, match=match):
        (from_timm if isinstance(model, timm.models.beit.Beit) else from_hf)(model)


# save_pretrained (tests/test_save.py's checks): a fine-tuned BEiT or data2vec-vision written in its source's layout,
# which its library loads as it is and computes as ours does, and which from_pretrained reads back as the same model.
# Data2VecVisionModel has no pooler: a classifier of its plain patch mean goes beside it, which transformers leaves
# unused (its BEiT classifiers norm the mean).
BEIT_SAVED = {
    "timm-beit-block-new-labels": (lambda tmp: save_timm(timm_model(
        "beit_base_patch16_224", embed_dim=64, num_heads=2, mlp_ratio=1.5, num_classes=5), tmp), LABELS),
    "timm-beitv2-shared": (lambda tmp: save_timm(timm_model(
        "beitv2_base_patch16_224", embed_dim=64, num_heads=2, mlp_ratio=1.5, use_rel_pos_bias=False,
        use_shared_rel_pos_bias=True, num_classes=0), tmp), None),
    "beit-classifier-shared": (lambda tmp: save_hf(hf_model(
        "BeitForImageClassification", use_shared_relative_position_bias=True, num_labels=5), tmp), None),
    "data2vec-block-new-classifier": (lambda tmp: save_hf(hf_model(
        "Data2VecVisionModel", use_relative_position_bias=True), tmp), LABELS),
}


@pytest.mark.parametrize("case", BEIT_SAVED)
def test_beit_is_written_back_in_its_layout(case, tmp_path):
    make, classes = BEIT_SAVED[case]
    model = _finetuned(make(tmp_path / "source"), classes)
    _zero_key_bias(model)   # k has no bias in BEiT (key_bias=False keeps it zero in training)
    save_pretrained(model, tmp_path / "out")
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ours = model(pixels.to(DEVICE))
        if case.startswith("timm"):
            want = _timm_load(tmp_path / "out").double()(pixels.double())
        else:
            theirs, missing, unexpected = _hf_load(tmp_path / "out")
            assert not missing and unexpected == ({"classifier.weight", "classifier.bias"} if classes else set())
            if classes:   # transformers' output is the pooled features, the classifier's input
                ours = model.forward_head(model.forward_features(pixels.to(DEVICE)), pre_logits=True)
            want = _beit_outputs(theirs.double(), pixels.double())[1]
    assert_close(ours, want.to(DEVICE), torch.float32)
    _assert_reads_back(model, tmp_path / "out")


def test_eva_config():
    name, kw = TIMM_FAMILIES["eva02-base-swiglu-subnorm"]
    cfg = from_timm(timm.create_model(name, pretrained=False, **TINY_EVA, **kw)).config
    assert (cfg.act, cfg.mlp_norm, cfg.rope, cfg.rope_ref_grid, cfg.rope_half, cfg.rope_cpu) == (
        "swiglu", True, "axial", (16, 16), False, True)
    cfg = from_timm(timm.create_model("vit_small_patch16_dinov3", pretrained=False, **TINY_EVA)).config
    assert (cfg.rope, cfg.rope_theta, cfg.rope_half, cfg.reg_tokens, cfg.abs_pos_embed, cfg.qkv_bias) == (
        "centered", 100.0, True, 4, False, False)


@pytest.mark.parametrize("kw, match", [
    (dict(), "qk_norm"),   # set on the module below: timm 1.0.29's Eva takes no qk_norm argument
    (dict(attn_type="rope", qkv_fused=False, num_kv_heads=1), r"grouped-query attention \(num_kv_heads: fewer key and "
                                                              r"value heads than query heads"),
    (dict(use_post_norm=True), r"block type EvaBlockPostNorm \(supported: EvaBlock; EvaBlockPostNorm's norms after "
                               r"each branch are not ours\)"),
    # the pool's MLP is GELU, the blocks' SwiGLU
    (dict(global_pool="map"), r"an attention pool \(global_pool 'map'\) with an MLP activation other than the "
                              r"blocks'"),
])
def test_unsupported_eva_features(kw, match):
    if "num_kv_heads" in kw and "num_kv_heads" not in inspect.signature(timm.models.eva.Eva).parameters:
        pytest.skip("this timm's Eva has no grouped-query attention")
    with torch.device("meta"):
        model = timm.create_model("eva02_tiny_patch14_224", pretrained=False, **TINY_EVA, **kw)
    if not kw:
        model.blocks[0].attn.q_norm = torch.nn.LayerNorm(32)
    with pytest.raises(ValueError, match=match):
        from_timm(model)


@pytest.mark.parametrize("name, match", [
    ("samvit_base_patch16", r"got VisionTransformerSAM \(windowed attention with relative position bias, which the "
                            r"kernels do not compute\)"),
    ("vit_relpos_base_patch16_224", r"got VisionTransformerRelPos \(an MLP \(RelPosMlp\) making the relative "
                                    r"position bias from log-spaced patch offsets, which the kernels do not compute"),
    ("vit_base_r50_s16_224", r"patch embedding HybridEmbed \(supported: PatchEmbed; a hybrid convolutional stem"),
])
def test_refused_timm_families_name_what_they_lack(name, match):
    with torch.device("meta"):
        model = timm.create_model(name, pretrained=False)
    with pytest.raises(ValueError, match=match):
        from_timm(model)


def test_timm_distilled_deit_with_dynamic_img_size():
    model = timm.create_model("deit_tiny_distilled_patch16_224", pretrained=False, dynamic_img_size=True,
                              **{**TINY_TIMM, "img_size": 32}, num_classes=50)
    _check_parity(model, _run_timm, from_timm, torch.float32, SIZES["3x5"])


def test_timm_non_square_img_size_is_refused():
    with pytest.raises(ValueError, match=r"a non-square img_size or patch_size \(the checkpoint's own grid must be "
                                         r"square; inputs of any size run\)"):
        from_timm(VisionTransformer(**{**TINY_TIMM, "img_size": (24, 32)}))


def test_timm_factory_model_config():
    model = timm.create_model("vit_large_patch14_clip_336", pretrained=False, depth=1)
    cfg = timm_config_to_vit(model)
    assert (cfg.image_size, cfg.patch_size, cfg.embed_dim, cfg.num_heads, cfg.mlp_dim) == (336, 14, 1024, 16, 4096)
    assert cfg.pre_norm and not cfg.patch_bias and cfg.norm_eps == 1e-5 and cfg.num_classes == 1000


def _hf_state_dict():
    model = transformers.ViTForImageClassification(transformers.ViTConfig(**TINY_HF, num_labels=4))
    sd = dict(model.state_dict())
    return sd, hf_config_to_vit(model.config.to_dict(), 4)


def test_mismatched_checkpoint_lists_every_problem():
    sd, cfg = _hf_state_dict()
    del sd["vit.layers.1.mlp.fc2.bias"]
    sd["vit.layers.0.extra.weight"] = torch.zeros(1)
    sd["classifier.weight"] = torch.zeros(4, 63)
    with pytest.raises(ValueError) as err:
        hf_state_dict_to_vit(sd, cfg)
    msg = str(err.value)
    assert "missing: vit.layers.1.mlp.fc2.bias (for blocks.1.fc2.bias [64])" in msg
    assert "unexpected: vit.layers.0.extra.weight" in msg
    assert "wrong shape: classifier.weight is [4, 63], expected [4, 64]" in msg


def test_missing_value_projection_is_reported():
    sd, cfg = _hf_state_dict()
    del sd["vit.layers.0.attention.v_proj.weight"]
    with pytest.raises(ValueError, match=r"missing: vit\.layers\.0\.attention\.v_proj\.weight "
                                         r"\(for blocks\.0\.qkv\.weight \[192, 64\]\)"):
        hf_state_dict_to_vit(sd, cfg)


@pytest.mark.parametrize("kw, match", [
    (dict(global_pool="max"), r"global_pool 'max' \(supported: token, avg, map\)"),
    (dict(qk_norm=True), "qk_norm"),
    (dict(norm_layer=torch.nn.BatchNorm1d), r"norm layer BatchNorm1d \(supported: LayerNorm, RmsNorm\)"),
    (dict(embed_norm_layer=RmsNorm), "LayerNorm and RmsNorm in one model"),
])
def test_unsupported_timm_features(kw, match):
    with pytest.raises(ValueError, match=match):
        from_timm(VisionTransformer(**TINY_TIMM, **kw))


def test_unsupported_modules():
    with pytest.raises(ValueError, match="VisionTransformer, VisionTransformerDistilled, Eva or Beit, got Linear"):
        from_timm(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="ViTForImageClassification, DeiTModel, .*, got Linear"):
        from_hf(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unsupported HuggingFace model_type 'swin'; supported: 'aimv2_vision_model', "
                                         "'beit', 'clip_vision_model', 'data2vec-vision', 'deit', "):
        hf_config_to_vit({"model_type": "swin"})
    with pytest.raises(ValueError, match=r"unsupported HuggingFace model_type 'sam_vision_model' \(its windowed "
                                         r"attention with relative position bias, which the attention kernel does not "
                                         r"compute\)"):
        hf_config_to_vit({"model_type": "sam_vision_model"})
    with pytest.raises(ValueError, match="unsupported hidden_act 'relu'; supported: gelu, "):
        hf_config_to_vit({**transformers.ViTConfig(**TINY_HF).to_dict(), "hidden_act": "relu"})


def test_converted_model_owns_its_weights():
    ref = VisionTransformer(**TINY_TIMM, num_classes=2)
    ours = from_timm(ref)
    with torch.no_grad():
        ours.head.bias.add_(1.0)
        ours.blocks[0].fc1.weight.mul_(2.0)
    assert not torch.equal(ours.head.bias, ref.head.bias)   # both on the reference's device
    assert not torch.equal(ours.blocks[0].fc1.weight, ref.blocks[0].mlp.fc1.weight)
