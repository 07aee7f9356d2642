"""save_pretrained: a (fine-tuned) model written back in its source library's layout. Its library loads it as it is
(no key missing or unexpected but those documented) and computes what ours does (float32 against float64), and
vit_triton.from_pretrained reads it back as the same model (equal configs, state dicts and labels)."""

import dataclasses
import json

import pytest
import timm
import torch
import transformers

from tests.checkpoints import hf_model, open_clip_timm_tower, save_hf, save_timm, timm_model
from tests.numerics import DEVICE, assert_close, randomize_
from vit_triton import ViT, ViTConfig, from_pretrained
from vit_triton.loaders import CheckpointInfo, read_checkpoint, save_pretrained

LABELS = ("cat", "dog", "newt")
# A classifier written beside an encoder whose transformers class has none of ours, and AIMv2's projection: transformers
# leaves them unused; ViTModel's pooler is no part of our forward, and transformers initialises it afresh.
BESIDE = {"classifier.weight", "classifier.bias", "visual_projection.weight"}
POOLER = {"pooler.dense.weight", "pooler.dense.bias"}
UNUSED = POOLER | {"embeddings.mask_token"}   # DINOv2's and DINOv3's mask token is written as transformers inits it


def _hf_load(directory):
    """The transformers model that config.json names, loaded from `directory`, and its keys missing or unexpected."""
    config = json.loads((directory / "config.json").read_text())
    model, info = getattr(transformers, config["architectures"][0]).from_pretrained(directory, output_loading_info=True)
    return model.eval(), set(info["missing_keys"]), set(info["unexpected_keys"])


def _timm_load(directory):
    return timm.create_model(f"local-dir:{directory}", pretrained=True).eval()


def _zero_key_bias(model):
    """The key third of every qkv.bias zero, as a layout without a key bias (timm's Eva) needs it with rotary
    embeddings."""
    with torch.no_grad():
        for block in model.blocks:
            block.qkv.bias[model.config.embed_dim:2 * model.config.embed_dim] = 0


def _finetuned(source, classes=None):
    """from_pretrained(source) in float32 with a new classifier of `classes` (named), and weights of its own."""
    model = from_pretrained(source, device=DEVICE, dtype=torch.float32)
    if classes:
        model.reset_classifier(len(classes))
        model.checkpoint = dataclasses.replace(model.checkpoint, id2label=dict(enumerate(classes)))
    return randomize_(model)


def _assert_reads_back(model, directory, equal_keys=None):
    """from_pretrained(directory) is `model`: config, labels, preprocessing and every tensor (equal_keys: those)."""
    back = from_pretrained(directory, device=DEVICE, dtype=torch.float32)
    assert back.config == model.config
    assert back.checkpoint.id2label == model.checkpoint.id2label
    theirs = back.state_dict()
    for key, value in model.state_dict().items():
        if equal_keys is None or key in equal_keys:
            assert torch.equal(theirs[key], value), key
    return back


# (source checkpoint, new classes, the written library model's output as ours computes it)
def _logits(m, px):
    return m(px).logits


CASES = {
    "vit-new-labels": (lambda tmp: save_hf(hf_model("ViTForImageClassification", num_labels=5), tmp,
                                           processor=dict(size={"height": 32, "width": 32}, image_mean=[0.4] * 3)),
                       LABELS, _logits),
    "deit-distilled": (lambda tmp: save_hf(hf_model("DeiTForImageClassificationWithTeacher", num_labels=4), tmp),
                       None, _logits),
    # layer scale, registers (the class token's position row folded into it), a classifier of the class token
    "dinov2-registers-head": (lambda tmp: save_hf(hf_model("Dinov2WithRegistersModel", mlp_ratio=2,
                                                           num_register_tokens=2), tmp), LABELS, _logits),
    # a two-tower checkpoint: written as its vision tower with the projection
    "clip-projection": (lambda tmp: save_hf(hf_model("CLIPModel", projection_dim=40), tmp), None,
                        lambda m, px: m(px).image_embeds),
    # the attention-pool head; the classifier beside the encoder (transformers': the pooled output)
    "siglip-head": (lambda tmp: save_hf(hf_model("SiglipVisionModel"), tmp), LABELS,
                    lambda m, px: m(px).pooler_output),
    "aimv2": (lambda tmp: save_hf(hf_model("Aimv2VisionModel", qkv_bias=True), tmp), None,
              lambda m, px: m(px).pooler_output),
    "timm-deit3-layer-scale": (lambda tmp: save_timm(timm_model("deit3_small_patch16_224", embed_dim=64, num_heads=2,
                                                                num_classes=5), tmp), LABELS, None),
    # rotary embeddings, SwiGLU (GluMlp's packed fc1), q_bias and v_bias beside a bias-free qkv
    "timm-eva02": (lambda tmp: save_timm(timm_model("eva02_tiny_patch14_224", embed_dim=64, num_heads=2,
                                                    num_classes=50), tmp), None, None),
}


