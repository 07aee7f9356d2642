"""First-call time of vit-triton in a fresh process, with and without the on-disk caches (CUDA only).

The first forward at a new batch shape compiles each kernel variant and tunes the GEMMs; Triton keeps
the compiled kernels (and the other kernels' autotuning choices) under TRITON_CACHE_DIR, linear's
tuner its choices under VIT_TRITON_CACHE_DIR. This runs the same child process twice with both on
one empty directory: the first pays compilation and tuning, the second should find both on disk.
--new-size N: the second process, warmed up at the model's own size, then runs the first and second forward at
N x N pixels, whose tuned picks no cache holds yet (what an image size the model was not warmed up at costs: its
position or rotary tables, new attention lengths, new GEMM rows), then at the nearest N x W pixels whose sizes
share N x N's tuning keys (size_bucket: patches, tokens, rows), which should tune nothing.

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
from pathlib import Path

CHILD = """
import json, sys, time, torch
sys.path.insert(0, {scripts!r})
from cold_start import nearby_width
start = time.perf_counter()
from vit_triton import from_timm
from vit_triton.model import PRESETS, ViT
if {model!r} in PRESETS:
    model = ViT(PRESETS[{model!r}], device="cuda", dtype=torch.bfloat16).eval()
else:   # a timm architecture, random weights
    import timm
    model = from_timm(timm.create_model({model!r}, pretrained=False).to("cuda", torch.bfloat16).eval())
built = time.perf_counter()

def forward(height, width):
    x = torch.randn({batch}, 3, height, width, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    with torch.inference_mode():
        model(x)
    torch.cuda.synchronize()
    return time.perf_counter() - t0

size = model.config.image_size
result = dict(build_s=built - start, forward_s=[forward(size, size), forward(size, size)])
if {new_size}:
    result["new_size_s"] = [forward({new_size}, {new_size}), forward({new_size}, {new_size})]
    width = nearby_width(model.config, {batch}, {new_size})
    if width:
        result.update(near_width=width, near_size_s=[forward({new_size}, width), forward({new_size}, width)])
print(json.dumps(result))
"""


def tuned_sizes(config, batch: int, height: int, width: int) -> list[int]:
    """The sizes of a forward at height x width pixels that the tuning keys hold, in size_bucket: patches
    (patch_embed), tokens (attention), rows (the GEMMs)."""
    from vit_triton.kernels.tuning import size_bucket

    patches = (height // config.patch_size) * (width // config.patch_size)
    tokens = config.num_prefix_tokens + patches
    return [size_bucket(n) for n in (patches, tokens, batch * tokens)]


def nearby_width(config, batch: int, size: int, most_patches: int = 8) -> int | None:
    """The width nearest to size, whole patches away (at most most_patches), at which size-high images share
    size x size's tuning keys (tuned_sizes); None if none does."""
    keys = tuned_sizes(config, batch, size, size)
    widths = (size + sign * k * config.patch_size for k in range(1, most_patches + 1) for sign in (1, -1))
    return next((w for w in widths if w >= config.patch_size and tuned_sizes(config, batch, size, w) == keys), None)


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
        # The new sizes run in the second process only, so that no cache holds their picks yet.
        for run, new_size in (("cold (empty cache)", 0), ("warm (cache on disk)", args.new_size)):
            t0 = time.perf_counter()
            code = CHILD.format(scripts=str(Path(__file__).parent), model=args.model, batch=args.batch,
                                new_size=new_size)
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            result = json.loads(out.stdout.splitlines()[-1])
            first_s, second_s = result["forward_s"]
            rows.append(dict(run=run, process_s=time.perf_counter() - t0, build_s=result["build_s"],
                             first_forward_s=first_s, second_forward_s=second_s))
            line = (f"{run:22s} process {rows[-1]['process_s']:6.1f} s  first forward {first_s:6.2f} s  "
                    f"second {second_s * 1e3:7.2f} ms")
            for name, width in (("new_size", new_size), ("near_size", result.get("near_width"))):
                if f"{name}_s" in result:
                    pixels, (first, second) = f"{new_size}x{width}", result[f"{name}_s"]
                    rows[-1].update({name: pixels, f"{name}_first_s": first, f"{name}_second_s": second})
                    line += f"\n{'':22s} at {pixels} px: first {first:6.2f} s, second {second * 1e3:7.2f} ms"
            if new_size and "near_width" not in result:
                line += f"\n{'':22s} no width near {new_size} px shares its tuning keys"
            print(line, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(model=args.model, batch=args.batch, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
