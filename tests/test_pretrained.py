"""from_pretrained: checkpoints saved by transformers and timm, read back without them, against them."""

import copy
import json
import re
import shutil
import subprocess
import sys

import pytest
import timm
import torch
from packaging.version import Version

from tests.checkpoints import OPEN_CLIP_TIMM, family_outputs, hf_model, open_clip_timm_tower, save_hf, seeded, \
    save_timm, timm_model
from tests.numerics import DEVICE, assert_close, randomize_
from vit_triton import from_hf, from_pretrained, from_timm
from vit_triton.loaders import CheckpointNotFound, read_checkpoint


def _features_and_output(model, pixels):
    """forward_features and forward_head of ours or of a timm model."""
    features = model.forward_features(pixels)
    return features, model.forward_head(features)


def _check(ours, ref, ref_outputs, dtype: torch.dtype = torch.float32, size: tuple[int, int] | None = None,
           ours_outputs=_features_and_output) -> None:
    """ours_outputs(ours) against ref_outputs(ref) in float64 on images of `size` (None: the checkpoint's own); in
    bfloat16, ref's own error in bfloat16 is the yardstick."""
    pixels = torch.randn(2, 3, *(size or (ours.config.image_size,) * 2))
    with torch.no_grad():
        want = ref_outputs(copy.deepcopy(ref).double(), pixels.double())
        theirs = [None] * len(want) if dtype == torch.float32 else \
            ref_outputs(copy.deepcopy(ref).to(DEVICE, dtype), pixels.to(DEVICE, dtype))
        got = ours_outputs(ours, pixels.to(DEVICE, dtype))
    for g, t, w in zip(got, theirs, want):
        assert_close(g, w.to(DEVICE), dtype, t)


# Beside each checkpoint at its own size in float32, one of every family in bfloat16 and at 3 x 5 patches (its own
# grid is 4 x 4), resampled as its library does.
OTHER = (24, 40)
MATRIX = [(None, torch.bfloat16), (OTHER, torch.float32), (OTHER, torch.bfloat16)]


def _cases(cases, families):
    """pytest params (case, size, dtype, depth): every case at its own size in float32 with 2 blocks (a second
    block's keys read), and each of `families` in MATRIX's cells with 1 (the interpreter is slow)."""
    return [pytest.param(case, None, torch.float32, 2, id=case) for case in cases] + [
        pytest.param(case, size, dtype, 1, id=f"{case}-{'3x5' if size else 'own'}-{str(dtype)[6:]}")
        for case in families for size, dtype in MATRIX]


def _hf_outputs(model, pixels):
    name = type(model).__name__
    if name.startswith(("ViTMAE", "CLIP", "Dinov2", "DINOv3", "Siglip", "Aimv2", "Idefics3", "SmolVLM", "InternVL")):
        features, output, _ = family_outputs(model.vit if name == "ViTMAEForPreTraining" else model, pixels)
        return features, output
    inner = getattr(model, "vit", None) or getattr(model, "deit", None) or model
    features = inner(pixels).last_hidden_state
    if name in ("ViTModel", "DeiTModel"):
        return features, features[:, 0]
    return features, model(pixels).logits


