"""scripts/gpu_check.py's command line on a machine without a GPU: bad choices are named, and the check
itself says it needs a CUDA device (it runs on the device: benchmarks/results/h100/gpu_check*)."""

from functools import partial

import pytest
import torch

from tests.scripts import run_script

run = partial(run_script, "gpu_check.py")


@pytest.mark.parametrize("args, message", [
    (["--models", "vit-base,vit-huge"], "unknown model 'vit-huge': expected one of vit-base, clip-large"),
    (["--precisions", "tf32,fp8"], "unknown precision 'fp8': expected one of float32, tf32, bfloat16, float16"),
    (["--batches", "1,x"], "--batches must be comma-separated positive integers, got '1,x'"),
    (["--batches", "0"], "--batches must be comma-separated positive integers, got '0'"),
])
def test_unknown_choices_are_named(args, message):
    result = run(*args)
    assert result.returncode == 2 and message in result.stderr, result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_a_gpu_it_says_so():
    result = run("--models", "clip-large", "--precisions", "tf32", "--batches", "1")
    assert result.returncode == 2 and "gpu_check needs a CUDA device" in result.stderr, result.stderr
