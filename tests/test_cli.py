"""`vit-triton verify`, the README's main job, end to end through the interpreter."""

import importlib
import importlib.metadata
import re
import sys

import pytest
import torch

from vit_triton.cli import main
from vit_triton.utils import MissingExtra, image_size


def test_verify_prints_errors_and_times(capsys):
    assert main(["verify", "--dtypes", "fp32,bf16", "--batch-size", "1"]) == 0
    out = capsys.readouterr().out
    for name in ("patch_embed", "layer_norm final", "linear qkv", "fused_attention", "linear proj +res",
                 "linear fc1 +gelu", "linear fc2 +res", "linear head", "model forward"):
        assert out.count(name) == 2, name
    assert "FAIL" not in out
    assert "all 20 checks within tolerance" in out
    assert "time per batch of 1" in out and "images/s" in out


@pytest.mark.parametrize("argv, match", [
    (["verify", "--model", "vit_huge"], "unknown model 'vit_huge'; expected one of tiny, "),
    (["verify", "--dtypes", "fp32,fp64"], "argument --dtypes: unknown dtype 'fp64'; expected a subset of fp32,bf16,fp16"),
    (["verify", "--batch-size", "0"], "argument --batch-size: expected a positive integer, got '0'"),
    (["verify", "--batch-size", "-1"], "argument --batch-size: expected a positive integer, got '-1'"),
    (["bench", "--batch-sizes", "0"], "argument --batch-sizes: expected comma-separated positive integers, got '0'"),
    (["bench", "--batch-sizes", "1,two"], "argument --batch-sizes: expected comma-separated positive integers"),
    (["bench", "--model", "vit_huge"], "unknown model 'vit_huge'; expected one of tiny, "),
    (["bench", "--systems", "hf,nope"], "unknown systems ['nope']; expected a subset of vit-triton,"),
    (["bench", "--image-size", "8"], "--image-size 8: image_size 8 must be at least patch_size 16"),
    (["bench", "--model", "resnet18"], "--model resnet18: from_timm takes a timm VisionTransformer, "
                                       "VisionTransformerDistilled, Eva or Beit, got ResNet"),
    (["classify", "a.jpg", "--model", "m", "--top-k", "0"], "argument --top-k: expected a positive integer, got '0'"),
    (["classify", "a.jpg", "--model", "m", "--batch-size", "x"], "argument --batch-size: expected a positive integer"),
    (["embed", "imgs", "--model", "m", "--output", "o.npy", "--batch-size", "0"], "argument --batch-size: expected a "),
    (["embed", "imgs", "--model", "m", "--output", "o.npy", "--chunk-size", "-3"], "argument --chunk-size: expected a "),
    (["embed", "imgs", "--model", "m", "--output", "o.npy", "--num-workers", "-1"],
     "argument --num-workers: expected an integer of at least 0, got '-1'"),
])
def test_usage_errors_exit_2_with_the_expected_value(argv, match, capsys):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and f"vit-triton {argv[0]}: error: " in err and match in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the errors of a machine without CUDA")
@pytest.mark.parametrize("command", [["classify", "a.jpg"], ["embed", "imgs", "--output", "o.npy"],
                                     ["finetune", "imgs", "--output", "out"]])
@pytest.mark.parametrize("device", ["cuda", "tpu"])
def test_a_device_this_machine_lacks_exits_2_naming_those_it_has(command, device, capsys):
    assert main([*command, "--model", "m", "--device", device]) == 2
    assert capsys.readouterr().err == (f"vit-triton {command[0]}: error: --device {device}: expected a device of this "
                                       f"machine: cpu (it has no CUDA device)\n")


def test_version_is_the_installed_packages(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    version = importlib.metadata.version("vit-triton")
    assert exit.value.code == 0 and capsys.readouterr().out == f"vit-triton {version}\n"


def test_embed_help_names_the_model_families_and_what_the_output_files_hold(capsys):
    with pytest.raises(SystemExit):
        main(["embed", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ("Supported families: ViT, DeiT, DINOv2, DINOv3, EVA02, RoPE ViT, CLIP (OpenCLIP's towers too), SigLIP, "
            "ViT-MAE, AIMv2, from transformers or timm") in text
    assert ('emb.paths.json, a JSON object: "paths" (the rows\' paths, in order) and the run\'s "settings", "cwd", '
            '"done", "skipped"') in text
    assert "emb.inputs.tsv path, size and mtime_ns of each input" in text


@pytest.mark.parametrize("text, size", [("24", (24, 24)), ("24x40", (24, 40)), (" 48 X 16 ", (48, 16))])
def test_image_size_values(text, size):
    assert image_size(text) == size


@pytest.mark.parametrize("command", ["classify", "embed"])
@pytest.mark.parametrize("value", ["0", "24x", "x24", "24x0", "-8", "24*40", "24x40x3", "big"])
def test_a_bad_image_size_is_a_usage_error_naming_the_expected_form(command, value, capsys):
    argv = [command, "imgs", "--model", "m", "--output", "o.npy"][:4 if command == "classify" else 6]
    with pytest.raises(SystemExit) as exit:
        main([*argv, f"--image-size={value}"])
    assert exit.value.code == 2
    assert (f"argument --image-size: expected an image size N or HxW (height x width, positive integers), "
            f"got {value!r}") in capsys.readouterr().err


@pytest.mark.parametrize("command", ["classify", "embed"])
def test_help_names_the_image_size_option(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--image-size N|HxW run the model on images of this size, N x N or H x W pixels" in text


def test_bench_help_names_every_system(capsys):
    from vit_triton.bench.systems import SYSTEMS

    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    listed = "".join(capsys.readouterr().out.split())   # argparse wraps the help text, even inside names
    assert listed.split("comma-separatedsubsetof")[1].split("(default:all)")[0].split(",") == list(SYSTEMS)


def test_a_missing_extra_names_the_pip_command(monkeypatch, tmp_path, capsys):
    for module in ("pyarrow", "pyarrow.parquet", "matplotlib"):
        monkeypatch.setitem(sys.modules, module, None)   # import fails as if not installed
    (tmp_path / "imgs").mkdir()
    assert main(["embed", str(tmp_path / "imgs"), "--model", "m", "--output", str(tmp_path / "o.parquet")]) == 1
    assert capsys.readouterr().err == ('vit-triton embed: error: --output *.parquet needs pyarrow, which is not '
                                       'installed: pip install "vit-triton[embed]"\n')
    monkeypatch.delitem(sys.modules, "vit_triton.bench.plots", raising=False)
    with pytest.raises(MissingExtra, match=re.escape('plots needs matplotlib, which is not installed: pip install '
                                                     '"vit-triton[bench]"')):
        importlib.import_module("vit_triton.bench.plots")