HF_CASES = {
    "ViTForImageClassification": dict(num_labels=5, id2label={i: f"kind {i}" for i in range(5)}),
    "ViTModel": dict(qkv_bias=False, hidden_act="gelu_pytorch_tanh"),
    "DeiTModel": dict(),
    "DeiTForImageClassification": dict(num_labels=3),
    "DeiTForImageClassificationWithTeacher": dict(num_labels=4),
    "Dinov2Model": dict(mlp_ratio=2, layerscale_value=0.5),
    "Dinov2Model-giant-swiglu": dict(mlp_ratio=3, use_swiglu_ffn=True),
    "Dinov2WithRegistersModel": dict(mlp_ratio=2, num_register_tokens=4),
    "CLIPModel": dict(projection_dim=40),
    "CLIPVisionModel": dict(),
    "CLIPVisionModelWithProjection": dict(projection_dim=24),
    "SiglipModel": dict(),
    "SiglipVisionModel": dict(hidden_act="gelu"),
    "DINOv3ViTModel": dict(num_register_tokens=4, use_gated_mlp=True, hidden_act="silu"),
    "ViTMAEForPreTraining": dict(mask_ratio=0.0, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                                 decoder_intermediate_size=40, decoder_num_attention_heads=2),
    "ViTMAEModel": dict(mask_ratio=0.0),
    "Aimv2VisionModel": dict(qkv_bias=True),
    "Aimv2Model": dict(projection_dim=40),
    "SiglipVisionModel-no-head": dict(vision_use_head=False),
    "Idefics3VisionTransformer": dict(),
    "SmolVLMVisionTransformer": dict(),
    "InternVLVisionModel": dict(attention_bias=True),
    "InternVLVisionModel-rmsnorm": dict(norm_type="rms_norm"),
}


@pytest.mark.parametrize("case, size, dtype, depth", _cases(HF_CASES, [
    "Dinov2Model", "Dinov2WithRegistersModel", "CLIPModel", "SiglipModel", "DINOv3ViTModel", "ViTMAEForPreTraining",
    "SmolVLMVisionTransformer", "InternVLVisionModel"]))
def test_transformers_checkpoint_matches_transformers(case, size, dtype, depth, tmp_path):
    name = case.split("-")[0]   # the class; after it, which variant
    ref = hf_model(name, depth=depth, **HF_CASES[case])
    ours = from_pretrained(save_hf(ref, tmp_path), device=DEVICE, dtype=dtype)
    assert ours.config.dist_token == name.startswith("DeiT")
    assert ours.config.head_dist == name.endswith("WithTeacher")
    assert ours.config == (from_hf(ref.vit).config if name == "ViTMAEForPreTraining" else from_hf(ref).config)
    assert ours.checkpoint.library == "transformers" and ours.checkpoint.architecture == name
    if name == "ViTForImageClassification":
        assert ours.checkpoint.id2label == {i: f"kind {i}" for i in range(5)}
    _check(ours, ref, _hf_outputs, dtype, size)


def test_from_hf_takes_a_deit_with_teacher():
    ref = hf_model("DeiTForImageClassificationWithTeacher", num_labels=3)
    _check(from_hf(copy.deepcopy(ref).to(DEVICE)), ref, _hf_outputs)


