"""Scaling of `vit-triton embed` over the GPUs of one host, under torchrun, and a kill -9 of one rank mid-run.

For each model (ViT-B/16 at 224 px, and DINOv2-L/14 at its 518 px: a decoding-bound and a GPU-bound case),
embeds one folder of generated JPEGs (mixed sizes, 400x300 to 1600x1200) with `torchrun --nproc-per-node N -m
vit_triton embed` for each N in --gpus, and reports images/s in all and per GPU against one GPU. One GPU runs
twice: with embed's default decoding workers (all the CPUs less one) and with the share of the CPUs one rank
gets at the largest N, so that a shortfall can be put on the decoding or on the GPUs. Every run's output must
equal the one-GPU output row for row. Then a run at the largest N is killed (kill -9 of its last rank, once
some chunks are written) and the same command run again: its output must be complete and equal too.

    python scripts/embed_scaling.py [--gpus 1,2] [--models vit-b,dinov2-l] [--num-images 150000,24000]
                                    [--distinct 20000] [--decode cpu|gpu] [--json out.json] [--dir DIR]

The folder holds --distinct generated JPEGs, each linked under several names up to --num-images (generating
150,000 distinct photos would take longer than embedding them; decoding a linked file costs the same). Needs
CUDA devices, timm (the checkpoints' random weights) and pyarrow.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not

import torch  # noqa: E402

from embed_throughput import Sampler, make_checkpoint, make_images, read_all  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODELS = {"vit-b": "vit_base_patch16_224", "dinov2-l": "vit_large_patch14_dinov2"}
_DONE = re.compile(r"this run: (\d+) images in ([\d.]+) s")


def _command(n: int, checkpoint: Path, inputs: Path, output: Path, workers: int | None, decode: str,
             overwrite: bool = True) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}",
           "-m", "vit_triton", "embed", str(inputs), "--model", str(checkpoint), "--output", str(output),
           "--no-progress", "--decode", decode] + (["--overwrite"] if overwrite else [])
    return cmd + ([] if workers is None else ["--num-workers", str(workers)])


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def run(n: int, checkpoint: Path, inputs: Path, output: Path, decode: str, workers: int | None = None) -> dict:
    """One embed run; images/s from its own report (the time after the model is loaded)."""
    with Sampler(n) as s:
        start = time.perf_counter()
        result = subprocess.run(_command(n, checkpoint, inputs, output, workers, decode), env=_env(),
                                capture_output=True, text=True)
        wall = time.perf_counter() - start
    if result.returncode != 0:
        raise RuntimeError(f"embed with {n} GPU(s) failed:\n{result.stderr[-4000:]}")
    images, seconds = _DONE.search(result.stdout).groups()
    rate = int(images) / float(seconds)
    return {"gpus": n, "workers_per_gpu": workers if workers is not None else (os.cpu_count() or 1) // n - 1,
            "images": int(images), "seconds": float(seconds), "wall_seconds": wall, "images_per_s": rate,
            "images_per_s_per_gpu": rate / n, "cpu_busy": s.cpu_busy, "gpu_util_percent": s.gpu_util}


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def _local_rank(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    ranks = [int(e.split(b"=", 1)[1]) for e in env if e.startswith(b"LOCAL_RANK=")]
    return ranks[0] if ranks else None


def kill_and_resume(n: int, checkpoint: Path, inputs: Path, output: Path, decode: str) -> dict:
    """kill -9 of rank n-1 once two chunks are written, then the same command again."""
    work = output.with_name(output.name + ".partial")
    proc = subprocess.Popen(_command(n, checkpoint, inputs, output, None, decode), env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    while len(list(work.glob("chunk-*.json"))) < 2:
        if proc.poll() is not None:
            raise RuntimeError(f"the run to kill ended first:\n{proc.stderr.read()[-4000:]}")
        time.sleep(0.2)
    ranks = {_local_rank(p): p for p in _children(proc.pid)}
    victim = ranks[n - 1]
    done_at_kill = len(list(work.glob("chunk-*.json")))
    os.kill(victim, signal.SIGKILL)
    proc.communicate(timeout=300)
    again = subprocess.run(_command(n, checkpoint, inputs, output, None, decode, overwrite=False), env=_env(),
                           capture_output=True, text=True)
    if again.returncode != 0:
        raise RuntimeError(f"the run after the kill failed:\n{again.stderr[-4000:]}")
    resumed = re.search(r"resuming .*?: (\d+) of (\d+) chunks already done", again.stderr)
    return {"gpus": n, "killed_local_rank": n - 1, "killed_exit_status": proc.returncode,
            "chunks_done_at_kill": done_at_kill, "resumed_with": resumed.group(0) if resumed else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", default="1,2", help="comma-separated process counts (default 1,2)")
    parser.add_argument("--models", default="vit-b,dinov2-l", help="comma-separated, from " + ", ".join(MODELS))
    parser.add_argument("--num-images", default="150000,24000", help="images per model, in the order of --models")
    parser.add_argument("--distinct", type=int, default=20000, help="generated JPEGs; the rest are links to them")
    parser.add_argument("--decode", choices=["cpu", "gpu"], default="cpu", help="embed's --decode (default cpu)")
    parser.add_argument("--dir", default=None, help="working folder (default: a temporary one)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    gpus = [int(g) for g in args.gpus.split(",")]
    models = args.models.split(",")
    counts = [int(c) for c in args.num_images.split(",")]
    if len(counts) != len(models) or any(m not in MODELS for m in models):
        raise SystemExit(f"--models from {', '.join(MODELS)}, with one --num-images each")
    if max(gpus) > torch.cuda.device_count():
        raise SystemExit(f"--gpus {args.gpus} needs {max(gpus)} CUDA devices; this machine has "
                         f"{torch.cuda.device_count()}")
    import tempfile

    import pyarrow.parquet as pq

    root = Path(args.dir or tempfile.mkdtemp(prefix="embed_scaling_"))
    results = {"device": torch.cuda.get_device_name(), "device_count": torch.cuda.device_count(),
               "torch": torch.__version__, "triton": __import__("triton").__version__, "cpus": os.cpu_count(),
               "distinct_images": args.distinct, "decode": args.decode, "models": {}}
    t0 = time.perf_counter()
    paths = make_images(root / "images", max(counts), distinct=args.distinct)
    results["first_read_mb_per_s"] = read_all(paths[:args.distinct])
    print(f"{max(counts)} JPEG paths ({args.distinct} distinct) in {time.perf_counter() - t0:.1f} s", flush=True)
    ok = True
    for model, count in zip(models, counts):
        checkpoint = make_checkpoint(root / MODELS[model], MODELS[model])
        inputs = root / f"{model}.txt"
        inputs.write_text("\n".join(paths[:count]) + "\n")
        warm = root / f"{model}-warm.txt"
        # full batches and the short one the last chunk ends with: every shape the timed runs meet
        warm.write_text("\n".join(paths[:3 * 256 + count % 4096 % 256]) + "\n")
        for n in sorted({1, max(gpus)}):  # compile and tune before anything is timed
            run(n, checkpoint, warm, root / f"{model}-warm-{n}.parquet", args.decode)
        runs = {f"{model}-1": run(1, checkpoint, inputs, root / f"{model}-1.parquet", args.decode)}
        if max(gpus) > 1:
            share = (os.cpu_count() or 1) // max(gpus) - 1
            runs[f"{model}-1-share"] = run(1, checkpoint, inputs, root / f"{model}-1-share.parquet", args.decode, share)
        runs.update({f"{model}-{n}": run(n, checkpoint, inputs, root / f"{model}-{n}.parquet", args.decode)
                     for n in gpus if n > 1})
        reference = pq.read_table(root / f"{model}-1.parquet")
        one, same = runs[f"{model}-1"], runs.get(f"{model}-1-share", runs[f"{model}-1"])
        for name, r in runs.items():
            r["output_equals_one_gpu"] = pq.read_table(root / f"{name}.parquet").equals(reference)
            r["per_gpu_vs_one_gpu"] = r["images_per_s_per_gpu"] / one["images_per_s"]
            r["per_gpu_vs_one_gpu_same_workers"] = r["images_per_s_per_gpu"] / same["images_per_s"]
            ok &= r["output_equals_one_gpu"]
            print(name, json.dumps(r), flush=True)
        entry = {"architecture": MODELS[model], "images": count, "runs": runs}
        if model == models[0] and max(gpus) > 1:
            killed = kill_and_resume(max(gpus), checkpoint, inputs, root / f"{model}-killed.parquet",
                                     args.decode)
            table = pq.read_table(root / f"{model}-killed.parquet")
            killed["output_equals_one_gpu"] = table.equals(reference)
            killed["rows"], killed["distinct_paths"] = table.num_rows, len(set(table.column("path").to_pylist()))
            ok &= killed["output_equals_one_gpu"] and killed["rows"] == killed["distinct_paths"] == count
            print(json.dumps(killed), flush=True)
            entry["kill_and_resume"] = killed
        results["models"][model] = entry
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
