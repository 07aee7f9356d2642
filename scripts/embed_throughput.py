"""Throughput of `vit-triton embed` on a GPU: JPEGs decoded on the CPU (Pillow in DataLoader workers) and on the
GPU (the GPU's JPEG decoder and the resize kernel), against the model alone, with where the time goes.

Generates --num-images JPEG paths of mixed sizes, 400x300 to 1600x1200 (--distinct generated photos, linked
under several names; or all of --image-size), saves a timm checkpoint with random weights (--architecture,
ViT-B/16 by default) in timm's layout, and embeds the folder with the package's own pipeline: --decode gpu, and
--decode cpu on the first --cpu-images of them, each beside the CPUs' busy fraction and the GPU's utilisation;
and --decode gpu on the first quarter, for the steady rate past a run's start (the time the other three quarters
added).
Also times the ceilings: the model alone on ready uint8 batches (eager, and replayed from a CUDA graph as embed
replays full batches), Pillow's decoding and resizing in one process, and each GPU decoder (nvImageCodec,
torchvision's nvJPEG) with the resize kernel on bytes already in memory; and compares the GPU's pixels with the
CPU's: the largest pixel difference over a batch, and the cosine similarity of the embeddings both runs wrote.
And shows where the --decode gpu run's time goes (--overlap-images, overlap_probes): the GPU's decoder alone and
beside a running forward, the decoding threads with the forward on batches in memory, and embed without the
forward and as it is. Last, README's command itself over all the paths, in a process of its own, timed from
outside: first with empty caches, as on a new machine, then warm (command_wall_clock).

    python scripts/embed_throughput.py [--num-images 20000] [--distinct 4000] [--cpu-images 5000]
                                       [--architecture vit_base_patch16_224] [--batch-size 256] [--workers N]
                                       [--image-size WxH] [--overlap-images 16384] [--json out.json]

Needs a CUDA device, timm (for the checkpoint's weights), torchvision, pyarrow.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from vit_triton.cli import EMBED_TIME_LINE  # noqa: E402 -- the line embed's log says where its time went in
from vit_triton.pipelines.embed import CHUNK_SIZE, GPU_BATCH_SIZE  # noqa: E402 -- embed's defaults

SIZES = [(400, 300), (300, 400), (640, 480), (480, 640), (800, 600), (1024, 768), (1280, 960), (1600, 1200),
         (1200, 1600)]  # (width, height)


def _make_jpeg(args: tuple[int, str, tuple[int, int] | None]) -> None:
    """A smooth random image with grain, so that it compresses like a photo (~50-150 KB at ImageNet's sizes)."""
    seed, path, size = args
    rng = np.random.default_rng(seed)
    w, h = size or SIZES[seed % len(SIZES)]
    coarse = Image.fromarray(rng.integers(0, 256, (9, 12, 3), dtype=np.uint8)).resize((w, h), Image.BICUBIC)
    pixels = np.asarray(coarse, dtype=np.int16) + rng.integers(-12, 13, (h, w, 3), dtype=np.int16)
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(path, quality=90)


def make_images(folder: Path, count: int, size: tuple[int, int] | None = None,
                distinct: int | None = None) -> list[str]:
    """`count` JPEG paths under folder, all (width, height) `size`, or of SIZES in turn: `distinct` generated ones
    (default: all), then hard links to them in turn (decoding a linked file costs what decoding its original does)."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [str(folder / f"{i // 1000:03d}" / f"img{i:06d}.jpg") for i in range(count)]
    for d in {os.path.dirname(p) for p in paths}:
        os.makedirs(d, exist_ok=True)
    made = min(count, distinct or count)
    with Pool(os.cpu_count()) as pool:
        pool.map(_make_jpeg, [(i, path, size) for i, path in enumerate(paths[:made])], chunksize=32)
    for i in range(made, count):
        if not os.path.exists(paths[i]):  # a --dir of an earlier run keeps its links
            os.link(paths[i % made], paths[i])
    return paths


def read_all(paths: list[str]) -> float:
    """Reads every file once, so that no timed run is the first to fetch them from disk (the runs compared read
    the same files, and whichever came first would pay for the disk); returns this first read's MB/s."""
    start = time.perf_counter()
    total = sum(len(Path(p).read_bytes()) for p in paths)
    return total / 1e6 / (time.perf_counter() - start)


class Sampler:
    """CPU busy fraction (from /proc/stat) and mean utilisation of GPUs 0..n-1 (nvidia-smi) over a with-block."""

    def __init__(self, n: int = 1) -> None:
        self.n = n

    def __enter__(self):
        self.cpu0 = _cpu_times()
        self.gpu: list[float] = []
        self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                      f"--id={','.join(map(str, range(self.n)))}", "-lms", "500"],
                                     stdout=subprocess.PIPE, text=True)
        self.reader = threading.Thread(target=lambda: [self.gpu.append(float(v)) for v in self.proc.stdout
                                                       if v.strip().replace(".", "").isdigit()], daemon=True)
        self.reader.start()
        return self

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait()
        busy0, total0 = self.cpu0
        busy1, total1 = _cpu_times()
        self.cpu_busy = (busy1 - busy0) / max(total1 - total0, 1)
        self.gpu_util = sum(self.gpu) / len(self.gpu) if self.gpu else float("nan")


