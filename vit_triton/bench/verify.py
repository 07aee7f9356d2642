"""`vit-triton verify`: this machine's kernels against PyTorch, at the shapes of one model.

For each dtype, every kernel is run at the shapes one forward pass uses, then the whole model,
and compared with the same computation in PyTorch: in float64 (the reference) and in the dtype
itself (PyTorch's own error, which sets the 16-bit tolerance). Random weights and inputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ..model import ViT, ViTConfig
from ..model.reference import reference_forward
from .numerics import randomize_, rel_err, tolerance
from .workloads import forward_workloads


@dataclass
class Check:
    name: str
    dtype: torch.dtype
    shape: str
    err: float
    torch_err: float
    tol: float

    @property
    def ok(self) -> bool:
        return self.err <= self.tol


def _compare(name: str, shape: str, ours: Callable, reference: Callable, *inputs: torch.Tensor | None) -> Check:
    """Run ours and reference on `inputs` and reference again on their float64 copies."""
    dtype = next(t.dtype for t in inputs if t is not None)
    out = ours(*inputs)
    ref = reference(*(None if t is None else t.double() for t in inputs))
    torch_err = rel_err(reference(*inputs), ref)
    return Check(name, dtype, shape, rel_err(out, ref), torch_err, tolerance(dtype, torch_err))


def kernel_checks(cfg: ViTConfig, batch: int, dtype: torch.dtype, device: torch.device) -> list[Check]:
    """Each kernel at the shapes of one forward pass of `cfg` at `batch` images."""
    return [_compare(w.cost.name, w.cost.shape, w.ours, w.torch, *w.inputs)
            for w in forward_workloads(cfg, batch, dtype, device)]


def random_model(cfg: ViTConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> ViT:
    """A ViT with random weights, LayerNorms and biases included (none left at 1 or 0)."""
    torch.manual_seed(seed)
    return randomize_(ViT(cfg, device=device, dtype=torch.float32)).to(dtype).eval()


def time_forward(model: ViT, pixels: torch.Tensor) -> float:
    """Milliseconds per forward: median of CUDA-event timings on a GPU, one run in the interpreter."""
    if pixels.is_cuda:
        import triton.testing

        return triton.testing.do_bench(lambda: model(pixels), warmup=100, rep=500, return_mode="median")
    start = time.perf_counter()
    model(pixels)
    return (time.perf_counter() - start) * 1e3


def model_check(cfg: ViTConfig, batch: int, dtype: torch.dtype, device: torch.device) -> tuple[Check, float]:
    """The whole forward (logits or pooled embedding) against the PyTorch reference; and its time."""
    model = random_model(cfg, dtype, device)
    pixels = torch.randn(batch, cfg.in_chans, cfg.image_size, cfg.image_size, device=device).to(dtype)
    params = dict(model.state_dict())
    check = _compare("model forward", f"{batch}x{cfg.num_tokens}x{cfg.embed_dim}, depth {cfg.depth}",
                     lambda px: model(px), lambda px: reference_forward(cfg, _cast(params, px.dtype), px), pixels)
    return check, time_forward(model, pixels)


def _cast(params: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) for k, v in params.items()}


def verify(cfg: ViTConfig, batch: int, dtypes: Sequence[torch.dtype], device: torch.device,
           log: Callable[[str], None] = print) -> tuple[list[Check], dict[torch.dtype, float]]:
    """All checks for each dtype, and the model's time per batch for each dtype."""
    checks, times = [], {}
    for dtype in dtypes:
        log(f"checking {str(dtype).removeprefix('torch.')} ...")
        checks += kernel_checks(cfg, batch, dtype, device)
        check, ms = model_check(cfg, batch, dtype, device)
        checks.append(check)
        times[dtype] = ms
    return checks, times


def format_table(checks: Sequence[Check], times: dict[torch.dtype, float], batch: int = 0, timer: str = "") -> str:
    """Relative errors per kernel and dtype, then the time per batch."""
    rows = [("check", "dtype", "shape", "rel err", "torch rel err", "tolerance", "")]
    for c in checks:
        rows.append((c.name, str(c.dtype).removeprefix("torch."), c.shape, f"{c.err:.2e}", f"{c.torch_err:.2e}",
                     f"{c.tol:.2e}", "ok" if c.ok else "FAIL"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if times:
        lines += ["", f"time per batch of {batch} ({timer}):"]
    for dtype, ms in times.items():
        lines.append(f"  {str(dtype).removeprefix('torch.'):9s} {ms:10.3f} ms  {batch / ms * 1e3:10.1f} images/s")
    return "\n".join(lines)
