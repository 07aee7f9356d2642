"""The CUDA-graph runner: a clear error without CUDA, a graph per float32 matmul precision (its replay is
checked on the GPU here and by scripts/gpu_check.py, and timed by `vit-triton bench`)."""

import threading

import pytest
import torch

import vit_triton
from tests.kernels.checks import tf32_matmuls
from tests.numerics import DEVICE
from vit_triton.kernels.tuning import capture_stream, graph_time, repeated
from vit_triton.model import PRESETS, ViT
from vit_triton.runtime import CUDAGraphRunner


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


def test_a_graph_per_set_of_launch_options():
    shape = (2, 3, 40, 40)
    with vit_triton.launch_options(pdl=False):
        without_pdl = CUDAGraphRunner.key(shape, torch.float32)
    assert without_pdl != CUDAGraphRunner.key(shape, torch.float32)
    with vit_triton.launch_options(pdl=False):
        assert CUDAGraphRunner.key(shape, torch.float32) == without_pdl


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a CUDA device")
def test_a_graphs_own_replay_runs_the_forward_on_its_buffers():
    model = ViT(PRESETS["tiny"], device=DEVICE).eval()
    runner = vit_triton.compile(model, batch_sizes=[2])
    pixels = torch.randn(2, 3, 40, 40, device=DEVICE)
    replayed = runner(pixels)   # copies pixels into the graph's input buffer
    out = runner._graphs[runner.key(tuple(pixels.shape), pixels.dtype)][2]
    with torch.inference_mode():   # the graph's buffers are inference tensors
        out.zero_()
    runner.graph((2, 3, 40, 40), pixels.dtype).replay()
    torch.testing.assert_close(out, replayed, rtol=0, atol=0)


def test_a_graph_per_float32_matmul_precision():
    # The kernels read the precision when they are launched, so a graph captured with exact float32
    # matmuls must not be replayed once tf32 is on.
    shape = (2, 3, 40, 40)
    exact = CUDAGraphRunner.key(shape, torch.float32)
    with tf32_matmuls():
        assert CUDAGraphRunner.key(shape, torch.float32) != exact
    assert CUDAGraphRunner.key(list(shape), torch.float32) == exact


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
def test_replay_at_another_size_follows_pos_embed_changed_in_place():
    # The warm-up calls resample the position table to 3 x 5 patches (the model's own grid is 5 x 5); the graph
    # reads that table, which is resampled again, in place, before a replay once pos_embed has changed.
    model = ViT(PRESETS["tiny"], device=DEVICE).eval()
    runner = vit_triton.compile(model)
    pixels = torch.randn(2, 3, 24, 40, device=DEVICE)
    before = runner(pixels)
    torch.testing.assert_close(before, model(pixels), rtol=0, atol=0)
    with torch.no_grad():
        model.pos_embed.mul_(1.5)
    after = runner(pixels)
    assert not torch.equal(after, before)
    torch.testing.assert_close(after, model(pixels), rtol=0, atol=0)


class CopyingThread(threading.Thread):
    """As a loader does: page-locked batches copied to the GPU on a stream of the thread's own (one of
    PyTorch's pooled streams). The caching host allocator then queries the copies' events when it hands
    out memory again."""

    def __init__(self) -> None:
        super().__init__()
        self.stop, self.copies, self.errors = threading.Event(), 0, []

    def run(self) -> None:
        try:
            with torch.cuda.stream(torch.cuda.Stream()):
                while not self.stop.is_set():
                    torch.randn(3, 40, 40).pin_memory().to(DEVICE, non_blocking=True)
                    self.copies += 1
        except Exception as e:   # a loader would re-raise it in the main thread
            self.errors.append(e)

    def __enter__(self) -> "CopyingThread":
        self.start()
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.stop.set()
        self.join()
        if exc_type is None:   # else the body's own error is the one to see
            assert not self.errors, f"the copying thread failed: {self.errors}"
            assert self.copies > 10, "the copying thread hardly ran"


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a CUDA device")
def test_graphs_are_captured_on_a_stream_no_other_thread_is_handed():
    # torch.cuda.Stream() hands out 32 pooled streams a device in turn: 64 calls see them all.
    pooled = {torch.cuda.Stream(DEVICE).cuda_stream for _ in range(64)}
    mine = capture_stream(DEVICE)
    assert mine.cuda_stream not in pooled and capture_stream(DEVICE) is mine
    theirs = []
    thread = threading.Thread(target=lambda: theirs.append(capture_stream(DEVICE).cuda_stream))
    thread.start()
    thread.join()
    assert theirs[0] not in pooled | {mine.cuda_stream}


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a CUDA device")
def test_timing_beside_a_thread_that_copies_on_a_stream_of_its_own():
    # Each timing captures two graphs; on pooled streams, one in 32 of them was the copying thread's
    # stream, and its copies failed with "CUDA error: invalid argument".
    x = torch.zeros(1024, device=DEVICE)
    with CopyingThread():
        for _ in range(400):
            assert graph_time(lambda: x.add_(1), budget_ms=0.05, samples=1) > 0


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a CUDA device")
def test_repeated_replays_as_many_calls_as_it_says():
    x = torch.zeros(1 << 20, device=DEVICE)   # a few microseconds a call: hundreds of calls in 20 ms
    replay, calls = repeated(lambda: x.add_(1), budget_ms=20.0)
    assert 20 < calls <= 1000
    before = x[0].item()   # graph_time's calls, outside the graph
    replay()
    replay()
    torch.cuda.synchronize()
    assert x[0].item() - before == 2 * calls


@pytest.mark.skipif(DEVICE.type != "cuda", reason="CUDA graphs need a CUDA device")
def test_tuning_and_capture_beside_a_thread_that_pins_memory(monkeypatch, tmp_path):
    # A first call tunes linear from CUDA-graph replays and the runner captures the forward while, in a
    # serving loop, a DataLoader's pin-memory thread allocates page-locked memory. In CUDA's global
    # capture mode that breaks the capture (and every later random draw of the process).
    monkeypatch.setenv("VIT_TRITON_CACHE_DIR", str(tmp_path))   # nothing tuned yet
    model = ViT(PRESETS["tiny"], device=DEVICE).eval()
    pixels = torch.randn(5, 3, 40, 40, device=DEVICE)
    with CopyingThread():
        runner = vit_triton.compile(model, batch_sizes=[5])
        out = runner(pixels)
    torch.testing.assert_close(out, model(pixels), rtol=0, atol=0)
    torch.randn(3, device=DEVICE)   # the random generator is not left in capture mode
