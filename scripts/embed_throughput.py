"""Throughput of `vit-triton embed` on a GPU, with and without decoding overlapped with the model.

Generates --num-images JPEGs of ImageNet-like sizes (or all of --image-size), saves a ViT-B/16
checkpoint with random weights in timm's layout (config.json + model.safetensors), and embeds the
folder twice with the package's own pipeline: with --num-workers 0 (decode, preprocess, then
compute, in turn) and with N DataLoader workers (decoding overlapped with the GPU). Also times the
ceilings: the model alone on ready batches, called eagerly and replayed from a CUDA graph as embed
replays full batches, and decoding alone in one process; and checks that both runs wrote identical
embeddings.

    python scripts/embed_throughput.py [--num-images 3000] [--batch-size 256] [--workers N] [--image-size WxH]
                                       [--json out.json]

Needs a CUDA device, timm (for the checkpoint's weights), pyarrow. Takes about a minute on an H100.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from multiprocessing import Pool
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

SIZES = [(500, 375), (375, 500), (500, 333), (640, 480), (480, 640), (800, 600)]  # (width, height)


def _make_jpeg(args: tuple[int, str, tuple[int, int] | None]) -> None:
    """A smooth random image with grain, so that it compresses like a photo (~50-150 KB at ImageNet's sizes)."""
    seed, path, size = args
    rng = np.random.default_rng(seed)
    w, h = size or SIZES[seed % len(SIZES)]
    coarse = Image.fromarray(rng.integers(0, 256, (9, 12, 3), dtype=np.uint8)).resize((w, h), Image.BICUBIC)
    pixels = np.asarray(coarse, dtype=np.int16) + rng.integers(-12, 13, (h, w, 3), dtype=np.int16)
    Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(path, quality=90)


def make_images(folder: Path, count: int, size: tuple[int, int] | None = None) -> list[str]:
    """`count` JPEGs under folder, all (width, height) `size`, or of SIZES in turn."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = [str(folder / f"{i // 1000:03d}" / f"img{i:06d}.jpg") for i in range(count)]
    for d in {os.path.dirname(p) for p in paths}:
        os.makedirs(d, exist_ok=True)
    with Pool(os.cpu_count()) as pool:
        pool.map(_make_jpeg, [(i, path, size) for i, path in enumerate(paths)], chunksize=32)
    return paths


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
    compute = embedding_fn(model, Preprocess.for_model(model), normalize=False, tokens=False,
                           output_dtype=torch.float32)
    pixels = torch.randint(0, 256, (batch_size, 3, 224, 224), dtype=torch.uint8, device="cuda")

    def images_per_s(run) -> float:
        with torch.inference_mode():
            for _ in range(3):
                run(pixels)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                run(pixels)
            end.record()
            torch.cuda.synchronize()
        return batch_size * iters / (start.elapsed_time(end) / 1000)

    return images_per_s(compute), images_per_s(CUDAGraphRunner(model, forward=compute))


def decode_ceiling(checkpoint: Path, paths: list[str], count: int = 200) -> float:
    """Images/s of decoding + resize + crop in one process (one core): what each worker adds."""
    from vit_triton import Preprocess
    from vit_triton.data.files import ImageFiles

    pre = Preprocess.from_timm(json.loads((checkpoint / "config.json").read_text())["pretrained_cfg"])
    dataset = ImageFiles(paths[:count], pre)
    torch.set_num_threads(1)
    start = time.perf_counter()
    for i in range(len(dataset)):
        dataset[i]
    seconds = time.perf_counter() - start
    torch.set_num_threads(os.cpu_count())
    return len(dataset) / seconds


def run_embed(checkpoint: Path, input_spec: str, output: Path, batch_size: int, workers: int) -> float:
    from vit_triton.pipelines import EmbedOptions, embed

    summary = embed(EmbedOptions(model=str(checkpoint), input=input_spec, output=str(output), batch_size=batch_size,
                                 num_workers=workers, overwrite=True, progress=False), log=lambda msg: None)
    assert summary.skipped == 0 and summary.done == summary.processed, summary
    return summary.processed / summary.seconds


def _size(text: str) -> tuple[int, int]:
    try:
        w, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT such as 256x256, got {text!r}") from None
    return w, h


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-images", type=int, default=3000)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                        help="DataLoader workers of the overlapped run (default: the CPUs less one, as embed's)")
    parser.add_argument("--image-size", type=_size, default=None, metavar="WxH",
                        help="every JPEG this size, e.g. 256x256 for a dataset stored resized (default: ImageNet-like "
                             "sizes from 500x333 to 800x600)")
    parser.add_argument("--dir", default=None, help="working folder (default: a temporary one)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("embed_throughput.py needs a CUDA device")
    import pyarrow.parquet as pq

    root = Path(args.dir or tempfile.mkdtemp(prefix="embed_throughput_"))
    t0 = time.perf_counter()
    paths = make_images(root / "images", args.num_images, args.image_size)
    checkpoint = make_checkpoint(root / "vit_base_patch16_224")
    print(f"{args.num_images} JPEGs and a ViT-B/16 checkpoint in {time.perf_counter() - t0:.1f} s under {root}",
          flush=True)

    # Compile and autotune the kernels (batch shapes of the runs below) before anything is timed.
    warm = root / "warm.txt"
    warm.write_text("\n".join(paths[: 2 * args.batch_size + args.num_images % args.batch_size]) + "\n")
    run_embed(checkpoint, str(warm), root / "warm.parquet", args.batch_size, args.workers)

    eager, graphed = model_ceilings(checkpoint, args.batch_size)
    results = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__,
        "triton": __import__("triton").__version__, "cpus": os.cpu_count(), "num_images": args.num_images,
        "batch_size": args.batch_size, "model": "vit_base_patch16_224 (random weights), bfloat16",
        "image_size": "x".join(map(str, args.image_size)) if args.image_size else "mixed",
        "model_only_eager_images_per_s": eager, "model_only_graphed_images_per_s": graphed,
        "decode_one_process_images_per_s": decode_ceiling(checkpoint, paths),
        "embed_workers_0_images_per_s": run_embed(checkpoint, str(root / "images"), root / "w0.parquet",
                                                  args.batch_size, 0),
        f"embed_workers_{args.workers}_images_per_s": run_embed(checkpoint, str(root / "images"),
                                                                root / "wN.parquet", args.batch_size, args.workers),
    }
    a, b = pq.read_table(root / "w0.parquet"), pq.read_table(root / "wN.parquet")
    results["outputs_identical"] = a.equals(b)
    for key, value in results.items():
        print(f"{key:40s} {value:.1f}" if isinstance(value, float) else f"{key:40s} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if results["outputs_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
