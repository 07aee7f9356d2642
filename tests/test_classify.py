"""`vit-triton classify`: labels and probabilities as transformers and timm compute them, JSON output,
unreadable images, models without a head, and a hub id read from the HuggingFace cache (offline)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from tests.checkpoints import hf_model, image, save_hf, save_timm, timm_model, write_bad_files
from vit_triton.cli import main

LABELS = {0: "tabby cat", 1: "golden retriever", 2: "red fox", 3: "barn owl", 4: "toaster"}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("classify")
    model = hf_model("ViTForImageClassification", num_labels=5, id2label=LABELS, seed=3)
    save_hf(model, root / "vit", processor=dict(size={"height": 32, "width": 32}, resample=3))
    for i, (h, w) in enumerate([(48, 64), (30, 30), (90, 41)]):
        image(i, h, w).save(root / f"img{i}.{'png' if i % 2 else 'jpg'}")
    write_bad_files(root / "bad")
    return root


@pytest.fixture(autouse=True)
def in_work(work, monkeypatch):
    monkeypatch.chdir(work)


IMAGES = ["img0.jpg", "img1.png", "img2.jpg"]


def _hf_top(work, k, **size):
    """transformers' top k; with size {"height", "width"}, its processor and model at that size."""
    import transformers
    from PIL import Image

    processor = transformers.AutoImageProcessor.from_pretrained(work / "vit")
    model = transformers.ViTForImageClassification.from_pretrained(work / "vit").eval()
    images = [Image.open(work / p).convert("RGB") for p in IMAGES]
    pixels = processor(images, return_tensors="pt", **size)["pixel_values"]
    with torch.no_grad():
        return model(pixels, interpolate_pos_encoding=bool(size)).logits.softmax(-1).topk(k)


def test_json_equals_transformers_pipeline(work, capsys):
    assert main(["classify", *IMAGES, "--model", "vit", "--top-k", "3", "--json", "--batch-size", "2", "--dtype", "fp32"]) == 0
    results = json.loads(capsys.readouterr().out)
    probs, classes = _hf_top(work, 3)
    assert [r["path"] for r in results] == IMAGES
    for r, p, c in zip(results, probs, classes):
        assert [x["index"] for x in r["predictions"]] == c.tolist()
        assert [x["label"] for x in r["predictions"]] == [LABELS[i] for i in c.tolist()]
        assert [x["probability"] for x in r["predictions"]] == pytest.approx(p.tolist(), abs=1e-5)


def test_another_image_size_equals_transformers_at_that_size(work, capsys):
    assert main(["classify", *IMAGES, "--model", "vit", "--top-k", "3", "--json", "--image-size", "24x40",
                 "--dtype", "fp32"]) == 0
    results = json.loads(capsys.readouterr().out)
    probs, classes = _hf_top(work, 3, size={"height": 24, "width": 40})
    for r, p, c in zip(results, probs, classes):
        assert [x["index"] for x in r["predictions"]] == c.tolist()
        assert [x["probability"] for x in r["predictions"]] == pytest.approx(p.tolist(), abs=1e-5)


def test_an_image_size_the_model_does_not_take_is_a_usage_error(capsys):
    assert main(["classify", "img0.jpg", "--model", "vit", "--image-size", "6"]) == 2
    assert ("vit-triton classify: error: --image-size 6x6: image height and width must be at least the patch size "
            "8, got 6x6") in capsys.readouterr().err


def test_text_output_and_unreadable_images(capsys):
    code = main(["classify", "img1.png", "bad/empty.jpg", "bad/notes.txt", "img0.jpg", "--model", "vit", "--top-k", "2"])
    assert code == 1
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert [lines[0], lines[3]] == ["img1.png", "img0.jpg"] and len(lines) == 6
    assert all(line.startswith("  0.") and line[8:10] == "  " and line[10:] in LABELS.values()
               for line in lines[1:3] + lines[4:6])
    assert "vit-triton classify: bad/empty.jpg: empty file" in err
    assert "vit-triton classify: bad/notes.txt: not an image" in err


