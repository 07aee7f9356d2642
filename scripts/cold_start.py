"""First-call time of vit-triton in a fresh process, with and without the on-disk caches (CUDA only).

The first forward at a new batch shape compiles each kernel variant and tunes the GEMMs; Triton keeps
the compiled kernels (and the other kernels' autotuning choices) under TRITON_CACHE_DIR, linear's
tuner its choices under VIT_TRITON_CACHE_DIR. This runs the same child process twice with both on
one empty directory: the first pays compilation and tuning, the second should find both on disk.
--new-size N: after that, the first and second forward at N x N pixels in the same process (what an image
size the model was not warmed up at costs: its position or rotary tables, new attention lengths, new GEMM rows).

    python scripts/cold_start.py [--model vit_base_patch16_224|<timm architecture>] [--batch 32] [--new-size N]
                                 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = """
import time, torch
start = time.perf_counter()
from vit_triton import from_timm
from vit_triton.model import PRESETS, ViT
if {model!r} in PRESETS:
    model = ViT(PRESETS[{model!r}], device="cuda", dtype=torch.bfloat16).eval()
else:   # a timm architecture, random weights
    import timm
    model = from_timm(timm.create_model({model!r}, pretrained=False).to("cuda", torch.bfloat16).eval())
built = time.perf_counter()

def forward(size):
    x = torch.randn({batch}, 3, size, size, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model(x)
    torch.cuda.synchronize()
    return time.perf_counter() - t0

times = [forward(model.config.image_size), forward(model.config.image_size)]
if {new_size}:
    times += [forward({new_size}), forward({new_size})]
print(built - start, *times)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_base_patch16_224")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--new-size", type=int, default=0)
    parser.add_argument("--json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TRITON_CACHE_DIR": cache, "VIT_TRITON_CACHE_DIR": cache}
        for run in ("cold (empty cache)", "warm (cache on disk)"):
            t0 = time.perf_counter()
            code = CHILD.format(model=args.model, batch=args.batch, new_size=args.new_size)
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                 check=True).stdout.split()
            build_s, first_s, second_s, *new = map(float, out[-(5 if args.new_size else 3):])
            rows.append(dict(run=run, process_s=time.perf_counter() - t0, build_s=build_s,
                             first_forward_s=first_s, second_forward_s=second_s))
            line = (f"{run:22s} process {rows[-1]['process_s']:6.1f} s  first forward {first_s:6.2f} s  "
                    f"second {second_s * 1e3:7.2f} ms")
            if new:
                rows[-1].update(new_size=args.new_size, new_size_first_s=new[0], new_size_second_s=new[1])
                line += f"  at {args.new_size} px: first {new[0]:6.2f} s, second {new[1] * 1e3:7.2f} ms"
            print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, batch=args.batch, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
