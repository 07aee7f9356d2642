"""`vit-triton bench --kernels`: every kernel of one forward pass on a roofline, beside PyTorch.

For each kernel at the shapes the model uses: the time of ours and of the PyTorch operators computing
the same result, from CUDA-graph replays (graph_time: the GPU's time alone, as in a graphed forward;
timed call by call from the host, our kernels at 32 ViT-B images measured their Python launch instead,
qkv 158 us against 46 replayed), achieved TFLOP/s and GB/s from the counted FLOPs and fewest bytes
(costs.py), arithmetic intensity, whether the measured ridge point (matmul rate / copy
bandwidth) makes it memory- or compute-bound, and the fraction of the roofline reached. Then one
forward pass under the profiler: the share of GPU time per kernel, and the time the GPU sits idle
between launches (a forward whose idle share is large is launch-overhead-bound).

With the GPU's Board (power.py, `--energy`), each kernel also runs back to back for a second, replayed
from a CUDA graph of about 20 ms of calls as in a graphed forward: millijoules a call, mean board power
and SM clock, ours and PyTorch's. Its floor is the least energy the same run's ceilings allow at their
own power: the FLOPs at the n^3 product's joules a FLOP, or the bytes at the copy's joules a byte,
whichever is more. Summed over a forward (count x mJ / batch) this splits a power-limited forward's
joules per image by kernel.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from ..model.config import ViTConfig
from ..kernels.tuning import graph_time, repeated
from .harness import Timer, ceiling_runs, do_bench_median, environment, measure_ceilings
from .power import Board
from .workloads import forward_workloads


def energy_ceilings(dtype: torch.dtype, device: torch.device, board: Board, n: int = 8192,
                    copy_bytes: int = 2 ** 30) -> dict:
    """Picojoules a FLOP of the n^3 product and a byte of the copy (measure_ceilings' workloads), each run
    back to back for a second, and the board's mean power during each."""
    (matmul, flops), (copy, moved) = ceiling_runs(dtype, device, n, copy_bytes)
    spent_mm, spent_copy = board.sustained(matmul), board.sustained(copy)
    return dict(pj_per_flop=1e12 * spent_mm["joules"] / flops, pj_per_byte=1e12 * spent_copy["joules"] / moved,
                matmul_watts=spent_mm["watts"], copy_watts=spent_copy["watts"])


def _energy(fn: Callable[[], object], device: torch.device, board: Board) -> dict:
    """mJ a call of fn, mean W and median SM MHz over a sustained run (graph replays on a GPU)."""
    run, calls = repeated(fn) if device.type == "cuda" else (fn, 1)
    spent = board.sustained(run)
    return dict(mj=1e3 * spent["joules"] / calls, watts=spent["watts"], sm_mhz=spent["sm_mhz"])


def kernel_rows(cfg: ViTConfig, batch: int, dtype: torch.dtype, device: torch.device, ceilings: dict,
                timer: Timer = graph_time, board: Board | None = None, energy: dict | None = None) -> list[dict]:
    """One row per kernel of forward_workloads: times, rates, intensity, bound, roofline fraction; with a
    board (and energy_ceilings' `energy`), mJ a call, W and SM MHz, ours and PyTorch's, and the floor."""
    peak, bw = ceilings["matmul_tflops"] * 1e12, ceilings["copy_gbps"] * 1e9
    rows = []
    for w in forward_workloads(cfg, batch, dtype, device):
        c = w.cost
        with torch.inference_mode():
            ours_ms = timer(lambda: w.ours(*w.inputs))
            torch_ms = timer(lambda: w.torch(*w.inputs))
        intensity = c.flops / c.bytes
        roof = min(peak, intensity * bw)
        row = dict(
            name=c.name, shape=c.shape, count=c.count, flops=c.flops, bytes=c.bytes, intensity=intensity,
            bound="compute" if intensity * bw > peak else "memory",
            ours_ms=ours_ms, torch_ms=torch_ms,
            ours_tflops=c.flops / ours_ms / 1e9, torch_tflops=c.flops / torch_ms / 1e9,
            ours_gbps=c.bytes / ours_ms / 1e6, torch_gbps=c.bytes / torch_ms / 1e6,
            ours_roofline=c.flops / (ours_ms * 1e-3) / roof, torch_roofline=c.flops / (torch_ms * 1e-3) / roof,
        )
        if board is not None:
            with torch.inference_mode():
                for who, fn in (("ours", w.ours), ("torch", w.torch)):
                    spent = _energy(lambda: fn(*w.inputs), device, board)
                    row.update({f"{who}_{k}": v for k, v in spent.items()})
            row["floor_mj"] = 1e-9 * max(c.flops * energy["pj_per_flop"], c.bytes * energy["pj_per_byte"])
        rows.append(row)
        if device.type == "cuda":
            torch.cuda.empty_cache()
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
                 model: torch.nn.Module, out_dir: Path | None = None, timer: Timer = graph_time,
                 log: Callable[[str], None] = print, board: Board | None = None,
                 ceiling_timer: Timer = do_bench_median) -> dict:
    """Kernel rows (kernels timed by `timer`; with a board, their energy too), forward breakdown (GPU only),
    roofline.json and roofline.png under out_dir. The ceilings are timed as `vit-triton bench` times them."""
    on_gpu = device.type == "cuda"
    result = dict(model=model_name, batch=batch, dtype=str(dtype).removeprefix("torch."),
                  environment=environment(device))
    # Full-size ceilings on a GPU; token sizes on the CPU, where only the code paths are tested.
    sizes = (8192, 2 ** 30) if on_gpu else (64, 2 ** 20)
    result["ceilings"] = measure_ceilings(dtype, device, ceiling_timer, *sizes)
    if board is not None:
        result["power_limit_w"] = board.power_limit_w
        result["energy"] = energy_ceilings(dtype, device, board, *sizes)
    result["kernels"] = kernel_rows(cfg, batch, dtype, device, result["ceilings"], timer, board, result.get("energy"))
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


