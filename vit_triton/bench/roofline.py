"""`vit-triton bench --kernels`: every kernel of one forward pass on a roofline, beside PyTorch.

For each kernel at the shapes the model uses: median time of ours and of the PyTorch operators
computing the same result, achieved TFLOP/s and GB/s from the counted FLOPs and fewest bytes
(costs.py), arithmetic intensity, whether the measured ridge point (matmul rate / copy
bandwidth) makes it memory- or compute-bound, and the fraction of the roofline reached. Then one
forward pass under the profiler: the share of GPU time per kernel, and the time the GPU sits idle
between launches (a forward whose idle share is large is launch-overhead-bound).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from ..model.config import ViTConfig
from .harness import Timer, do_bench_median, environment, measure_ceilings
from .workloads import forward_workloads


def kernel_rows(cfg: ViTConfig, batch: int, dtype: torch.dtype, device: torch.device, ceilings: dict,
                timer: Timer = do_bench_median) -> list[dict]:
    """One row per kernel of forward_workloads: times, rates, intensity, bound, roofline fraction."""
    peak, bw = ceilings["matmul_tflops"] * 1e12, ceilings["copy_gbps"] * 1e9
    rows = []
    for w in forward_workloads(cfg, batch, dtype, device):
        c = w.cost
        with torch.inference_mode():
            ours_ms = timer(lambda: w.ours(*w.inputs))
            torch_ms = timer(lambda: w.torch(*w.inputs))
        intensity = c.flops / c.bytes
        roof = min(peak, intensity * bw)
        rows.append(dict(
            name=c.name, shape=c.shape, count=c.count, flops=c.flops, bytes=c.bytes, intensity=intensity,
            bound="compute" if intensity * bw > peak else "memory",
            ours_ms=ours_ms, torch_ms=torch_ms,
            ours_tflops=c.flops / ours_ms / 1e9, torch_tflops=c.flops / torch_ms / 1e9,
            ours_gbps=c.bytes / ours_ms / 1e6, torch_gbps=c.bytes / torch_ms / 1e6,
            ours_roofline=c.flops / (ours_ms * 1e-3) / roof, torch_roofline=c.flops / (torch_ms * 1e-3) / roof,
        ))
    return rows


def forward_breakdown(model: torch.nn.Module, pixels: torch.Tensor) -> dict:
    """GPU time per kernel name over one forward, and the idle time between the first and last kernel."""
    from torch.profiler import ProfilerActivity, profile

    with torch.inference_mode():
        model(pixels)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(pixels)
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    start = min(e.time_range.start for e in kernels)
    end = max(e.time_range.end for e in kernels)
    per_name: dict[str, float] = {}
    for e in kernels:
        per_name[e.name] = per_name.get(e.name, 0.0) + e.time_range.elapsed_us()
    busy = sum(per_name.values())
    span = end - start
    return dict(span_us=span, busy_us=busy, idle_us=max(span - busy, 0.0), launches=len(kernels),
                share={k: v / busy for k, v in sorted(per_name.items(), key=lambda kv: -kv[1])})


def run_roofline(model_name: str, cfg: ViTConfig, batch: int, dtype: torch.dtype, device: torch.device,
                 model: torch.nn.Module, out_dir: Path | None = None, timer: Timer = do_bench_median,
                 log: Callable[[str], None] = print) -> dict:
    """Kernel rows, forward breakdown (GPU only), roofline.json and roofline.png under out_dir."""
    on_gpu = device.type == "cuda"
    result = dict(model=model_name, batch=batch, dtype=str(dtype).removeprefix("torch."),
                  environment=environment(device))
    result["ceilings"] = measure_ceilings(dtype, device, timer, *((8192, 2 ** 30) if on_gpu else (64, 2 ** 20)))
    result["kernels"] = kernel_rows(cfg, batch, dtype, device, result["ceilings"], timer)
    if on_gpu:
        pixels = torch.randn(batch, cfg.in_chans, cfg.image_size, cfg.image_size, device=device).to(dtype)
        result["forward"] = forward_breakdown(model, pixels)
    log(format_roofline(result))
    if out_dir is not None:
        from .plots import plot_roofline

        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / "roofline.json.tmp"
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, out_dir / "roofline.json")
        plot_roofline(result, out_dir / "roofline.png")
    return result


def format_roofline(result: dict) -> str:
    head = ("kernel", "shape", "x", "ours ms", "TFLOP/s", "GB/s", "AI", "bound", "roofline", "torch ms", "torch roof")
    rows = [head]
    for r in result["kernels"]:
        rows.append((r["name"], r["shape"], str(r["count"]), f"{r['ours_ms']:.4f}", f"{r['ours_tflops']:.1f}",
                     f"{r['ours_gbps']:.0f}", f"{r['intensity']:.1f}", r["bound"], f"{r['ours_roofline']:.0%}",
                     f"{r['torch_ms']:.4f}", f"{r['torch_roofline']:.0%}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    fwd = result.get("forward")
    if fwd:
        lines.append(f"one forward: {fwd['span_us'] / 1e3:.3f} ms from first to last kernel, {fwd['launches']} "
                     f"launches, GPU idle {fwd['idle_us'] / fwd['span_us']:.0%} of it")
        lines += [f"  {share:6.1%}  {name[:90]}" for name, share in list(fwd["share"].items())[:10]]
    return "\n".join(lines)