def _cpu_times() -> tuple[int, int]:
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def make_checkpoint(folder: Path, architecture: str = "vit_base_patch16_224") -> Path:
    """A timm architecture with random weights, as a timm hub repository lays it out (its own pretrained_cfg)."""
    import timm
    from safetensors.torch import save_file

    model = timm.create_model(architecture, pretrained=False)
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, folder / "model.safetensors")
    keys = ("input_size", "interpolation", "crop_pct", "crop_mode", "mean", "std")
    (folder / "config.json").write_text(json.dumps({
        "architecture": architecture, "num_classes": model.num_classes,
        "pretrained_cfg": {k: model.pretrained_cfg[k] for k in keys if k in model.pretrained_cfg}}))
    return folder


def model_ceilings(checkpoint: Path, batch_size: int, iters: int = 20) -> tuple[float, float]:
    """Images/s of embed's GPU work for a batch (embedding_fn: normalize, forward, pooling) on uint8 batches already
    on the GPU, (called eagerly, replayed from a CUDA graph as embed replays full batches): the model's own limit."""
    from vit_triton import Preprocess, from_pretrained
    from vit_triton.pipelines.embed import embedding_fn
    from vit_triton.runtime import CUDAGraphRunner

    model = from_pretrained(checkpoint, device="cuda", dtype=torch.bfloat16)
    pre = Preprocess.for_model(model)
    compute = embedding_fn(model, pre, normalize=False, tokens=False, output_dtype=torch.float32)
    pixels = torch.randint(0, 256, (batch_size, 3, *pre.size), dtype=torch.uint8, device="cuda")
    return (_images_per_s(compute, pixels, iters=iters),
            _images_per_s(CUDAGraphRunner(model, forward=compute), pixels, iters=iters))


def _images_per_s(run, *args, iters: int = 20) -> float:
    with torch.inference_mode():
        for _ in range(3):
            run(*args)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(iters):
            out = run(*args)
        torch.cuda.synchronize()
    return len(out[0] if isinstance(out, tuple) else out) * iters / (time.perf_counter() - start)


def _preprocess(checkpoint: Path):
    from vit_triton import Preprocess

    return Preprocess.from_timm(json.loads((checkpoint / "config.json").read_text())["pretrained_cfg"])


def decode_ceiling(checkpoint: Path, paths: list[str], count: int = 200) -> float:
    """Images/s of Pillow's decoding + resize + crop in one process (one core): what each worker adds."""
    from vit_triton.data.files import ImageFiles

    dataset = ImageFiles(paths[:count], _preprocess(checkpoint))
    torch.set_num_threads(1)
    start = time.perf_counter()
    for i in range(len(dataset)):
        dataset[i]
    seconds = time.perf_counter() - start
    torch.set_num_threads(os.cpu_count())
    return len(dataset) / seconds


def gpu_decoders() -> list:
    """The GPU's JPEG decoders that load here: nvImageCodec and torchvision's nvJPEG."""
    from vit_triton.data.decode import NvImageCodecJpeg, TorchvisionJpeg

    decoders = []
    for make in (NvImageCodecJpeg, TorchvisionJpeg):
        try:
            decoders.append(make(torch.device("cuda")))
        except Exception as e:  # noqa: BLE001 -- reported, and the other one measured
            print(f"{make.name} does not load: {e}", flush=True)
    return decoders


