"""The CUDA-graph runner: a clear error without CUDA (its replay is checked on the GPU by
scripts/gpu_check.py and timed by `vit-triton bench`)."""

import pytest
import torch

import vit_triton
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
