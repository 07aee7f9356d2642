"""Hardware counters (Nsight Compute) of each kernel of one transformer block, ours beside PyTorch's.

For each batch size, every kernel of a block (LayerNorm, the QKV GEMM, attention, proj + residual,
fc1 + activation and, to isolate its epilogue, fc1 without it, fc2 + residual; shapes and fresh random
inputs from forward_workloads) is launched once as vit-triton runs it and once as PyTorch does
(cuBLAS and its elementwise kernels, SDPA, F.layer_norm), each in an NVTX range named
b<batch>_<kernel>_<ours|torch>, after a warm-up that compiles and tunes outside the profiled region.

The script starts itself under ncu with --clock-control none, so each kernel runs at the clock the GPU
gives it (a large GEMM's power-limited clock shows), and reads the report back: per kernel its range,
name and the metrics in METRICS, printed and written to --json. ncu flushes the caches before each
kernel, so launches whose inputs sit in L2 during a forward (small batches) read them from HBM here and
look slower than in the forward: time forwards with `vit-triton bench`, this says why a kernel takes
what it takes.

    python scripts/ncu_block.py [--model vit_base_patch16_224] [--batch-sizes 256,32,1] [--dtype bf16]
        [--json out.json] [--ncu ncu]
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from vit_triton.bench.workloads import forward_workloads
from vit_triton.cli import torch_dtype
from vit_triton.kernels import linear
from vit_triton.model import PRESETS
from vit_triton.utils import batch_sizes, write_atomic

SECTIONS = ("SpeedOfLight", "ComputeWorkloadAnalysis", "WarpStateStats", "Occupancy", "LaunchStats",
            "SchedulerStats", "InstructionStats", "MemoryWorkloadAnalysis")
METRICS = ("Duration", "SM Frequency", "Compute (SM) Throughput", "Memory Throughput", "DRAM Throughput",
           "L2 Cache Throughput", "L2 Hit Rate", "Issue Slots Busy", "Executed Instructions", "Registers Per Thread",
           "Achieved Occupancy", "Warp Cycles Per Issued Instruction")
RANGE = re.compile(r'"<default domain>:([^:"]+)')   # the innermost push/pop range in ncu's NVTX column
# ncu scales units to the value; each metric is kept in one unit: unit -> (kept unit, factor)
UNITS = {"ns": ("us", 1e-3), "us": ("us", 1.0), "ms": ("us", 1e3), "s": ("us", 1e6), "Mhz": ("GHz", 1e-3),
         "Ghz": ("GHz", 1.0), "Mbyte/s": ("GB/s", 1e-3), "Gbyte/s": ("GB/s", 1.0), "Tbyte/s": ("GB/s", 1e3)}


def launch(model: str, batches: list[int], dtype: torch.dtype) -> None:
    """Warm up every job, then run each once inside the profiler's start/stop, in its NVTX range."""
    cfg = PRESETS[model]
    block = {"layer_norm", "linear qkv", "fused_attention", "linear proj +res", f"linear fc1 +{cfg.act}",
             "linear fc2 +res"}
    jobs = []
    for b in batches:
        for w in forward_workloads(cfg, b, dtype, torch.device("cuda")):
            if w.cost.name in block:
                name = w.cost.name.replace(" ", "_")
                jobs += [(f"b{b}_{name}_ours", w.ours, w.inputs), (f"b{b}_{name}_torch", w.torch, w.inputs)]
                if w.cost.name.startswith("linear fc1"):
                    jobs.append((f"b{b}_linear_fc1_no_activation_ours", lambda x, wt, bias, _: linear(x, wt, bias),
                                 w.inputs))
    with torch.inference_mode():
        for _, fn, inputs in jobs:
            fn(*inputs)
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for name, fn, inputs in jobs:
            torch.cuda.nvtx.range_push(name)
            fn(*inputs)
            torch.cuda.nvtx.range_pop()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()


def parse_details(text: str) -> list[dict]:
    """ncu's `--page details --csv` output as one entry a kernel, in launch order: its NVTX range, kernel name,
    and each metric of METRICS as a number, keyed "<name> [<unit>]" (times in us, clocks in GHz, rates in GB/s)."""
    kernels: dict[str, dict] = {}
    for row in csv.DictReader(io.StringIO(text)):
        nvtx = next((v for k, v in row.items() if k and k.startswith("thread Domain:Push/Pop_Range")), "") or ""
        found = RANGE.search(nvtx)
        entry = kernels.setdefault(row["ID"], dict(range=found.group(1) if found else "", kernel=row["Kernel Name"],
                                                   metrics={}))
        name, (unit, factor) = row["Metric Name"], UNITS.get(row["Metric Unit"], (row["Metric Unit"], 1.0))
        key = f"{name} [{unit}]" if unit else name
        if name in METRICS and key not in entry["metrics"]:
            entry["metrics"][key] = float(row["Metric Value"].replace(",", "")) * factor
    return list(kernels.values())


def profile(args: argparse.Namespace) -> list[dict]:
    """Runs this script's launch step under ncu and returns the parsed report."""
    ncu = shutil.which(args.ncu)
    if ncu is None:
        sys.exit(f"ncu_block needs Nsight Compute: {args.ncu!r} is not on PATH (--ncu names it)")
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "block"
        sections = [arg for s in SECTIONS for arg in ("--section", s)]
        subprocess.run([ncu, "--clock-control", "none", "--profile-from-start", "off", "--nvtx", *sections,
                        "-o", str(report), "-f", sys.executable, __file__, "--launch", "--model", args.model,
                        "--batch-sizes", ",".join(map(str, args.batch_sizes)), "--dtype", args.dtype], check=True)
        details = subprocess.run([ncu, "--import", f"{report}.ncu-rep", "--csv", "--page", "details"],
                                 check=True, capture_output=True, text=True).stdout
    return parse_details(details)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_base_patch16_224", choices=sorted(PRESETS))
    parser.add_argument("--batch-sizes", type=batch_sizes, default=[256, 32, 1])
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--json", type=Path, help="write the kernels' metrics here")
    parser.add_argument("--ncu", default="ncu", help="the Nsight Compute command line")
    parser.add_argument("--launch", action="store_true", help=argparse.SUPPRESS)   # the step ncu runs
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, "ncu_block needs a CUDA device\n")
    if args.launch:
        launch(args.model, args.batch_sizes, torch_dtype(args.dtype))
        return
    kernels = profile(args)
    for k in kernels:
        us, ghz, inst = (k["metrics"].get(key, float("nan")) for key in
                         ("Duration [us]", "SM Frequency [GHz]", "Executed Instructions [inst]"))
        print(f"{k['range']:40s} {k['kernel'][:28]:28s} {us:9.2f} us {ghz:5.2f} GHz {inst:14,.0f} inst")
    if args.json:
        result = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, model=args.model, dtype=args.dtype,
                      kernels=kernels)
        write_atomic(args.json, lambda f: f.write(json.dumps(result, indent=1).encode()))


if __name__ == "__main__":
    main()
