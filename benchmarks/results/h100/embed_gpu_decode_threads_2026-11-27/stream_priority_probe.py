# A probe run once for the README beside it, from the repository root on a GPU machine: python benchmarks/results/h100/embed_gpu_decode_threads_2026-11-27/stream_priority_probe.py
import os, sys, time, json, functools
from pathlib import Path
sys.path.insert(0, os.getcwd())
import torch
from scripts.embed_throughput import make_images, read_all, make_checkpoint, run_embed
import vit_triton.data.files as files, vit_triton.data.decode as decode
root = Path("/tmp/pr")
paths = make_images(root / "images", 20480, None, 4000)
read_all(paths[:4000])
ck = make_checkpoint(root / "vitb")
(root / "warm.txt").write_text("\n".join(paths[:256]) + "\n")
(root / "q.txt").write_text("\n".join(paths[:5120]) + "\n")
(root / "all.txt").write_text("\n".join(paths) + "\n")
run_embed(ck, str(root / "warm.txt"), root / "w.parquet", 256, 15, "gpu")
for variant in ("normal", "high", "normal"):
    if variant == "high":
        files._decode_stream = functools.lru_cache(None)(lambda d: torch.cuda.Stream(d, priority=-1))
        decode._output_stream = functools.lru_cache(None)(lambda d: torch.cuda.Stream(d, priority=-1))
    else:
        files._decode_stream = functools.lru_cache(None)(lambda d: torch.cuda.Stream(d))
        decode._output_stream = functools.lru_cache(None)(lambda d: torch.cuda.Stream(d))
    q = run_embed(ck, str(root / "q.txt"), root / "q.parquet", 256, 15, "gpu")
    a = run_embed(ck, str(root / "all.txt"), root / "a.parquet", 256, 15, "gpu")
    print(variant, json.dumps({"all": a["images_per_s"], "steady": (20480 - 5120) / (a["seconds"] - q["seconds"]),
                               "gpu_util": a["gpu_util_percent"]}), flush=True)