def gpu_decode_ceilings(checkpoint: Path, paths: list[str], batch_size: int) -> dict:
    """For each GPU decoder, images/s of its decode() alone, with its finish() (nvJPEG's chroma upsampling), and
    with the resize kernel after both, on a batch of JPEG bytes already in memory; the resize kernel's alone (on
    images decoded so), and the batch's mean megapixels."""
    pre = _preprocess(checkpoint)
    encoded, blocks = _encoded(paths[:batch_size])
    out = {}
    for decoder in gpu_decoders():
        decoded = decoder.pixels(encoded, blocks)
        out["megapixels_mean"] = sum(d.shape[1] * d.shape[2] for d in decoded) / len(decoded) / 1e6
        out["resize_images_per_s"] = _images_per_s(lambda: pre.resize_crop_batch(decoded), iters=10)
        out[decoder.name] = {
            "decode_images_per_s": _images_per_s(lambda: decoder.decode(encoded), iters=10),
            "decode_and_finish_images_per_s": _images_per_s(lambda: decoder.pixels(encoded, blocks), iters=10),
            "decode_finish_and_resize_images_per_s": _images_per_s(
                lambda: pre.resize_crop_batch(decoder.pixels(encoded, blocks)), iters=10)}
    return out


def _encoded(paths: list[str]) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """The JPEGs' bytes as the decoders take them, and their chroma blocks."""
    from vit_triton.data.decode import nvjpeg_block

    data = [Path(p).read_bytes() for p in paths]
    return [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in data], [nvjpeg_block(d) for d in data]


def pixel_differences(checkpoint: Path, paths: list[str], batch_size: int) -> dict:
    """Each GPU decoder's uint8 pixels, resized, against the CPU path's over a batch: largest difference, and the
    share of values that differ at all and by more than one level."""
    from vit_triton.data.files import ImageFiles

    pre = _preprocess(checkpoint)
    files = ImageFiles(paths[:batch_size], pre)
    cpu = torch.stack([files[i][1] for i in range(len(files))]).cuda()
    encoded, blocks = _encoded(paths[:batch_size])
    out = {}
    for decoder in gpu_decoders():
        diff = (pre.resize_crop_batch(decoder.pixels(encoded, blocks)).int() - cpu.int()).abs()
        out[decoder.name] = {"images": len(files), "max_abs_levels": int(diff.max()),
                             "mean_abs_levels": float(diff.float().mean()),
                             "share_differing": float((diff > 0).float().mean()),
                             "share_over_1": float((diff > 1).float().mean())}
    return out


def run_embed(checkpoint: Path, input_spec: str, output: Path, batch_size: int, workers: int,
              decode: str = "cpu") -> dict:
    """One embed run in this process, with the CPUs' and the GPU's load over it."""
    from vit_triton.pipelines import EmbedOptions, embed

    with Sampler() as load:
        summary = embed(EmbedOptions(model=str(checkpoint), input=input_spec, output=str(output),
                                     batch_size=batch_size, num_workers=workers, overwrite=True, progress=False,
                                     decode=decode), log=lambda msg: None)
    assert summary.skipped == 0 and summary.done == summary.processed, summary
    return {"images_per_s": summary.processed / summary.seconds, "seconds": summary.seconds,
            "gpu_decoded": summary.gpu_decoded, "cpu_decoded": summary.cpu_decoded, "cpu_busy": load.cpu_busy,
            "gpu_util_percent": load.gpu_util}


def logged_phases(stderr: str) -> dict[str, float]:
    """The seconds of each phase in embed's time line ("imports 2.1 s, device 0.6 s, ..."), in order."""
    for line in stderr.splitlines():
        if line.startswith(EMBED_TIME_LINE):
            parts = line.removeprefix(EMBED_TIME_LINE).split(", ")
            return {name: float(seconds) for name, seconds in (p.removesuffix(" s").rsplit(" ", 1) for p in parts)}
    return {}


