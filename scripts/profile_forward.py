"""Where one forward pass spends its GPU time, as a CUDA graph replays it (CUDA only).

For each batch size: the model (random weights) captured by vit_triton.compile, one replay under
the profiler. Each kernel is named by its place in the forward (patch_embed, then per block
layer_norm, linear qkv, fused_attention, linear proj +res, layer_norm, linear fc1, linear fc2 +res,
then the final norm, pooling and head: the names of bench/costs.py) and its time summed per name.
The span from the first kernel's start to the last one's end, less the kernels' own time, is the
GPU's idle time inside the graph: the launch gaps that remain after capture.

Beside each name, the kernel and the PyTorch operators that compute the same result (cuBLAS plus
the epilogue, SDPA, F.layer_norm), each timed alone from CUDA-graph replays at the same shapes.

    python scripts/profile_forward.py [--model vit_base_patch16_224] [--batch-sizes 1,8,32,256] [--json out.json]
"""

from __future__ import annotations

import argparse
import importlib
import json

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

import vit_triton
from vit_triton.bench.costs import forward_costs
from vit_triton.bench.numerics import randomize_
from vit_triton.bench.workloads import forward_workloads
from vit_triton.cli import torch_dtype
from vit_triton.utils import batch_sizes
from vit_triton.model import PRESETS, ViT, ViTConfig

LINEAR = importlib.import_module("vit_triton.kernels.linear")   # the module; the package exports the function


def launch_order(cfg: ViTConfig, batch: int, linear_rows: list[int]) -> list[str]:
    """The cost names of the forward's kernels in the order they are launched. linear_rows: the rows of
    each linear launch in order (linear_launches): a product whose last wave would leave most SMs idle
    runs as two launches (kernels.linear.whole_wave_rows), each named after the product."""
    costs = {c.name: c for c in forward_costs(cfg, batch, 2)}
    names = ["patch_embed"] + (["layer_norm pre"] if cfg.pre_norm else [])
    block = ["layer_norm", "linear qkv", "fused_attention", "linear proj +res", "layer_norm",
             f"linear fc1 +{cfg.act}", "linear fc2 +res"]
    names += block * cfg.depth
    names += [n for n in ("layer_norm final", "token_mean", "layer_norm fc", "linear head") if n in costs]
    launches, rows = [], iter(linear_rows)
    for name in names:
        launches.append(name)
        left = costs[name].dims["m"] - next(rows) if costs[name].kind == "linear" else 0
        while left > 0:
            launches.append(name)
            left -= next(rows)
    return launches


def linear_launches(model: ViT, pixels: torch.Tensor) -> list[int]:
    """The rows of each linear kernel launch of one forward of the model, in order."""
    rows, launch = [], LINEAR.launch_linear

    def counted(config, x, *args):
        rows.append(x.shape[0])
        launch(config, x, *args)

    LINEAR.launch_linear = counted
    try:
        with torch.inference_mode():
            model(pixels)
    finally:
        LINEAR.launch_linear = launch
    return rows


def graph_timer(fn) -> float:
    """Milliseconds per call from CUDA-graph replays: GPU time without Python's launch overhead."""
    fn()
    return triton.testing.do_bench_cudagraph(fn, rep=50)


def profile_replay(runner, pixels: torch.Tensor) -> list[tuple[float, float]]:
    """(start, duration) in us of each vit-triton kernel of one graph replay, in launch order.
    Our kernels' names start with an underscore; the input copy into the graph's buffer and the
    output clone, which run outside the graph, do not."""
    runner(pixels)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner(pixels)
        torch.cuda.synchronize()
    return sorted((e.time_range.start, e.time_range.elapsed_us()) for e in prof.events()
                  if e.device_type == torch.autograd.DeviceType.CUDA and e.name.startswith("_"))


def breakdown(model: ViT, cfg: ViTConfig, batch: int, dtype: torch.dtype, with_alone: bool = True) -> dict:
    runner = vit_triton.compile(model, batch_sizes=[batch])
    pixels = torch.randn(batch, cfg.in_chans, cfg.image_size, cfg.image_size, device="cuda").to(dtype)
    names = launch_order(cfg, batch, linear_launches(model, pixels))
    kernels = profile_replay(runner, pixels)
    if len(kernels) != len(names):
        raise RuntimeError(f"expected {len(names)} kernels in the graph, the profiler saw {len(kernels)}")
    span = kernels[-1][0] + kernels[-1][1] - kernels[0][0]
    per_name: dict[str, float] = {}
    for name, (_, us) in zip(names, kernels):
        per_name[name] = per_name.get(name, 0.0) + us
    busy = sum(per_name.values())
    replay_ms = triton.testing.do_bench(lambda: runner(pixels), warmup=50, rep=300, return_mode="median")
    alone = {}
    for w in forward_workloads(cfg, batch, dtype, torch.device("cuda")) if with_alone else ():
        with torch.inference_mode():
            alone[w.cost.name] = dict(ours_us=1e3 * graph_timer(lambda: w.ours(*w.inputs)),
                                      torch_us=1e3 * graph_timer(lambda: w.torch(*w.inputs)), count=w.cost.count)
    return dict(batch=batch, replay_ms=replay_ms, span_us=span, busy_us=busy, idle_us=span - busy,
                launches=len(kernels), per_name_us=per_name, alone=alone)


def format_breakdown(r: dict) -> str:
    lines = [f"batch {r['batch']}: replay {r['replay_ms'] * 1e3:.0f} us; profiled span {r['span_us']:.0f} us = "
             f"kernels {r['busy_us']:.0f} + idle {r['idle_us']:.0f} over {r['launches']} launches",
             f"  {'kernel':22s} {'in graph us':>11s} {'share':>6s} {'count':>5s} {'each us':>8s} "
             f"{'alone us':>8s} {'torch us':>8s}"]
    for name, us in sorted(r["per_name_us"].items(), key=lambda kv: -kv[1]) if r["alone"] else ():
        a = r["alone"][name]
        lines.append(f"  {name:22s} {us:11.1f} {us / r['busy_us']:6.1%} {a['count']:5d} {us / a['count']:8.2f} "
                     f"{a['ours_us']:8.2f} {a['torch_us']:8.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_base_patch16_224", choices=sorted(PRESETS))
    parser.add_argument("--batch-sizes", type=batch_sizes, default=[1, 8, 32, 256])
    parser.add_argument("--dtype", default="bf16", choices=("bf16", "fp16"))
    parser.add_argument("--replay-only", action="store_true", help="skip timing each kernel alone")
    parser.add_argument("--json", help="write the breakdowns here")
    args = parser.parse_args()
    dtype = torch_dtype(args.dtype)
    cfg = PRESETS[args.model]
    model = randomize_(ViT(cfg, device="cuda")).to(dtype).eval()
    results = []
    for batch in args.batch_sizes:
        results.append(breakdown(model, cfg, batch, dtype, not args.replay_only))
        print(format_breakdown(results[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           model=args.model, dtype=args.dtype, results=results), f, indent=1)


if __name__ == "__main__":
    main()
