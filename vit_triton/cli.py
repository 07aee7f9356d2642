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
    return parser


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
        dtypes.append(getattr(torch, _DTYPES[d]))
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
    return {"verify": _verify}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