@pytest.mark.parametrize("case", CASES)
def test_written_model_loads_in_its_library_and_back(case, tmp_path):
    make, classes, run_hf = CASES[case]
    model = _finetuned(make(tmp_path / "source"), classes)
    if case == "timm-eva02":   # Eva has no key bias, which rotary embeddings would not let softmax cancel
        with pytest.raises(ValueError, match=r"timm eva02_tiny_patch14_224, which has no place for blocks.0.k.bias, "
                                             r"blocks.1.k.bias \(the key third of qkv.bias, which must stay zero"):
            save_pretrained(model, tmp_path / "out")
        _zero_key_bias(model)
    assert save_pretrained(model, tmp_path / "out") == tmp_path / "out"
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ours = model(pixels.to(DEVICE))
        if run_hf is None:
            theirs = _timm_load(tmp_path / "out")
            assert theirs.num_classes == model.config.num_classes
            want = theirs.double()(pixels.double())
        else:
            theirs, missing, unexpected = _hf_load(tmp_path / "out")
            assert not missing and unexpected <= BESIDE and bool(unexpected) == (case == "siglip-head")
            if case == "siglip-head":   # transformers' output is the pooled features, the classifier's input
                ours = model.forward_head(model.forward_features(pixels.to(DEVICE)), pre_logits=True)
            want = run_hf(theirs.double(), pixels.double())
    assert_close(ours, want.to(DEVICE), torch.float32)
    back = _assert_reads_back(model, tmp_path / "out")
    if case == "vit-new-labels":
        config = json.loads((tmp_path / "out" / "config.json").read_text())
        assert config["id2label"] == {"0": "cat", "1": "dog", "2": "newt"} and config["label2id"]["newt"] == 2
        assert transformers.AutoModelForImageClassification.from_pretrained(tmp_path / "out").config.num_labels == 3
        assert back.checkpoint.preprocessing == model.checkpoint.preprocessing != {}
    if case == "timm-deit3-layer-scale":
        assert theirs.pretrained_cfg["label_names"] == list(LABELS)
        assert back.config.layer_scale and theirs.blocks[1].ls2.gamma.equal(model.blocks[1].ls2.detach().cpu())


def test_open_clip_tower_is_written_as_timms_clip_tower(tmp_path):
    open_clip = pytest.importorskip("open_clip")   # a test extra
    from safetensors.torch import save_file

    model_cfg = dict(embed_dim=40, quick_gelu=True, text_cfg=dict(context_length=8, vocab_size=50, width=32, heads=2,
                                                                   layers=1),
                     vision_cfg=dict(image_size=32, patch_size=8, width=64, head_width=32, layers=2, mlp_ratio=1.5,
                                     ls_init_value=0.5))
    (tmp_path / "open_clip_config.json").write_text(json.dumps(dict(model_cfg=model_cfg, preprocess_cfg=dict(
        mean=[0.5, 0.4, 0.3], std=[0.2, 0.3, 0.4]))))
    save_file(open_clip.CLIP(**model_cfg).state_dict(), tmp_path / "open_clip_model.safetensors")
    model = _finetuned(tmp_path)
    save_pretrained(model, tmp_path / "out")
    pixels = torch.randn(2, 3, 32, 32)
    theirs = _timm_load(tmp_path / "out")
    with torch.no_grad():   # timm's head is the projection: its logits are the image embedding
        assert_close(model(pixels.to(DEVICE)), theirs.double()(pixels.double()).to(DEVICE), torch.float32)
    back = from_pretrained(tmp_path / "out", device=DEVICE, dtype=torch.float32)
    assert back.checkpoint.library == "timm" and back.checkpoint.preprocessing["mean"] == [0.5, 0.4, 0.3]
    assert back.config == dataclasses.replace(model.config, proj_dim=0, num_classes=40)
    assert back.head.weight.equal(model.proj.weight) and not back.head.bias.any()
    assert all(v.equal(back.state_dict()[k]) for k, v in model.state_dict().items() if k != "proj.weight")