def command_wall_clock(checkpoint: Path, input_spec: str, output: Path, images: int) -> dict:
    """README's command, `vit-triton embed INPUT --model CKPT --output OUT`, in a process of its own, timed from
    outside as a user waits for it: first with empty caches (the tuner's and Triton's, in a fresh folder, as on a
    new machine), then again with them warm. Images/s from each whole command, its own figure's, the phases its
    log names and the time outside them (the interpreter's start and exit, the workers' shutdown)."""
    caches = Path(tempfile.mkdtemp(prefix="embed_caches_"))
    env = dict(os.environ, VIT_TRITON_CACHE_DIR=str(caches / "vit-triton"), TRITON_CACHE_DIR=str(caches / "triton"))
    out = {}
    for run in ("first_run_empty_caches", "second_run_warm_caches"):
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "vit_triton", "embed", input_spec, "--model", str(checkpoint),
                               "--output", str(output), "--overwrite", "--no-progress"], env=env, capture_output=True,
                              text=True, check=True)
        seconds = time.perf_counter() - start
        phases = logged_phases(done.stderr)
        out[run] = {"seconds": seconds, "images_per_s": images / seconds, "phases": phases,
                    "outside_the_phases": seconds - sum(phases.values()), "final_line": done.stdout.strip()[-300:]}
        print(run, json.dumps(out[run]), flush=True)
    return out


def overlap_probes(checkpoint: Path, listed: Path, root: Path, batch_size: int, workers: int) -> dict:
    """Where a --decode gpu run's time goes, from the GPU's decoder (the one embed picks) alone up to the whole
    pipeline. On JPEG batches of the files in `listed` already in memory: the decoder alone; the decoder while
    another thread replays the graphed forward without pause (and the forward's rate meanwhile), which falls several
    times short of alone where its streams share the forward's hardware queue (CUDA_DEVICE_MAX_CONNECTIONS); and
    the package's two decoding threads (device_batches) with the forward after each batch, as embed runs them
    without the DataLoader and the writer. Then embed over the files: with the DataLoader and no forward (the
    stand-in writes zeros), and as it is, each with CPU busy and GPU busy. Images/s throughout."""
    import importlib

    from vit_triton import Preprocess, from_pretrained
    from vit_triton.data.decode import jpeg_decoder
    from vit_triton.data.files import device_batches, image_item, make_batch
    from vit_triton.runtime import CUDAGraphRunner

    embed_module = importlib.import_module("vit_triton.pipelines.embed")   # the package's name `embed` is a function
    files = listed.read_text().split()
    cuda = torch.device("cuda")
    model = from_pretrained(checkpoint, device=cuda, dtype=torch.bfloat16)
    pre = Preprocess.for_model(model)
    compute = embed_module.embedding_fn(model, pre, normalize=False, tokens=False, output_dtype=torch.float32)
    graphed = CUDAGraphRunner(model, forward=compute)
    batches = []
    for first in range(0, min(len(files), 8 * batch_size) - batch_size + 1, batch_size):   # full batches, 8 at most
        items = [(path, *image_item(Path(path).read_bytes(), pre, True)) for path in files[first:first + batch_size]]
        batches.append(make_batch(0, items, False, pre))
    images = sum(len(b.names) for b in batches)
    decoder, _ = jpeg_decoder(cuda)
    out = {"cuda_device_max_connections": os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8 (CUDA's default)"),
           "batches_in_memory": len(batches), "decoder": decoder.name}
    with torch.inference_mode():
        for _, ready in device_batches(iter(batches[:1]), pre, cuda, decoder):
            pixels = ready.clone()   # a full batch of real pixels for the forward to replay on
        graphed(pixels)
        torch.cuda.synchronize()

    def replay(stop: threading.Event, replays: list[int]) -> None:
        with torch.inference_mode():
            while not stop.is_set():
                graphed(pixels)
                torch.cuda.current_stream().synchronize()
                replays[0] += 1

    for name, beside in (("decode_alone", False), ("decode_beside_the_forward", True)):
        stop, replays = threading.Event(), [0]
        thread = threading.Thread(target=replay, args=(stop, replays)) if beside else None
        if thread:
            thread.start()
            time.sleep(0.2)   # the forward running before decoding starts
        with torch.inference_mode():
            before, start = replays[0], time.perf_counter()   # not the replays of the 0.2 s before decoding starts
            for batch in batches * 2:
                batch.decode_jpegs(decoder)
            seconds = time.perf_counter() - start
        done = replays[0] - before
        stop.set()
        if thread:
            thread.join()
        out[name] = {"decode_images_per_s": 2 * images / seconds, "forward_images_per_s": done * len(pixels) / seconds}

    with torch.inference_mode():
        start, last = time.perf_counter(), None
        for _, batch_pixels in device_batches(iter(batches * 3), pre, cuda, decoder):
            if len(batch_pixels) == len(pixels):
                graphed(batch_pixels)
            else:   # an image the GPU's decoder and Pillow both failed on
                compute(batch_pixels)
            event = torch.cuda.Event()
            event.record()
            if last is not None:
                last.synchronize()   # one batch in flight, as embed keeps it
            last = event
        torch.cuda.synchronize()
        out["decoding_threads_and_forward_in_memory"] = 3 * images / (time.perf_counter() - start)

    def zeros(model, pre, normalize, tokens, output_dtype):
        return lambda pixels: (torch.zeros(len(pixels), model.config.embedding_dim, dtype=output_dtype,
                                           device=pixels.device),)

    run = functools.partial(run_embed, checkpoint, str(listed), root / "overlap.parquet", batch_size, workers, "gpu")
    saved = embed_module.embedding_fn, embed_module.CUDAGraphRunner
    try:
        embed_module.embedding_fn, embed_module.CUDAGraphRunner = zeros, lambda model, forward: None
        out["embed_without_the_forward"] = run()
    finally:
        embed_module.embedding_fn, embed_module.CUDAGraphRunner = saved
    out["embed_as_is"] = run()
    return out


def trace_gpu_decode(checkpoint: Path, paths: list[str], root: Path, batch_size: int, workers: int,
                     trace: str) -> None:
    """A --decode gpu run over `paths` under torch.profiler: its Chrome trace, and the operations that took the
    most CPU time (a host-bound pipeline shows there)."""
    from torch.profiler import ProfilerActivity, profile

    listed = root / "traced.txt"
    listed.write_text("\n".join(paths) + "\n")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run_embed(checkpoint, str(listed), root / "traced.parquet", batch_size, workers, "gpu")
    prof.export_chrome_trace(trace)
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25), flush=True)


