"""The `vit-triton` command line: thin, each command a few calls into the package."""

from __future__ import annotations

import argparse
import os
import sys

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vit-triton", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    verify = sub.add_parser(
        "verify",
        help="check this machine's kernels against PyTorch and time a forward pass",
        description="Run every kernel at the shapes of one forward pass, and the whole model, with random "
                    "weights; print relative errors against a float64 PyTorch reference per dtype, and the "
                    "time per batch. Without a CUDA device, runs through Triton's interpreter on the CPU "
                    "(the 'tiny' model by default). Exits 1 if any check is out of tolerance.",
    )
    verify.add_argument("--model", default=None,
                        help="model shape: tiny, vit_small_patch16_224, vit_base_patch16_224 (default on a GPU), "
                             "vit_large_patch16_224, vit_large_patch14_clip_336; tiny is the default without a GPU")
    verify.add_argument("--batch-size", type=int, default=None,
                        help="images per batch (default 8 on a GPU, 2 in the interpreter)")
    verify.add_argument("--dtypes", default="fp32,bf16,fp16", help="comma-separated subset of fp32,bf16,fp16")
    bench = sub.add_parser(
        "bench",
        help="time vit-triton against HF, timm and torch.compile; or every kernel on a roofline",
        description="In one process, on the same random inputs: vit-triton, HF transformers (sdpa), timm "
                    "(eager) and torch.compile(timm) in default, max-autotune-no-cudagraphs and reduce-overhead "
                    "modes. Checks vit-triton's output against HF's (or timm's) first and refuses to time a wrong "
                    "answer. Prints median ms, images/s, TFLOP/s, MFU against a matmul ceiling measured in the same "
                    "run, peak memory and the speed-up over the best peer; writes bench.json and throughput.png "
                    "(or roofline.json and roofline.png with --kernels) under --out. Without a CUDA device, runs "
                    "the correctness part only (tiny model, Triton interpreter).",
    )
    bench.add_argument("--model", default="vit_base_patch16_224",
                       help="model shape (timm name): vit_small_patch16_224, vit_base_patch16_224, "
                            "vit_large_patch16_224, vit_large_patch14_clip_336 (default: %(default)s)")
    bench.add_argument("--batch-sizes", default="1,8,32,128,256", help="comma-separated (default: %(default)s)")
    bench.add_argument("--dtype", default="bf16", choices=sorted(_DTYPES), help="(default: %(default)s)")
    bench.add_argument("--systems", default=None,
                       help="comma-separated subset of vit-triton,hf,timm,timm+compile:default,"
                            "timm+compile:max-autotune-no-cudagraphs,timm+compile:reduce-overhead (default: all)")
    bench.add_argument("--kernels", action="store_true",
                       help="time each kernel of one forward pass (at the largest batch size) against PyTorch "
                            "and place it on a roofline, with a per-kernel breakdown of one forward")
    bench.add_argument("--out", default="bench-results", help="output folder (default: %(default)s)")
    return parser


def _dtype(name: str):
    import torch

    return getattr(torch, _DTYPES[name])


def _bench(args: argparse.Namespace) -> int:
    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined (first vit_triton import below)
    from pathlib import Path

    from .model import PRESETS

    if args.model not in PRESETS:
        raise SystemExit(f"vit-triton bench: unknown model {args.model!r}; expected one of {', '.join(PRESETS)}")
    try:
        batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    except ValueError:
        raise SystemExit(f"vit-triton bench: --batch-sizes must be comma-separated integers, got {args.batch_sizes!r}")
    dtype = _dtype(args.dtype)
    if not on_gpu:
        return _bench_without_gpu(dtype)
    from .bench import harness, roofline, systems

    names = tuple(args.systems.split(",")) if args.systems else systems.SYSTEMS
    unknown = set(names) - set(systems.SYSTEMS)
    if unknown:
        raise SystemExit(f"vit-triton bench: unknown systems {sorted(unknown)}; expected a subset of "
                         f"{','.join(systems.SYSTEMS)}")
    cfg, device, out = PRESETS[args.model], torch.device("cuda"), Path(args.out) / args.model
    if args.kernels:
        _, _, ours = systems.build_systems(cfg, dtype, device, ("vit-triton",))
        roofline.run_roofline(args.model, cfg, batch_sizes[-1], dtype, device, ours, out)
    else:
        print(harness.format_table(harness.run_bench(args.model, cfg, batch_sizes, dtype, device, out, names)))
    print(f"results under {out}/")
    return 0


def _bench_without_gpu(dtype) -> int:
    import torch

    from .bench.harness import check_correctness
    from .bench.systems import build_systems
    from .bench.verify import format_table, kernel_checks
    from .model import PRESETS

    print("vit-triton bench: no CUDA device, so no timings; running the correctness part only "
          "(the tiny model through Triton's interpreter)", flush=True)
    cfg, device = PRESETS["tiny"], torch.device("cpu")
    _, reference, ours = build_systems(cfg, dtype, device, ("vit-triton",))
    check = check_correctness(reference, ours, cfg, dtype, device)
    checks = kernel_checks(cfg, 2, dtype, device)
    print(format_table(checks, {}))
    print(f"model output against {check['reference']} (float64): rel err {check['err']:.2e}, "
          f"tolerance {check['tol']:.2e}: {'ok' if check['ok'] else 'FAIL'}")
    return 0 if check["ok"] and all(c.ok for c in checks) else 1


def _verify(args: argparse.Namespace) -> int:
    import torch

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are defined (first vit_triton import below)
    from .bench.verify import format_table, verify
    from .model import PRESETS

    name = args.model or ("vit_base_patch16_224" if on_gpu else "tiny")
    if name not in PRESETS:
        raise SystemExit(f"vit-triton verify: unknown model {name!r}; expected one of {', '.join(PRESETS)}")
    dtypes = []
    for d in args.dtypes.split(","):
        if d not in _DTYPES:
            raise SystemExit(f"vit-triton verify: unknown dtype {d!r}; expected a subset of fp32,bf16,fp16")
        dtypes.append(_dtype(d))
    batch = args.batch_size or (8 if on_gpu else 2)
    device = torch.device("cuda" if on_gpu else "cpu")
    where = torch.cuda.get_device_name() if on_gpu else "CPU, Triton interpreter"
    print(f"vit-triton verify: {name}, batch {batch}, on {where}", flush=True)
    checks, times = verify(PRESETS[name], batch, dtypes, device, log=lambda s: print(s, flush=True))
    timer = "median of CUDA-event timings" if on_gpu else "one run through the interpreter, not a GPU speed"
    print(format_table(checks, times, batch, timer))
    failed = [c for c in checks if not c.ok]
    if failed:
        print(f"\n{len(failed)} check(s) out of tolerance", file=sys.stderr)
        return 1
    print(f"\nall {len(checks)} checks within tolerance")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return {"verify": _verify, "bench": _bench}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
