"""Tune the kernels for the shapes users run on this GPU and file the picks into the package (CUDA only).

A first run on a new machine tunes every kernel launch it has not seen: each candidate config compiled and timed,
tens of seconds before the first image. The tuner takes a pick the package ships for the GPU instead
(vit_triton/kernels/tuned/<gpu>.json): this script makes those files. With an empty tuning cache of its own it
runs, in bf16 with random weights, each --models architecture's forward at each --batch-sizes (bench's sizes and
embed's batch, the short batches at a chunk's end falling into the same size buckets), and a training step at
--train-batch (forward, backward, AdamW), then merges every pick into the GPU's file, written atomically; picks
already there for other shapes are kept.

    python scripts/ship_tuned.py [--models vit_base_patch16_224,...] [--batch-sizes 1,8,32,64,128,256]
                                 [--train-batch 128] [--out vit_triton/kernels/tuned]

Needs a CUDA device and timm. Commit the file it writes; a kernel's candidate list that changes afterwards leaves
its old picks unused (they are filed under the list) until this runs again.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

# The families' sizes that bench and embed run (README's tables).
MODELS = ("vit_base_patch16_224", "vit_large_patch16_224", "vit_large_patch14_clip_336",
          "vit_large_patch14_reg4_dinov2", "vit_large_patch16_dinov3", "eva02_base_patch14_448",
          "vit_so400m_patch14_siglip_384", "beit_base_patch16_224")


def merge_into(path: Path, picks: dict) -> dict:
    """picks ({tuner: {candidates digest: {key: config}}}) over those already in the file at `path`, written
    whole to a temporary name and renamed into place. Returns what the file now holds."""
    from vit_triton.utils import write_atomic

    try:
        merged = json.loads(path.read_text())
    except (OSError, ValueError):
        merged = {}
    for tuner, by_digest in picks.items():
        for digest, keys in by_digest.items():
            merged.setdefault(tuner, {}).setdefault(digest, {}).update(keys)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, lambda f: f.write((json.dumps(merged, indent=0, sort_keys=True) + "\n").encode()))
    return merged


def tune(models: list[str], batch_sizes: list[int], train_batch: int) -> None:
    """Runs what tunes: each model's forward at each batch size, and a training step at train_batch (0: none)."""
    import timm
    import torch
    import torch.nn.functional as F

    from vit_triton import from_timm

    for name in models:
        start = time.perf_counter()
        reference = timm.create_model(name, pretrained=False)
        model = from_timm(reference).to("cuda", torch.bfloat16).eval()
        size = model.config.image_size
        with torch.inference_mode():
            for batch in batch_sizes:
                model(torch.randn(batch, 3, size, size, device="cuda", dtype=torch.bfloat16))
        if train_batch:
            if not reference.num_classes:
                reference.reset_classifier(1000)
            model = from_timm(reference).to("cuda", torch.bfloat16).train()
            optimizer = torch.optim.AdamW(model.parameters(), fused=True)
            pixels = torch.randn(train_batch, 3, size, size, device="cuda", dtype=torch.bfloat16)
            loss = F.cross_entropy(model(pixels).float(), torch.randint(0, 1000, (train_batch,), device="cuda"))
            loss.backward()
            optimizer.step()
        del reference, model
        torch.cuda.empty_cache()
        print(f"{name}: tuned in {time.perf_counter() - start:.1f} s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated timm architectures")
    parser.add_argument("--batch-sizes", default="1,8,32,64,128,256")
    parser.add_argument("--train-batch", type=int, default=128, help="a training step's batch (0: no training)")
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "vit_triton" / "kernels" / "tuned"))
    args = parser.parse_args()
    os.environ["VIT_TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="ship_tuned_")   # tune everything afresh
    import torch

    from vit_triton.kernels.tuning import gpu_name, shipped_file, tuned_picks

    if not torch.cuda.is_available():
        print("ship_tuned.py tunes on a CUDA device; none here", file=sys.stderr)
        return 2
    tune(args.models.split(","), [int(b) for b in args.batch_sizes.split(",")], args.train_batch)
    gpu = gpu_name(torch.device("cuda", torch.cuda.current_device()))
    path = Path(args.out) / shipped_file(gpu).name
    merged = merge_into(path, tuned_picks().get(gpu, {}))
    print(f"{sum(len(keys) for d in merged.values() for keys in d.values())} picks for {gpu} in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