def test_json_lists_unreadable_images_with_the_reason(capsys):
    assert main(["classify", "bad/truncated.jpg", "img2.jpg", "--model", "vit", "--json"]) == 1
    results = json.loads(capsys.readouterr().out)
    assert results[0]["path"] == "bad/truncated.jpg" and results[0]["error"].startswith("truncated or corrupt")
    assert len(results[1]["predictions"]) == 5  # top-k 5 of 5 classes


def test_nan_logits_are_an_error_naming_the_image(tmp_path, capsys):
    model = hf_model("ViTForImageClassification", num_labels=5)
    with torch.no_grad():
        model.classifier.bias[2] = float("nan")
    save_hf(model, tmp_path / "nan")
    assert main(["classify", "img1.png", "bad/empty.jpg", "--model", str(tmp_path / "nan"), "--json"]) == 1
    nan = "NaN or infinite output (the checkpoint's weights or preprocessing make one, or a value overflows the dtype)"
    out, err = capsys.readouterr()
    assert json.loads(out) == [{"path": "img1.png", "error": nan}, {"path": "bad/empty.jpg", "error": "empty file"}]
    assert f"vit-triton classify: img1.png: {nan}\n" in err


def test_timm_distilled_deit_with_label_names(tmp_path, capsys):
    import timm.data

    ref = timm_model("deit_tiny_distilled_patch16_224", embed_dim=64, num_heads=2, num_classes=3, seed=5)
    save_timm(ref, tmp_path / "deit", label_names=["n01", "n02", "n03"],
              label_descriptions={"n01": "alpha", "n02": "beta", "n03": "gamma"})
    assert main(["classify", "img0.jpg", "--model", str(tmp_path / "deit"), "--top-k", "3", "--json",
                 "--dtype", "fp32"]) == 0   # float32 on a GPU too, as the reference
    got = json.loads(capsys.readouterr().out)[0]["predictions"]
    cfg = json.loads((tmp_path / "deit" / "config.json").read_text())["pretrained_cfg"]
    transform = timm.data.create_transform(**timm.data.resolve_data_config(pretrained_cfg=cfg))
    from PIL import Image
    with torch.no_grad():
        p, c = ref(transform(Image.open("img0.jpg").convert("RGB"))[None]).softmax(-1)[0].topk(3)
    assert [x["label"] for x in got] == [["alpha", "beta", "gamma"][i] for i in c.tolist()]
    assert [x["probability"] for x in got] == pytest.approx(p.tolist(), abs=1e-5)


def test_a_model_without_a_head_is_a_usage_error(tmp_path, capsys):
    save_hf(hf_model("DeiTModel"), tmp_path / "bare")
    assert main(["classify", "img0.jpg", "--model", str(tmp_path / "bare")]) == 2
    assert "has no classification head (DeiTModel): use vit-triton embed" in capsys.readouterr().err


def _offline(cache, *args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    return subprocess.run([sys.executable, "-m", "vit_triton", *args], env=env, capture_output=True, text=True,
                          timeout=300)


def test_hub_id_from_the_huggingface_cache(work, tmp_path):
    # The cache layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<commit>/...}
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "cache" / "models--tiny-org--tiny-vit"
    shutil.copytree(work / "vit", repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    hub = _offline(tmp_path / "cache", "classify", "img0.jpg", "--model", "tiny-org/tiny-vit", "--json")
    local = _offline(tmp_path / "cache", "classify", "img0.jpg", "--model", "vit", "--json")
    assert hub.returncode == local.returncode == 0, hub.stderr
    assert json.loads(hub.stdout) == json.loads(local.stdout)

    missing = _offline(tmp_path / "cache", "classify", "img0.jpg", "--model", "tiny-org/not-there")
    assert missing.returncode == 2
    assert ("vit-triton classify: error: tiny-org/not-there: no such local directory or file, not in the "
            "HuggingFace cache") in missing.stderr
