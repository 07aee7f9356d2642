"""nvJPEG beside a running forward, under whatever CUDA_DEVICE_MAX_CONNECTIONS this process starts with:

A: nvJPEG alone, then beside a thread replaying the graphed ViT-B/16 forward without pause;
B: the package's two decoding threads (device_batches) on 16 batches in memory, with the forward;
C: the same fed by the DataLoader (15 workers), with the forward.

    CUDA_DEVICE_MAX_CONNECTIONS=8 OUT=. python benchmarks/results/h100/embed_queues_2026-11-28/queues_probe.py
"""
import functools, json, os, sys, threading, time
from pathlib import Path
ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "scripts"))
import torch
from torch.utils.data import DataLoader
from embed_throughput import make_images, make_checkpoint, read_all
from vit_triton import Preprocess, from_pretrained
from vit_triton.data.files import image_item, make_batch, device_batches, ImageFiles, worker_init
from vit_triton.pipelines.embed import ChunkBatches, embedding_fn
from vit_triton.runtime import CUDAGraphRunner

OUT = Path(os.environ["OUT"])
queues = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8")
root = Path("/tmp/st"); cuda = torch.device("cuda")
N = 12288
paths = make_images(root / "images", N, distinct=4096)
read_all(paths[:4096])
model = from_pretrained(str(make_checkpoint(root / "vitb")), device=cuda, dtype=torch.bfloat16)
pre = Preprocess.for_model(model)
compute = embedding_fn(model, pre, False, False, torch.float32)
graphed = CUDAGraphRunner(model, forward=compute)
data = [Path(p).read_bytes() for p in paths[:4096]]
mem = [make_batch(0, [(paths[i], *image_item(data[i], pre, True)) for i in range(s, s + 256)], False, pre)
       for s in range(0, 4096, 256)]
res = {"connections": queues, "device": torch.cuda.get_device_name(), "torch": torch.__version__}


def save():
    (OUT / f"conn{queues}.json").write_text(json.dumps(res, indent=1))


with torch.inference_mode():
    px = next(device_batches(iter(mem[:1]), pre, cuda, True))[1].clone()
    graphed(px); compute(px[:100])
    torch.cuda.synchronize()


def forward_loop(stop, count):
    with torch.inference_mode():
        while not stop.is_set():
            graphed(px); torch.cuda.current_stream().synchronize(); count[0] += 1


for beside in (False, True):   # A
    stop, count = threading.Event(), [0]
    thread = threading.Thread(target=forward_loop, args=(stop, count)) if beside else None
    if thread:
        thread.start(); time.sleep(0.2)
    with torch.inference_mode():
        t = time.perf_counter()
        for b in mem * 2:
            b.nvjpeg(cuda)
        dt = time.perf_counter() - t
    done = count[0]; stop.set()
    if thread:
        thread.join()
    res["A_nvjpeg_beside_forward" if beside else "A_nvjpeg_alone"] = {
        "nvjpeg_images_per_s": 2 * 4096 / dt, "forward_images_per_s": done * 256 / dt}
save()


def loader():
    ds = ImageFiles(paths, pre, 4096, True)
    return DataLoader(ds, batch_sampler=ChunkBatches([range(0, N)], 256), collate_fn=ds.collate, num_workers=15,
                      pin_memory=True, worker_init_fn=functools.partial(worker_init, os.getpid()))


def timed(name, make, images):
    torch.cuda.synchronize(); t = time.perf_counter()
    with torch.inference_mode():
        prev = None
        for batch, pixels in make():
            graphed(pixels) if len(pixels) == 256 else compute(pixels)
            ev = torch.cuda.Event(); ev.record()
            if prev is not None:
                prev.synchronize()
            prev = ev
        torch.cuda.synchronize()
    res[name] = images / (time.perf_counter() - t)
    print(name, round(res[name]), flush=True)
    save()


timed("B_memory_threads_forward", lambda: device_batches(iter(mem * 3), pre, cuda, True), 3 * 4096)
for rep in range(2):
    timed(f"C_dataloader_forward_{rep}", lambda: device_batches(loader(), pre, cuda, True), N)
