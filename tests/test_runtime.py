"""The CUDA-graph runner: a clear error without CUDA, a graph per float32 matmul precision (its replay is
checked on the GPU here and by scripts/gpu_check.py, and timed by `vit-triton bench`)."""

import threading

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


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a CUDA device")
def test_tuning_and_capture_beside_a_thread_that_pins_memory(monkeypatch, tmp_path):
    # A first call tunes linear from CUDA-graph replays and the runner captures the forward while, in a
    # serving loop, a DataLoader's pin-memory thread allocates page-locked memory. In CUDA's global
    # capture mode that breaks the capture (and every later random draw of the process).
    monkeypatch.setenv("VIT_TRITON_CACHE_DIR", str(tmp_path))   # nothing tuned yet
    model = ViT(PRESETS["tiny"], device=DEVICE).eval()
    pixels = torch.randn(5, 3, 40, 40, device=DEVICE)
    stop, allocations, errors = threading.Event(), [0], []

    def pin() -> None:
        # As a loader does: page-locked batches copied to the GPU on a stream of its own. The caching
        # host allocator then queries the copies' events when it hands out memory again.
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                while not stop.is_set():
                    torch.randn(3, 40, 40).pin_memory().to(DEVICE, non_blocking=True)
                    allocations[0] += 1
        except Exception as e:   # a loader would re-raise it in the main thread
            errors.append(e)

    worker = threading.Thread(target=pin)
    worker.start()
    try:
        runner = vit_triton.compile(model, batch_sizes=[5])
        out = runner(pixels)
    finally:
        stop.set()
        worker.join()
    assert not errors, f"the pinning thread failed: {errors}"
    assert allocations[0] > 10, "the pinning thread hardly ran"
    torch.testing.assert_close(out, model(pixels), rtol=0, atol=0)
    torch.randn(3, device=DEVICE)   # the random generator is not left in capture mode
