"""scripts/design_bound.py on a machine without a GPU: its command line, the GEMM it puts in the model's place,
and that the model's own GEMM comes back whatever the capture does (its timings run on the device)."""

from functools import partial

import pytest
import torch
import torch.nn.functional as F

import vit_triton.model.layers as layers_module
from tests.scripts import load_script, run_script
from vit_triton.model import PRESETS, ViT

run = partial(run_script, "design_bound.py")


@pytest.mark.parametrize("args, message", [
    (["--model", "vit-huge"], "invalid choice: 'vit-huge'"),
    (["--batch-sizes", "32,x"], "argument --batch-sizes: expected comma-separated positive integers, got '32,x'"),
    (["--batch-sizes", "0"], "argument --batch-sizes: expected comma-separated positive integers, got '0'"),
    (["--modes", "fast"], "--modes takes MODE or MODE@BATCH with MODE one of"),
    (["--modes", "reduce-overhead@0"], "got 'reduce-overhead@0'"),
    (["--rounds", "0"], "--rounds must be a positive integer, got '0'"),
])
def test_bad_arguments_are_named(args, message):
    result = run(*args)
    assert result.returncode == 2 and message in result.stderr, result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_a_gpu_it_says_so():
    result = run("--batch-sizes", "1")
    assert result.returncode == 2 and "design_bound needs a CUDA device" in result.stderr, result.stderr


def test_modes_apply_at_their_batch_only():
    script = load_script("design_bound.py")
    assert script.peer_modes("reduce-overhead,max-autotune-no-cudagraphs@256") == [
        ("reduce-overhead", None), ("max-autotune-no-cudagraphs", 256)]


def test_the_bound_gemm_is_cublas_with_the_bias_alone():
    script = load_script("design_bound.py")
    x, w, b, r = torch.randn(7, 5), torch.randn(3, 5), torch.randn(3), torch.randn(7, 3)
    y = script.cublas_linear(x, w, b, activation="gelu", residual=r, scale=0.5, tf32_input=True, tf32_output=False)
    assert torch.equal(y, F.linear(x, w, b))


def test_the_models_gemm_comes_back_when_the_capture_fails():   # a model on the CPU cannot be captured
    script = load_script("design_bound.py")
    real = layers_module.linear
    model = ViT(PRESETS["tiny"]).eval()
    pixels = torch.randn(1, 3, model.config.image_size, model.config.image_size)
    with pytest.raises(ValueError, match="CUDA graphs need the model on a CUDA device"):
        script.graph_replay(model, pixels, script.cublas_linear)
    assert layers_module.linear is real
