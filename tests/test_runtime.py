"""The CUDA-graph runner: a clear error without CUDA, a graph per float32 matmul precision (its replay is
checked on the GPU here and by scripts/gpu_check.py, and timed by `vit-triton bench`)."""

import pytest
import torch

import vit_triton
from tests.kernels.checks import tf32_matmuls
from tests.numerics import DEVICE
from vit_triton.model import PRESETS, ViT


@pytest.mark.skipif(DEVICE.type == "cuda", reason="the error is for models that are not on a CUDA device")
def test_capture_needs_a_cuda_model():
    model = ViT(PRESETS["tiny"])
    with pytest.raises(ValueError, match="CUDA graphs need the model on a CUDA device, got cpu"):
        vit_triton.compile(model, batch_sizes=[2])


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a CUDA device")
def test_replay_equals_the_eager_forward():
    model = ViT(PRESETS["tiny"], device=DEVICE).eval()
    runner = vit_triton.compile(model, batch_sizes=[2])
    # Captured ahead, captured on first use, replayed again; at 12 images (312 rows) the GEMMs take
    # the TMA path, whose descriptor scratch comes from the graph's memory pool.
    for batch in (2, 3, 2, 12):
        pixels = torch.randn(batch, 3, 40, 40, device=DEVICE)
        torch.testing.assert_close(runner(pixels), model(pixels), rtol=0, atol=0)


def test_a_graph_per_float32_matmul_precision():
    # The kernels read the precision when they are launched, so a graph captured with exact float32
    # matmuls must not be replayed once tf32 is on.
    shape = (2, 3, 40, 40)
    exact = vit_triton.runtime.CUDAGraphRunner.key(shape, torch.float32)
    with tf32_matmuls():
        assert vit_triton.runtime.CUDAGraphRunner.key(shape, torch.float32) != exact
    assert vit_triton.runtime.CUDAGraphRunner.key(list(shape), torch.float32) == exact


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a CUDA device")
def test_replay_follows_the_float32_matmul_precision():
    model = ViT(PRESETS["tiny"], device=DEVICE).eval()
    runner = vit_triton.compile(model, batch_sizes=[2])
    pixels = torch.randn(2, 3, 40, 40, device=DEVICE)
    exact = runner(pixels)
    with tf32_matmuls():
        torch.testing.assert_close(runner(pixels), model(pixels), rtol=0, atol=0)
    torch.testing.assert_close(runner(pixels), exact, rtol=0, atol=0)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a CUDA device")
def test_tf32_replay_follows_weights_changed_in_place():
    # A tf32 graph reads the weights' kept rounded copies (kernels/tf32.py), brought up to date before
    # each replay, in the memory the graph was captured with.
    model = ViT(PRESETS["tiny"], device=DEVICE).eval()
    pixels = torch.randn(2, 3, 40, 40, device=DEVICE)
    with tf32_matmuls():
        runner = vit_triton.compile(model, batch_sizes=[2], dtype=torch.float32)
        before = runner(pixels)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)
        after = runner(pixels)
        assert not torch.equal(after, before)
        torch.testing.assert_close(after, model(pixels), rtol=0, atol=0)