def test_sharded_safetensors_and_pickled_weights_load_the_same(tmp_path):
    ref = hf_model("ViTForImageClassification", num_labels=3)
    sharded = save_hf(ref, tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    shutil.copy(sharded / "config.json", pickled)
    cfg, sd, _ = read_checkpoint(sharded)
    from safetensors.torch import load_file
    hub_keys = {}
    for shard in sharded.glob("model-*.safetensors"):
        hub_keys.update(load_file(shard))
    torch.save(hub_keys, pickled / "pytorch_model.bin")
    cfg2, sd2, _ = read_checkpoint(pickled)
    assert cfg == cfg2 and sd.keys() == sd2.keys()
    assert all(torch.equal(sd[k], sd2[k]) for k in sd)
    assert all(torch.equal(sd[k], v) for k, v in from_hf(ref).state_dict().items())


# Heads of 50 classes where a case runs in bfloat16: over a handful of logits a bf16 relative error swings past the
# rule by chance.
TIMM_CASES = {
    # name, create_model arguments, config.json as timm writes it now (model_args) or as older hub ones
    "vit-model_args": ("vit_tiny_patch16_224", dict(embed_dim=64, num_heads=2, num_classes=5), True),
    "deit-distilled-hub-config": ("deit_tiny_distilled_patch16_224", dict(num_classes=3), False),
    "vit-avg-registers-no_embed_class": ("vit_tiny_patch16_224", dict(
        embed_dim=64, num_heads=2, class_token=False, global_pool="avg", fc_norm=True, reg_tokens=2,
        no_embed_class=True, num_classes=0), True),
    # act_layer and LayerNorm eps are the architecture's, recorded nowhere: read from its name
    "clip-quickgelu": ("vit_base_patch16_clip_quickgelu_224", dict(embed_dim=64, num_heads=2, num_classes=50), True),
    "deit3-layer-scale": ("deit3_small_patch16_224", dict(embed_dim=64, num_heads=2, num_classes=50), True),
    "dinov2-registers": ("vit_small_patch14_reg4_dinov2", dict(embed_dim=64, num_heads=2, patch_size=8), True),
    # SwiGLUPacked, recorded nowhere: read from fc1 being twice as tall as fc2 is wide
    "dinov2-giant-swiglu": ("vit_giant_patch14_dinov2", dict(embed_dim=96, num_heads=2, patch_size=8), True),
    # global_pool 'map' and no class token are the architecture's, not in model_args: read from the tensors
    "siglip-map": ("vit_base_patch16_siglip_224", dict(embed_dim=64, num_heads=2), True),
    # Eva: rotary settings come from the architecture, built by timm on the meta device
    "eva02-tiny": ("eva02_tiny_patch14_224", dict(embed_dim=64, num_heads=2, patch_size=8, num_classes=50), True),
    "rope-mixed": ("vit_small_patch16_rope_mixed_224", dict(embed_dim=64, num_heads=2, num_classes=0), True),
    "dinov3": ("vit_small_patch16_dinov3", dict(embed_dim=64, num_heads=2, patch_size=8), True),
    # RmsNorm (its bias-free norms), SwiGLU (fc1_g, fc1_x) and the patch embedding's norm: read from the tensors
    "aimv2": ("aimv2_large_patch14_224", dict(embed_dim=64, num_heads=2, mlp_ratio=1.5), True),
    # Perception Encoder's attention pool (its own heads and MLP width); EVA02-CLIP's norm of the attention's output
    "pe-core": ("vit_pe_core_tiny_patch16_384", dict(embed_dim=64, num_heads=2, patch_size=8, attn_pool_num_heads=4,
                                                     mlp_ratio=1.5, num_classes=0), True),
    "eva02-clip": ("eva02_base_patch16_clip_224", dict(embed_dim=64, num_heads=2, patch_size=8, num_classes=50), True),
}


@pytest.mark.parametrize("case, size, dtype, depth", _cases(TIMM_CASES, [
    "dinov2-registers", "clip-quickgelu", "deit3-layer-scale", "siglip-map", "eva02-tiny", "dinov3", "pe-core",
    "eva02-clip"]))
def test_timm_checkpoint_matches_timm(case, size, dtype, depth, tmp_path):
    name, kw, model_args = TIMM_CASES[case]
    if case == "rope-mixed" and Version(timm.__version__) < Version("1.0.31"):
        pytest.skip("timm before 1.0.31 cannot run RoPE-mixed at its own grid in float64, the reference's dtype")
    if not timm.is_model(name):
        pytest.skip(f"this timm has no {name}")
    # timm runs another size with dynamic_img_size, which model_args then record
    ref = timm_model(name, depth=depth, **kw, **({"dynamic_img_size": True} if size else {}))
    weights = "model.safetensors" if model_args else "pytorch_model.bin"
    directory = save_timm(ref, tmp_path, weights=weights, model_args=model_args)
    # a weights file with its config.json beside it names the same checkpoint as the directory
    ours = from_pretrained(directory / weights if case.startswith("deit") else directory,
                           device=DEVICE, dtype=dtype)
    assert ours.config == from_timm(ref).config  # what the live module says, incl. eps and activation
    assert ours.checkpoint.library == "timm" and ours.checkpoint.architecture == name
    assert ours.checkpoint.preprocessing["input_size"] == [3, 32, 32]
    _check(ours, ref, _features_and_output, dtype, size)


OPEN_CLIP_CASES = {
    "openai-quickgelu-bin": (dict(quick_gelu=True), "open_clip_pytorch_model.bin"),
    "layer-scale-avg-final-ln-after-pool": (dict(vision_cfg=dict(ls_init_value=0.5, pool_type="avg",
                                                                 final_ln_after_pool=True)),
                                            "open_clip_model.safetensors"),
}


@pytest.mark.parametrize("case, size, dtype, depth", _cases(OPEN_CLIP_CASES, ["layer-scale-avg-final-ln-after-pool"]))
def test_open_clip_checkpoint_matches_open_clip(case, size, dtype, depth, tmp_path):
    open_clip = pytest.importorskip("open_clip")   # a test extra; the GPU machine's image lacks it
    from open_clip.model import resize_pos_embed
    from safetensors.torch import save_file

    kw, weights = OPEN_CLIP_CASES[case]
    model_cfg = dict(embed_dim=40, quick_gelu=kw.get("quick_gelu", False),
                     vision_cfg=dict(image_size=24, patch_size=8, width=64, head_width=32, layers=depth, mlp_ratio=1.5,
                                     **kw.get("vision_cfg", {})),
                     text_cfg=dict(context_length=8, vocab_size=50, width=32, heads=2, layers=1))
    ref = seeded(lambda: open_clip.CLIP(**model_cfg))
    preprocess_cfg = dict(mean=[0.48, 0.45, 0.41], std=[0.27, 0.26, 0.28])
    (tmp_path / "open_clip_config.json").write_text(json.dumps(dict(model_cfg=model_cfg,
                                                                    preprocess_cfg=preprocess_cfg)))
    sd = ref.state_dict()
    save_file(sd, tmp_path / weights) if weights.endswith(".safetensors") else torch.save(sd, tmp_path / weights)
    ours = from_pretrained(tmp_path, device=DEVICE, dtype=dtype)
    assert ours.checkpoint.library == "open_clip" and ours.checkpoint.preprocessing == preprocess_cfg
    assert ours.config.embedding_dim == 40 and ours.config.pre_norm and not ours.config.patch_bias
    if size:   # OpenCLIP runs another size as a model made for it, the checkpoint's table resized as it loads
        ref = open_clip.CLIP(**{**model_cfg, "vision_cfg": {**model_cfg["vision_cfg"], "image_size": size}}).eval()
        resize_pos_embed(sd, ref)
        ref.load_state_dict(sd)
    ref.visual.output_tokens = True

    def ours_outputs(model, pixels):   # as OpenCLIP's visual(): the image embedding, and the patch tokens
        features = model.forward_features(pixels)
        return model.forward_head(features), features[:, 1:]

    _check(ours, ref, lambda model, pixels: model.visual(pixels), dtype, size, ours_outputs)


# transformers' TimmWrapperModel: a timm model inside, its keys under timm_model., config.json with the architecture
TIMM_WRAPPERS = {
    "TimmWrapperModel": "vit_base_patch16_224",   # no classifier: the pooled features (pooler_output)
    "TimmWrapperForImageClassification": "eva02_tiny_patch14_224",   # an Eva, its rotary settings timm's
}


@pytest.mark.parametrize("cls_name", TIMM_WRAPPERS)
def test_timm_wrapper_checkpoint_matches_transformers(cls_name, tmp_path):
    import transformers

    config = transformers.TimmWrapperConfig(architecture=TIMM_WRAPPERS[cls_name], num_labels=3,
                                            model_args=dict(img_size=32, patch_size=8, embed_dim=64, num_heads=2,
                                                            depth=2))
    ref = randomize_(getattr(transformers, cls_name)(config)).eval()
    ours = from_pretrained(save_hf(ref, tmp_path), device=DEVICE, dtype=torch.float32)
    assert ours.config == from_hf(ref).config and ours.checkpoint.library == "timm"
    classifier = cls_name == "TimmWrapperForImageClassification"
    assert ours.checkpoint.id2label == ({i: f"LABEL_{i}" for i in range(3)} if classifier else {})

    def outputs(model, pixels):   # the timm model's features, and the wrapper's logits or pooled features
        out = model(pixels)
        return model.timm_model.forward_features(pixels), out.logits if classifier else out.pooler_output

    _check(ours, ref, outputs)


@pytest.mark.parametrize("case", OPEN_CLIP_TIMM)
def test_open_clip_timm_tower_matches_open_clip(case, tmp_path, monkeypatch):
    ref = open_clip_timm_tower(tmp_path, case, monkeypatch)
    ours = from_pretrained(tmp_path, device=DEVICE, dtype=torch.float32)
    assert ours.checkpoint.library == "open_clip" and ours.checkpoint.architecture == OPEN_CLIP_TIMM[case][0]
    assert ours.config.proj_dim == (0 if case.startswith("siglip") else 40)
    assert ours.config.embed_proj_bias == (ours.config.proj_dim > 0)
    _check(ours, ref, lambda model, pixels: (model.encode_image(pixels),),
           ours_outputs=lambda model, pixels: (model.embedding(model.forward_features(pixels)),))


def test_from_timm_takes_a_distilled_deit():
    ref = timm_model("deit_tiny_distilled_patch16_224", embed_dim=64, num_heads=2, num_classes=3)
    _check(from_timm(copy.deepcopy(ref).to(DEVICE)), ref, _features_and_output)


def test_timm_label_names_and_descriptions(tmp_path):
    ref = timm_model("vit_tiny_patch16_224", embed_dim=64, num_heads=2, num_classes=3)
    directory = save_timm(ref, tmp_path, label_names=["n1", "n2", "n3"], label_descriptions={"n1": "one", "n3": "three"})
    _, _, info = read_checkpoint(directory)
    assert info.id2label == {0: "one", 1: "n2", 2: "three"}


def test_a_plain_timm_vit_loads_without_importing_timm(tmp_path):
    """timm's import (through torchvision, torch._dynamo) takes seconds of every command's start: a plain
    VisionTransformer checkpoint needs none of it, until a class is named (ImageNet's names are timm's)."""
    ref = timm_model("vit_tiny_patch16_224", embed_dim=64, num_heads=2, num_classes=1000)
    directory = save_timm(ref, tmp_path)
    script = (f"import sys; from vit_triton import from_pretrained; "
              f"model = from_pretrained({str(directory)!r}, device='cpu'); "
              f"print('timm' in sys.modules); print(model.checkpoint.id2label[1]); print('timm' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.split("\n")[:3] == ["False", _imagenet_name(1), "True"]


def _imagenet_name(index: int) -> str:
    from timm.data import ImageNetInfo

    return ImageNetInfo("imagenet-1k").label_descriptions()[index]


def test_plain_vits_are_told_apart_as_timms_registry_does():
    """_plain_timm_vit reads timm's source; it must call an architecture a plain ViT exactly where timm's registry
    puts it in vision_transformer.py (Eva and Beit architectures, whose names alone mislead, are built by timm)."""
    from vit_triton.loaders.pretrained import _plain_timm_vit

    for name in timm.list_models():
        plain = timm.models.model_entrypoint(name).__module__ == "timm.models.vision_transformer"
        assert _plain_timm_vit(name) == plain, name
    assert not _plain_timm_vit("vit_base_patch16")   # a name is matched whole: not a prefix of one


def test_dtype_and_device(tmp_path):
    model = from_pretrained(save_hf(hf_model("ViTModel"), tmp_path), device=DEVICE)
    # bfloat16 on a GPU, float32 on the CPU (where the interpreter runs it)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16 if DEVICE.type == "cuda" else torch.float32}
    assert {p.device.type for p in model.parameters()} == {DEVICE.type}
    assert not model.training


def _edit_weights(directory, delete=(), put=None):
    """Rewrite a saved model.safetensors without the keys in `delete`, with the tensors in `put`."""
    from safetensors.torch import load_file, save_file

    sd = load_file(directory / "model.safetensors")
    for key in delete:
        del sd[key]
    save_file({**sd, **(put or {})}, directory / "model.safetensors")
    return directory


def test_mismatched_weights_list_every_key(tmp_path):
    directory = _edit_weights(
        save_hf(hf_model("DeiTForImageClassificationWithTeacher", num_labels=3), tmp_path),
        delete=("deit.encoder.layer.1.output.dense.bias", "distillation_classifier.weight"),
        put={"deit.encoder.layer.0.adapter.weight": torch.zeros(2), "cls_classifier.weight": torch.zeros(3, 65)})
    with pytest.raises(ValueError) as err:
        from_pretrained(directory)
    msg = str(err.value)
    for line in ("missing: deit.encoder.layer.1.output.dense.bias (for blocks.1.fc2.bias [64])",
                 "missing: head_dist.weight [3, 64]", "unexpected: deit.encoder.layer.0.adapter.weight",
                 "wrong shape: cls_classifier.weight is [3, 65], expected [3, 64]"):
        assert line in msg


def test_query_key_value_problems_name_the_checkpoints_keys(tmp_path):
    layer = "vit.encoder.layer.{}.attention.attention.{}"
    directory = _edit_weights(save_hf(hf_model("ViTForImageClassification", num_labels=3), tmp_path),
                              delete=[layer.format(1, "query.weight")],
                              put={layer.format(0, "key.weight"): torch.zeros(63, 64),
                                   layer.format(0, "value.bias"): torch.zeros(64, 1)})
    with pytest.raises(ValueError) as err:
        read_checkpoint(directory)
    msg = str(err.value)
    for line in (f"missing: {layer.format(1, 'query.weight')} (for blocks.1.qkv.weight [192, 64])",
                 f"wrong shape: {layer.format(0, 'key.weight')} is [63, 64], expected [64, 64]",
                 f"wrong shape: {layer.format(0, 'value.bias')} is [64, 1], expected [64]"):
        assert line in msg
    assert "unexpected" not in msg and "blocks.0.qkv" not in msg   # each problem once, by the checkpoint's name


def test_more_labels_than_classifier_rows_is_refused(tmp_path):
    directory = save_hf(hf_model("ViTForImageClassification", num_labels=7), tmp_path / "hf")
    config = json.loads((directory / "config.json").read_text())
    config["id2label"] = {str(i): f"class {i}" for i in range(5)}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json names 5 labels \\(id2label\\), but the classifier has 7 rows"):
        read_checkpoint(directory)
    ref = timm_model("vit_tiny_patch16_224", embed_dim=64, num_heads=2, num_classes=7)
    with pytest.raises(ValueError, match="config.json names 5 labels \\(label_names\\), but the classifier has 7 rows"):
        read_checkpoint(save_timm(ref, tmp_path / "timm", label_names=["a", "b", "c", "d", "e"]))
    with pytest.raises(ValueError, match="config.json says num_classes 5, but the classifier has 7 rows"):
        read_checkpoint(save_timm(ref, tmp_path / "timm5", num_classes=5))


@pytest.mark.parametrize("name, damage, match", [
    ("model.safetensors", lambda b: b[:40], "is not a readable safetensors file, truncated or corrupt?"),
    ("model.safetensors", lambda b: b"\xff" * 8 + b[8:], "is not a readable safetensors file"),
    ("pytorch_model.bin", lambda b: b[: len(b) // 2], "is not a PyTorch checkpoint: not the zip archive torch.save"),
    ("pytorch_model.bin", lambda b: b"not a checkpoint", "is not a PyTorch checkpoint: not the zip archive"),
])
def test_corrupt_weights_name_the_file_in_one_line(name, damage, match, tmp_path, capsys):
    from PIL import Image

    from vit_triton.cli import main

    model = hf_model("ViTForImageClassification", num_labels=3)
    directory = save_hf(model, tmp_path / "ckpt")
    weights = directory / name
    if name == "pytorch_model.bin":   # as transformers 4 saved them
        (directory / "model.safetensors").unlink()
        torch.save(model.state_dict(), weights)
    weights.write_bytes(damage(weights.read_bytes()))
    with pytest.raises(ValueError, match=f"^{weights} {re.escape(match)}"):
        read_checkpoint(directory)
    Image.new("RGB", (40, 30), "red").save(tmp_path / "red.png")
    capsys.readouterr()
    assert main(["classify", str(tmp_path / "red.png"), "--model", str(directory)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"vit-triton classify: error: {weights} "), err


def test_a_mistyped_folder_fails_at_once_when_the_hub_is_unreachable(monkeypatch, caplog):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")   # the discard port: nothing listens
    with pytest.raises(CheckpointNotFound, match="nonexistent_dir: no such local directory or file, not in the "
                                                 "HuggingFace cache .* and the hub cannot be reached .*127.0.0.1"):
        read_checkpoint("nonexistent_dir")
    assert "Retrying" not in caplog.text   # huggingface_hub's retries of an unreachable host took 25 s


def test_classifier_without_its_head_is_reported_missing(tmp_path):
    directory = _edit_weights(save_hf(hf_model("ViTForImageClassification", num_labels=3), tmp_path),
                              delete=("classifier.weight", "classifier.bias"))
    with pytest.raises(ValueError, match=r"missing: head\.weight \[3, 64\]"):
        read_checkpoint(directory)


@pytest.mark.parametrize("edit, match", [
    (dict(architectures=["SwinModel"], model_type="swin"), r"unsupported architecture SwinModel .*"
                                                           r"supported: transformers ViTModel, .*ViTMAEModel.*timm"),
    (dict(architectures=["ViTForMaskedImageModeling"]), "unsupported architecture ViTForMaskedImageModeling"),
    (dict(architecture="convnext_tiny"), r"unsupported architecture convnext_tiny \(timm\); supported:"),
    (dict(architecture="samvit_base_patch16"), r"unsupported architecture samvit_base_patch16 \(timm\) \(windowed "
                                               r"attention with relative position bias, which the kernels do not "
                                               r"compute\); supported:"),
    # BEiT's encoders load; its masked-image-modeling head is no encoder of ours
    (dict(architectures=["BeitForMaskedImageModeling"], model_type="beit"),
     r"unsupported architecture BeitForMaskedImageModeling \(transformers, model_type 'beit'\); supported:"),
])
def test_unsupported_architectures_name_the_supported_ones(edit, match, tmp_path):
    directory = save_hf(hf_model("ViTModel"), tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError, match=match):
        read_checkpoint(directory)


def test_unsupported_timm_features_are_named(tmp_path):
    directory = save_timm(timm_model("vit_tiny_patch16_224", embed_dim=64, num_heads=2, qk_norm=True), tmp_path)
    with pytest.raises(ValueError, match=r"feature in vit_tiny_patch16_224: qk_norm"):
        read_checkpoint(directory)


def test_missing_checkpoints(tmp_path):
    with pytest.raises(CheckpointNotFound, match="no such file or directory: ./nowhere/at/all"):
        read_checkpoint("./nowhere/at/all")
    with pytest.raises(CheckpointNotFound, match="no weights in the directory; expected one of model.safetensors"):
        read_checkpoint(tmp_path)
    save_hf(hf_model("ViTModel"), tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(CheckpointNotFound, match="no config.json"):
        read_checkpoint(tmp_path)