def forward_energy(result: dict) -> dict:
    """mJ per image over one forward's kernels, each at its sustained rate: ours, PyTorch's and the floor."""
    return {who: sum(r["count"] * r[f"{who}_mj"] for r in result["kernels"]) / result["batch"]
            for who in ("ours", "torch", "floor")}


def format_roofline(result: dict) -> str:
    energy = "energy" in result
    head = ("kernel", "shape", "x", "ours ms", "TFLOP/s", "GB/s", "AI", "bound", "roofline", "torch ms", "torch roof")
    head += ("ours mJ", "W", "SM MHz", "torch mJ", "floor mJ") if energy else ()
    rows = [head]
    for r in result["kernels"]:
        row = (r["name"], r["shape"], str(r["count"]), f"{r['ours_ms']:.4f}", f"{r['ours_tflops']:.1f}",
               f"{r['ours_gbps']:.0f}", f"{r['intensity']:.1f}", r["bound"], f"{r['ours_roofline']:.0%}",
               f"{r['torch_ms']:.4f}", f"{r['torch_roofline']:.0%}")
        if energy:
            row += (f"{r['ours_mj']:.2f}", f"{r['ours_watts']:.0f}", f"{r['ours_sm_mhz']:.0f}", f"{r['torch_mj']:.2f}",
                    f"{r['floor_mj']:.2f}")
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if energy:
        e, per_image = result["energy"], forward_energy(result)
        lines.append(f"energy of one forward's kernels, each run alone for a second: ours {per_image['ours']:.2f} mJ per "
                     f"image, PyTorch's {per_image['torch']:.2f}, floor {per_image['floor']:.2f} (the n^3 product "
                     f"{e['pj_per_flop']:.2f} pJ/FLOP at {e['matmul_watts']:.0f} W, the copy {e['pj_per_byte']:.1f} "
                     f"pJ/byte at {e['copy_watts']:.0f} W; power limit {result['power_limit_w']:.0f} W)")
    fwd = result.get("forward")
    if fwd:
        lines.append(f"one forward: {fwd['span_us'] / 1e3:.3f} ms from first to last kernel, {fwd['launches']} "
                     f"launches, GPU idle {fwd['idle_us'] / fwd['span_us']:.0%} of it")
        lines += [f"  {share:6.1%}  {name[:90]}" for name, share in list(fwd["share"].items())[:10]]
    return "\n".join(lines)