# Every family's layout, without running a model: a checkpoint read and written back unchanged is, to its library,
# the very weights it was made from.
HF_FAMILIES = {
    "ViTModel": dict(qkv_bias=False, hidden_act="gelu_pytorch_tanh"),
    "DeiTModel": dict(),
    "Dinov2Model-swiglu": dict(mlp_ratio=3, use_swiglu_ffn=True),
    "DINOv3ViTModel-gated": dict(num_register_tokens=2, use_gated_mlp=True, hidden_act="silu"),
    "DINOv3ViTModel": dict(num_register_tokens=2),
    "ViTMAEForPreTraining": dict(mask_ratio=0.0),
    "CLIPVisionModel": dict(),
    "SiglipModel": dict(),
    "Aimv2Model-native": dict(projection_dim=40, is_native=True),
    "SiglipVisionModel-no-head": dict(vision_use_head=False),
    "Idefics3VisionTransformer": dict(),
    "SmolVLMVisionTransformer": dict(),
    "InternVLVisionModel-biases-token": dict(attention_bias=True, use_mean_pooling=False),
    "InternVLVisionModel-rmsnorm": dict(norm_type="rms_norm"),
}


@pytest.mark.parametrize("case", HF_FAMILIES)
def test_unchanged_transformers_checkpoint_is_written_back_as_it_was(case, tmp_path):
    ref = hf_model(case.split("-")[0], **HF_FAMILIES[case])
    model = from_pretrained(save_hf(ref, tmp_path / "source"), device="cpu", dtype=torch.float32)
    save_pretrained(model, tmp_path / "out")
    theirs, missing, unexpected = _hf_load(tmp_path / "out")
    assert missing <= POOLER and unexpected <= BESIDE
    ref_sd = ref.state_dict()
    # two towers: the vision one; MAE's encoder without its decoder
    ref_sd.update({k.split(".", 1)[1]: v for k, v in ref_sd.items() if k.startswith(("vision_model.", "vit."))})
    assert [k for k, v in theirs.state_dict().items() if k not in UNUSED and not ref_sd[k].equal(v)] == []
    _assert_reads_back(model, tmp_path / "out")


TIMM_FAMILIES = {
    "vit_small_patch14_reg4_dinov2": dict(embed_dim=64, num_heads=2, patch_size=8),
    "vit_giant_patch14_dinov2": dict(embed_dim=96, num_heads=2, patch_size=8),   # SwiGLUPacked
    "deit_tiny_distilled_patch16_224": dict(embed_dim=64, num_heads=2, num_classes=3),
    "vit_base_patch16_siglip_224": dict(embed_dim=64, num_heads=2, num_classes=4),
    "eva02_base_patch14_448": dict(embed_dim=64, num_heads=2, patch_size=8, num_classes=0),   # q, k, v apart; SwiGLU
    "vit_small_patch16_rope_mixed_224": dict(embed_dim=64, num_heads=2, num_classes=0, init_values=0.5),
    "vit_small_patch16_dinov3": dict(embed_dim=64, num_heads=2, patch_size=8),
    "aimv2_large_patch14_224": dict(embed_dim=64, num_heads=2, mlp_ratio=1.5),
    "eva02_base_patch16_clip_224": dict(embed_dim=64, num_heads=2, patch_size=8, num_classes=40),   # attn.norm
    "vit_pe_core_tiny_patch16_384": dict(embed_dim=64, num_heads=2, patch_size=8, attn_pool_num_heads=4,
                                         mlp_ratio=1.5),   # the attention pool's own heads and MLP width
}


@pytest.mark.parametrize("name", TIMM_FAMILIES)
def test_unchanged_timm_checkpoint_is_written_back_as_it_was(name, tmp_path):
    if not timm.is_model(name):
        pytest.skip(f"this timm has no {name}")
    ref = timm_model(name, **TIMM_FAMILIES[name])
    model = from_pretrained(save_timm(ref, tmp_path / "source"), device="cpu", dtype=torch.float32)
    save_pretrained(model, tmp_path / "out")
    theirs = _timm_load(tmp_path / "out")
    assert type(theirs) is type(ref) and theirs.state_dict().keys() == ref.state_dict().keys()
    assert all(v.equal(theirs.state_dict()[k]) for k, v in ref.state_dict().items())
    _assert_reads_back(model, tmp_path / "out")


