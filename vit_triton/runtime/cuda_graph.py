"""Replay a model's whole forward pass as one CUDA graph per input shape.

An eager forward of ViT-B issues 87 kernel launches; at small batch the GPU waits on the Python
that issues them. Captured once per (batch, dtype) and float32 matmul precision (which the kernels
read when they are launched, so a graph holds the one it was captured under), after warm-up calls
that run Triton's tuning outside the capture, the forward becomes one graph launch reading a static
input buffer. Graphs share one memory pool, so replays are serialised by a lock: a runner is safe to
call from several threads of a serving loop. A graph reads the weights where they lie, so in-place
weight updates reach it; with tf32 it reads their rounded copies, which are brought up to date before
each replay (kernels/tf32.py), and so are the position tables resampled for images of another size than the
checkpoint's (model/pos_embed.py): the warm-up calls resample them, the graph reads them where they are.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import torch

from ..kernels import current_launch_options
from ..kernels.tuning import capture_stream
from ..kernels.tf32 import refresh_copies
from ..model import ViT


class CUDAGraphRunner:
    """Callable like the model (pixels -> output), or like `forward`; captures a graph the first time it sees an
    input shape."""

    def __init__(self, model: torch.nn.Module, warmup: int = 2,
                 forward: Callable[[torch.Tensor], torch.Tensor | tuple[torch.Tensor, ...]] | None = None) -> None:
        """forward: what each graph holds, from the input to a tensor or a tuple of tensors (default: the model's
        forward; `vit-triton embed` graphs normalizing uint8 pixels and pooling too). Once warmed up it must be
        capturable: no copy from host memory, no wait for the GPU."""
        self.model = model
        self.forward = forward or model
        self.warmup = warmup
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, object]] = {}
        self._pool = None
        self._lock = threading.Lock()
        self._vits = [m for m in model.modules() if isinstance(m, ViT)]   # whose position tables to refresh

    def capture(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        """Warm up (autotune) and capture the forward for inputs of this shape and dtype."""
        device = next(self.model.parameters()).device
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need the model on a CUDA device, got {device}")
        with self._lock:
            self._capture(tuple(shape), dtype, device)

    def graph(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.cuda.CUDAGraph:
        """The graph captured for inputs of this shape and dtype (capture() first): its replay() runs the forward
        on the graph's own input and output buffers, with nothing copied, for timing."""
        return self._graphs[self.key(shape, dtype)][0]

    @staticmethod
    def key(shape: tuple[int, ...], dtype: torch.dtype) -> tuple:
        """What a graph is kept under: input shape, dtype, torch.get_float32_matmul_precision() and this thread's
        launch options (kernels.launch_options), all of which the captured launches depend on."""
        return tuple(shape), dtype, torch.get_float32_matmul_precision(), current_launch_options()

    def _capture(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        # Random inputs for the warm-up calls, which tune the kernels; integer (uint8 pixel) inputs take 0-255.
        static_in = (torch.randn(shape, device=device).to(dtype) if dtype.is_floating_point
                     else torch.randint(0, 256, shape, device=device, dtype=dtype))
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.inference_mode(), torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.forward(static_in)
        torch.cuda.current_stream(device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # Thread-local capture on a stream of this thread's own: other threads of a serving loop (a
        # DataLoader's pin-memory thread, a copy on a side stream) may use CUDA meanwhile; in the default
        # global mode their calls would break the capture, and on one of PyTorch's pooled streams
        # (torch.cuda.graph's default) their work could land in it.
        with torch.inference_mode(), torch.cuda.graph(graph, pool=self._pool, stream=capture_stream(device),
                                                      capture_error_mode="thread_local"):
            static_out = self.forward(static_in)
        self._graphs[self.key(shape, dtype)] = (graph, static_in, static_out)

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """forward(pixels) from a graph replay: fresh tensors, not the graph's buffers."""
        if pixels.shape[0] == 0:   # no image, no kernel: nothing to capture
            return self.forward(pixels)
        key = self.key(pixels.shape, pixels.dtype)
        with self._lock:
            if key not in self._graphs:   # the warm-up calls validate the input like the model does
                self._capture(tuple(pixels.shape), pixels.dtype, pixels.device)
            graph, static_in, static_out = self._graphs[key]
            refresh_copies()
            for vit in self._vits:
                vit.refresh_pos_embed()
            static_in.copy_(pixels)
            graph.replay()
            if isinstance(static_out, torch.Tensor):
                return static_out.clone()
            return tuple(t.clone() for t in static_out)


def compile(model: ViT, batch_sizes: Iterable[int] = (), dtype: torch.dtype | None = None) -> CUDAGraphRunner:
    """A CUDAGraphRunner for a vit-triton model, with graphs captured ahead for each batch size
    (pixels in `dtype`, the model's by default); other shapes are captured on first use."""
    runner = CUDAGraphRunner(model)
    cfg = model.config
    for batch in batch_sizes:
        runner.capture((batch, cfg.in_chans, cfg.image_size, cfg.image_size), dtype or model.patch_embed.weight.dtype)
    return runner