def short_batches(counts: tuple[int, ...], batch_size: int, chunk_size: int = CHUNK_SIZE) -> set[int]:
    """The sizes of the batches shorter than batch_size that embed's runs over `counts` images make (a batch ends
    at its chunk's end; embed's chunks are chunk_size images), and 0."""
    return {0} | {n % batch_size for count in counts
                  for n in ([chunk_size] if count >= chunk_size else []) + [count % chunk_size]}


def _size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT such as 256x256, got {text!r}") from None
    return w, h


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-images", type=int, default=20000)
    parser.add_argument("--distinct", type=int, default=4000, help="generated JPEGs; the rest are links to them")
    parser.add_argument("--cpu-images", type=int, default=5000,
                        help="the --decode cpu run embeds the first this many (it is the slow one)")
    parser.add_argument("--architecture", default="vit_base_patch16_224", help="a timm architecture")
    parser.add_argument("--batch-size", type=int, default=GPU_BATCH_SIZE)
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="DataLoader workers (default: the CPUs less one, as embed's)")
    parser.add_argument("--image-size", type=_size, default=None, metavar="WxH",
                        help="every JPEG this size (default: sizes from 400x300 to 1600x1200)")
    parser.add_argument("--dir", default=None, help="working folder (default: a temporary one)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--overlap-images", type=int, default=16384,
                        help="images of the runs that split decoding's and the forward's time (overlap_probes; 0: "
                             "none; default 16384)")
    parser.add_argument("--trace", default=None, metavar="FILE.json",
                        help="also trace a --decode gpu run of 8 batches with torch.profiler (CPU and CUDA) into this "
                             "Chrome trace, and print its busiest operations: where the pipeline waits")
    args = parser.parse_args()
    if 0 < args.overlap_images < args.batch_size:
        parser.error(f"--overlap-images must be 0 or at least the batch size ({args.batch_size}), "
                     f"got {args.overlap_images}")
    from vit_triton.data.decode import widen_hardware_queues

    widen_hardware_queues()   # the embed runs are in this process: its CUDA must start as embed's would
    if not torch.cuda.is_available():
        raise SystemExit("embed_throughput.py needs a CUDA device")
    import pyarrow.parquet as pq

    root = Path(args.dir or tempfile.mkdtemp(prefix="embed_throughput_"))
    t0 = time.perf_counter()
    paths = make_images(root / "images", args.num_images, args.image_size, args.distinct)
    read_mb_per_s = read_all(paths[:args.distinct])
    checkpoint = make_checkpoint(root / args.architecture, args.architecture)
    print(f"{args.num_images} JPEG paths ({args.distinct} distinct) and a checkpoint in "
          f"{time.perf_counter() - t0:.1f} s under {root}", flush=True)

    # Compile and autotune the kernels for every batch shape the runs below meet before anything is timed: a new
    # shape met in a timed run would autotune there, with the workers waiting.
    warm = root / "warm.txt"
    quarter = args.num_images // 4
    for short in short_batches((args.num_images, args.cpu_images, quarter, args.overlap_images), args.batch_size):
        warm.write_text("\n".join(paths[:args.batch_size + short]) + "\n")
        for decode in ("cpu", "gpu"):
            run_embed(checkpoint, str(warm), root / "warm.parquet", args.batch_size, args.workers, decode)

    eager, graphed = model_ceilings(checkpoint, args.batch_size)
    results = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": __import__("triton").__version__, "torchvision": __import__("torchvision").__version__,
        "cpus": os.cpu_count(), "num_images": args.num_images, "distinct_images": args.distinct,
        "batch_size": args.batch_size, "workers": args.workers, "first_read_mb_per_s": read_mb_per_s,
        "model": f"{args.architecture} (random weights), bfloat16",
        "image_size": "x".join(map(str, args.image_size)) if args.image_size else "mixed, 400x300 to 1600x1200",
        "model_only_eager_images_per_s": eager, "model_only_graphed_images_per_s": graphed,
        "pillow_one_process_images_per_s": decode_ceiling(checkpoint, paths),
        **gpu_decode_ceilings(checkpoint, paths, args.batch_size),
        "pixels_gpu_against_cpu": pixel_differences(checkpoint, paths, args.batch_size),
    }
    print(json.dumps(results), flush=True)
    first = root / "first.txt"
    first.write_text("\n".join(paths[:args.cpu_images]) + "\n")
    for decode, inputs in (("cpu", first), ("gpu", root / "images")):
        r = run_embed(checkpoint, str(inputs), root / f"{decode}.parquet", args.batch_size, args.workers, decode)
        r["of_model_only"] = r["images_per_s"] / graphed
        results[f"embed_decode_{decode}"] = r
        print(decode, json.dumps(r), flush=True)
    # Past its start (workers starting, the first batches read): the rate a run of many more images approaches,
    # from the time the last three quarters of this run's images added to a run of the first quarter.
    listed = root / "quarter.txt"
    listed.write_text("\n".join(sorted(paths)[:quarter]) + "\n")
    r = run_embed(checkpoint, str(listed), root / "quarter.parquet", args.batch_size, args.workers, "gpu")
    whole = results["embed_decode_gpu"]
    whole["steady_images_per_s"] = (args.num_images - quarter) / (whole["seconds"] - r["seconds"])
    whole["steady_of_model_only"] = whole["steady_images_per_s"] / graphed
    print("steady", json.dumps(whole), flush=True)
    cpu, gpu = (pq.read_table(root / f"{d}.parquet").slice(0, args.cpu_images) for d in ("cpu", "gpu"))
    assert cpu.column("path").equals(gpu.column("path"))
    a, b = (np.stack(t.column("embedding").to_numpy(zero_copy_only=False)) for t in (cpu, gpu))
    cosine = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    results["embedding_cosine_gpu_against_cpu"] = {"images": len(cosine), "min": float(cosine.min()),
                                                   "mean": float(cosine.mean())}
    results["command"] = command_wall_clock(checkpoint, str(root / "images"), root / "command.parquet",
                                            args.num_images)
    if args.overlap_images:
        listed = root / "overlap.txt"
        listed.write_text("\n".join(paths[:args.overlap_images]) + "\n")
        results["overlap"] = overlap_probes(checkpoint, listed, root, args.batch_size, args.workers)
        print("overlap", json.dumps(results["overlap"]), flush=True)
    if args.trace:
        trace_gpu_decode(checkpoint, paths[:8 * args.batch_size], root, args.batch_size, args.workers, args.trace)
    for key, value in results.items():
        print(f"{key:40s} {value:.1f}" if isinstance(value, float) else f"{key:40s} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
