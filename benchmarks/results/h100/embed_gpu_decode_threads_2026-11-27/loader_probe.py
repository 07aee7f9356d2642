# A probe run once for the README beside it, from the repository root on a GPU machine: python benchmarks/results/h100/embed_gpu_decode_threads_2026-11-27/loader_probe.py
import os, sys, time, json, functools
from pathlib import Path
sys.path.insert(0, os.getcwd())
import torch
from torch.utils.data import DataLoader
from scripts.embed_throughput import make_images, read_all
from vit_triton import Preprocess
from vit_triton.data.files import ImageFiles, device_batches, worker_init
from vit_triton.pipelines.embed import ChunkBatches
paths = make_images(Path("/tmp/ld/images"), 20480, None, 4000)
read_all(paths[:4000])
pre = Preprocess.from_timm(dict(input_size=(3, 224, 224), crop_pct=0.9, interpolation="bicubic"))
dev = torch.device("cuda")
out = {}
for name in ("loader_only", "loader_nvjpeg_resize", "loader_only_8w"):
    workers = 8 if name.endswith("8w") else 15
    ds = ImageFiles(paths, pre, 4096, gpu_decode=True)
    loader = DataLoader(ds, batch_sampler=ChunkBatches([range(0, 20480)], 256), collate_fn=ds.collate, num_workers=workers,
                        pin_memory=True, worker_init_fn=functools.partial(worker_init, os.getpid()))
    t = time.perf_counter(); n = 0; first = None
    it = device_batches(loader, pre, dev, True) if "nvjpeg" in name else ((b, None) for b in loader)
    for b, px in it:
        n += len(b.names)
        if first is None: first = time.perf_counter(); n0 = n
    torch.cuda.synchronize()
    end = time.perf_counter()
    out[name] = {"images_per_s": n / (end - t), "after_first_batch": (n - n0) / (end - first), "first_batch_s": first - t}
    print(name, out[name], flush=True)