def test_timm_wrapper_is_written_as_timms_layout_which_transformers_reads(tmp_path):
    config = transformers.TimmWrapperConfig(architecture="vit_tiny_patch16_224", num_labels=3, model_args=dict(
        img_size=32, patch_size=8, embed_dim=64, num_heads=2, depth=1))
    ref = randomize_(transformers.TimmWrapperForImageClassification(config)).eval()
    model = _finetuned(save_hf(ref, tmp_path / "source"), LABELS)
    save_pretrained(model, tmp_path / "out")
    theirs = transformers.TimmWrapperForImageClassification.from_pretrained(tmp_path / "out").eval()
    assert theirs.config.id2label == dict(enumerate(LABELS))
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_close(model(pixels.to(DEVICE)), theirs.double()(pixels.double()).logits.to(DEVICE), torch.float32)
    assert _timm_load(tmp_path / "out").num_classes == 3
    _assert_reads_back(model, tmp_path / "out")


def test_open_clip_timm_tower_is_written_as_its_timm_model(tmp_path, monkeypatch):
    # EVA02-CLIP in OpenCLIP: its projection, the timm trunk's head with a bias, stays timm's head
    ref = open_clip_timm_tower(tmp_path / "source", "eva02-clip-head", monkeypatch)
    model = _finetuned(tmp_path / "source")
    _zero_key_bias(model)
    save_pretrained(model, tmp_path / "out")
    theirs = _timm_load(tmp_path / "out")
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert_close(model(pixels.to(DEVICE)), theirs.double()(pixels.double()).to(DEVICE), torch.float32)
    back = from_pretrained(tmp_path / "out", device=DEVICE, dtype=torch.float32)
    assert back.checkpoint.library == "timm" and back.checkpoint.architecture == "eva02_base_patch16_clip_224"
    assert back.config == dataclasses.replace(model.config, proj_dim=0, embed_proj_bias=False, num_classes=40)
    assert back.head.weight.equal(model.proj.weight) and back.head.bias.equal(model.proj.bias)
    assert type(ref.visual.trunk) is type(theirs)


def test_a_dinov2_classifier_of_the_patch_mean_is_refused(tmp_path):
    ref = hf_model("Dinov2ForImageClassification", num_labels=3)
    with pytest.raises(ValueError, match=r"unsupported: classifier\.weight reads the mean of the patch tokens "
                                         r"\(its columns 64 to 127 are not all zero\)"):
        read_checkpoint(save_hf(ref, tmp_path))


def test_writing_again_replaces_the_checkpoint(tmp_path):
    source = save_hf(hf_model("ViTForImageClassification", num_labels=3), tmp_path / "source")
    first, second = (from_pretrained(source, device="cpu", dtype=torch.float32) for _ in range(2))
    randomize_(second)
    second.reset_classifier(2)
    second.checkpoint = dataclasses.replace(second.checkpoint, id2label={0: "a", 1: "b"})
    for model in (first, second):
        save_pretrained(model, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    _assert_reads_back(second, tmp_path / "out")


def test_bad_input(tmp_path):
    cfg = ViTConfig(image_size=32, patch_size=8, embed_dim=64, depth=1, num_heads=2, mlp_dim=96, num_classes=3,
                    pool="avg", fc_norm=True)
    model = ViT(cfg)
    with pytest.raises(ValueError, match=r"save_pretrained needs the layout to write: a model from "
                                         r"vit_triton.from_pretrained \(it sets model.checkpoint\) or info="):
        save_pretrained(model, tmp_path)
    info = CheckpointInfo("made", "transformers", "ViTForImageClassification", {}, {})
    with pytest.raises(ValueError, match=r"cannot write the model as transformers ViTForImageClassification, which "
                                         r"does not hold its .*pool 'avg' \(it would read back as 'token'\)"):
        save_pretrained(model, tmp_path, info=info)
    with pytest.raises(ValueError, match=r"id2label names classes \[0, 3\], expected classes 0 to 2"):
        save_pretrained(model, tmp_path, info=dataclasses.replace(info, id2label={0: "a", 3: "d"}))
    with pytest.raises(ValueError, match=r"unsupported library 'keras'; supported: transformers, timm, open_clip"):
        save_pretrained(model, tmp_path, info=dataclasses.replace(info, library="keras"))
    with pytest.raises(ValueError, match=r"cannot write the model as timm vit_base_patch16_clip_224, which does not "
                                         r"hold its norm_eps 1e-06 \(it would read back as 1e-05\)"):
        save_pretrained(model, tmp_path, info=dataclasses.replace(info, library="timm",
                                                                  architecture="vit_base_patch16_clip_224"))
    assert not any(tmp_path.iterdir())   # nothing written
