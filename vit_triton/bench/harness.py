"""`vit-triton bench`: vit-triton against HF, timm and torch.compile(timm), in one process.

Per batch size, every system runs on the same random pixels; each is warmed up (compiling and
autotuning outside the timings), then timed with triton.testing.do_bench (median of CUDA-event
timings). Before any timing, vit-triton's output is checked against the reference model's with
the tolerance rule of docs/design.md (float64 reference, 1.5x the reference's own error in 16-bit); a wrong answer
ends the run. The matmul ceiling (an 8192^3 product through torch.matmul in the same dtype) and the
copy bandwidth are measured in the same process, and MFU is against that ceiling. Given the GPU's Board
(power.py), each system then also runs back to back for a second while NVML reads the board's energy:
joules per image, mean power and SM clock beside the times.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import platform
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..model.config import ViTConfig
from .costs import model_flops
from .numerics import rel_err, tolerance
from .power import Board
from .profile import kernel_profile
from .systems import SYSTEMS, build_systems, reference_output

Timer = Callable[[Callable[[], object]], float]


def do_bench_median(fn: Callable[[], object]) -> float:
    """Milliseconds per call: the median of CUDA-event timings after warm-up."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=100, rep=400, return_mode="median")


def ceiling_runs(dtype: torch.dtype, device: torch.device, n: int = 8192,
                 copy_bytes: int = 2 ** 30) -> tuple[tuple[Callable[[], object], int], tuple[Callable[[], object], int]]:
    """The two ceilings' workloads: (an n^3 product in `dtype`, its FLOPs), (a copy, the bytes it reads and writes)."""
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    src = torch.empty(copy_bytes // 4, device=device).normal_()
    dst = torch.empty_like(src)
    return (lambda: torch.matmul(a, b), 2 * n ** 3), (lambda: dst.copy_(src), 2 * copy_bytes)


def measure_ceilings(dtype: torch.dtype, device: torch.device, timer: Timer = do_bench_median,
                     n: int = 8192, copy_bytes: int = 2 ** 30) -> dict:
    """The matmul rate (TFLOP/s, n^3 in `dtype`) and copy bandwidth (GB/s, bytes read + written)."""
    (matmul, flops), (copy, moved) = ceiling_runs(dtype, device, n, copy_bytes)
    return dict(matmul_tflops=flops / timer(matmul) / 1e9, copy_gbps=moved / timer(copy) / 1e6)


def environment(device: torch.device) -> dict:
    """GPU, driver and library versions recorded with every result."""
    import triton

    env = dict(torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
               date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
        except (OSError, IndexError, subprocess.SubprocessError):
            env["driver"] = "unknown"
    else:
        env["gpu"] = "none (CPU, Triton interpreter)"
    return env


def check_correctness(reference: torch.nn.Module, ours: torch.nn.Module, cfg: ViTConfig, dtype: torch.dtype,
                      device: torch.device, batch: int = 4) -> dict:
    """vit-triton's output against the reference model's, both against the reference in float64."""
    pixels = torch.randn(batch, cfg.in_chans, cfg.image_size, cfg.image_size, device=device)
    with torch.inference_mode():
        want = reference_output(copy.deepcopy(reference).double(), pixels.double())
        theirs = reference_output(reference, pixels.to(dtype))
        got = ours(pixels.to(dtype))
    err, ref_err = rel_err(got, want), rel_err(theirs, want)
    tol = tolerance(dtype, ref_err)
    return dict(batch=batch, err=err, reference_err=ref_err, tol=tol, ok=err <= tol,
                reference=type(reference).__name__)


def _time_system(run, pixels: torch.Tensor, timer: Timer, board: Board | None = None) -> dict:
    with torch.inference_mode():
        run(pixels)                       # compile / autotune / capture, outside the timings
        torch.cuda.synchronize() if pixels.is_cuda else None
        if pixels.is_cuda:
            torch.cuda.reset_peak_memory_stats()
        ms = timer(lambda: run(pixels))
        peak = torch.cuda.max_memory_allocated() / 2 ** 30 if pixels.is_cuda else None
        row = dict(ms=ms, peak_mem_gib=peak)
        if board is not None:
            spent = board.sustained(lambda: run(pixels))
            row.update(sustained_ms=spent["ms"], joules_per_image=spent["joules"] / len(pixels), watts=spent["watts"],
                       sm_mhz=spent["sm_mhz"])
    return row


def run_bench(model_name: str, cfg: ViTConfig, batch_sizes: Sequence[int], dtype: torch.dtype,
              device: torch.device, out_dir: Path | None = None, systems: Sequence[str] = SYSTEMS,
              timer: Timer = do_bench_median, log: Callable[[str], None] = print, board: Board | None = None,
              timm_module: torch.nn.Module | None = None, profile: bool = False) -> dict:
    """Time every system at every batch size (and with a board, read its energy over a sustained run of each;
    with profile, at the largest batch size each system's kernels by class: kernel_profile); write bench.json
    (after each batch size) and a plot."""
    result = dict(model=model_name, config=cfg.to_dict(), dtype=str(dtype).removeprefix("torch."),
                  float32_matmul_precision=torch.get_float32_matmul_precision(),
                  flops_per_image=model_flops(cfg), environment=environment(device), rows=[], skipped={})
    # Full-size ceilings on a GPU; token sizes on the CPU, where only the harness itself is tested.
    on_gpu = device.type == "cuda"
    result["ceilings"] = measure_ceilings(dtype, device, timer, *((8192, 2 ** 30) if on_gpu else (64, 2 ** 20)))
    if board is not None:
        result["power_limit_w"] = board.power_limit_w
    log(f"ceilings: {result['ceilings']['matmul_tflops']:.0f} TFLOP/s matmul, "
        f"{result['ceilings']['copy_gbps']:.0f} GB/s copy")
    built, reference, ours = build_systems(cfg, dtype, device, tuple(systems), timm_module)
    result["skipped"] = {s.name: s.note for s in built if s.run is None}
    # At the smallest batch timed: where the model takes its small-batch paths (split-K GEMMs).
    result["check"] = check_correctness(reference, ours, cfg, dtype, device, batch=min(batch_sizes))
    if not result["check"]["ok"]:
        write_result(result, out_dir)
        raise RuntimeError(f"vit-triton's output is wrong, no speed reported: {result['check']}")
    log(f"correctness: rel err {result['check']['err']:.2e} (tolerance {result['check']['tol']:.2e}) "
        f"against {result['check']['reference']} in float64")
    for batch in batch_sizes:
        pixels = torch.randn(batch, cfg.in_chans, cfg.image_size, cfg.image_size, device=device).to(dtype)
        for system in (s for s in built if s.run is not None):
            row = dict(system=system.name, batch=batch)
            try:
                row.update(_time_system(system.run, pixels, timer, board))
            except Exception as e:  # a peer that fails (e.g. out of memory) is recorded, not fatal
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                log(f"  {system.name} at batch {batch}: {row['error']}")
            else:
                flops = result["flops_per_image"] * batch
                row.update(images_per_s=batch / row["ms"] * 1e3, tflops=flops / row["ms"] / 1e9)
                row["mfu"] = row["tflops"] / result["ceilings"]["matmul_tflops"]
                if profile and batch == max(batch_sizes):
                    with torch.inference_mode():
                        row["kernels"] = kernel_profile(lambda: system.run(pixels))
                log(f"  batch {batch:4d}  {system.name:38s} {row['ms']:9.3f} ms  {row['images_per_s']:9.0f} img/s"
                    f"  {row['tflops']:6.1f} TFLOP/s" + (f"  {1000 * row['joules_per_image']:8.2f} mJ/img  "
                                                        f"{row['watts']:4.0f} W" if board else ""))
            result["rows"].append(row)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        write_result(result, out_dir)
    result["speedup"] = speedups(result["rows"])
    write_result(result, out_dir)
    if out_dir is not None:
        from .plots import plot_throughput

        plot_throughput(result, out_dir / "throughput.png")
    return result


def speedups(rows: Sequence[dict]) -> dict[str, dict]:
    """Per batch size: the best peer's time over vit-triton's fastest (eager or graphed), naming both; with
    energy readings, also the same peer's joules per image over ours (energy_ratio)."""
    out = {}
    for batch in sorted({r["batch"] for r in rows}):
        timed = [r for r in rows if r["batch"] == batch and "ms" in r]
        ours = [r for r in timed if r["system"].startswith("vit-triton")]
        peers = [r for r in timed if not r["system"].startswith("vit-triton")]
        if ours and peers:
            best, fastest = min(peers, key=lambda r: r["ms"]), min(ours, key=lambda r: r["ms"])
            out[str(batch)] = dict(best_peer=best["system"], ours=fastest["system"], speedup=best["ms"] / fastest["ms"])
            if "joules_per_image" in best and "joules_per_image" in fastest:
                out[str(batch)]["energy_ratio"] = best["joules_per_image"] / fastest["joules_per_image"]
    return out


def write_result(result: dict, out_dir: Path | None) -> None:
    """bench.json, replaced atomically so that a killed run leaves the last complete state."""
    if out_dir is None:
        return
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / "bench.json.tmp"
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, out_dir / "bench.json")


def format_table(result: dict) -> str:
    """Median ms, images/s, TFLOP/s, MFU and peak memory per system and batch (with energy readings: mJ per
    image, mean W and SM MHz over the sustained run); speed-up per batch."""
    energy = "power_limit_w" in result
    head = ("batch", "system", "ms", "images/s", "TFLOP/s", "MFU", "peak GiB")
    head += ("mJ/image", "W", "SM MHz") if energy else ()
    rows = [head]
    for r in result["rows"]:
        if "ms" in r:
            peak = "" if r["peak_mem_gib"] is None else f"{r['peak_mem_gib']:.2f}"
            row = (str(r["batch"]), r["system"], f"{r['ms']:.3f}", f"{r['images_per_s']:.0f}", f"{r['tflops']:.1f}",
                   f"{r['mfu']:.1%}", peak)
            row += (f"{1000 * r['joules_per_image']:.2f}", f"{r['watts']:.0f}", f"{r['sm_mhz']:.0f}") if energy else ()
            rows.append(row)
        else:
            rows.append((str(r["batch"]), r["system"], "error", r["error"][:60]) + ("",) * (len(head) - 4))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for name, note in result["skipped"].items():
        lines.append(f"skipped {name}: {note}")
    for batch, s in result.get("speedup", {}).items():
        line = f"batch {batch}: {s['ours']} is {s['speedup']:.2f}x the best peer ({s['best_peer']})"
        if "energy_ratio" in s:
            line += f", which spends {s['energy_ratio']:.2f}x its energy per image"
        lines.append(line)
    env, ceil = result["environment"], result["ceilings"]
    lines.append(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}; ceilings "
                 f"{ceil['matmul_tflops']:.0f} TFLOP/s ({result['dtype']} matmul), {ceil['copy_gbps']:.0f} GB/s copy"
                 + (f"; power limit {result['power_limit_w']:.0f} W" if energy else ""))
    return "\n".join(lines)
