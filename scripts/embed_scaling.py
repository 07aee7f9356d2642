"""Scaling of `vit-triton embed` over the GPUs of one host, under torchrun, and a kill -9 of one rank mid-run.

For each model (ViT-B/16 at 224 px, and DINOv2-L/14 at its 518 px: a decoding-bound and a GPU-bound case),
embeds one folder of generated JPEGs (mixed sizes, 400x300 to 1600x1200) with `torchrun --nproc-per-node N -m
vit_triton embed` for each N in --gpus (nvJPEG decoding by default, as embed's own default on a GPU), and reports
images/s in all and per GPU against one GPU: over the whole run, as embed reports it (its start and the final merge
of every rank's chunks into one file included), and steady (from the times the chunks end). With --share, one GPU
also runs with the share of the CPUs one rank gets at the largest N, so that a shortfall can be put on the
decoding or on the GPUs. With --independent, each N > 1 also runs as N single-GPU embeds at once, no torchrun
(CUDA_VISIBLE_DEVICES=i, the chunks rank i would embed, one rank's share of the CPUs): if they lose as much a GPU
as the ranks do, what the ranks share is the host, not the process group. Every run's output must equal the
one-GPU output row for row (where one does not, the rows, the largest difference and the chunks that differ are
reported; an independent embed's, the one-GPU output's rows of its chunks). Then a run at the largest N is killed
(kill -9 of its last rank, once some chunks are written) and the same command run again, on the first
--kill-chunks chunks' paths: its output must be complete and equal to the one-GPU output's first rows.

    python scripts/embed_scaling.py [--gpus 1,2] [--models vit-b,dinov2-l] [--num-images 150000,24000]
                                    [--distinct 20000] [--chunk-size 4096,1024] [--decode cpu|gpu] [--no-share]
                                    [--independent] [--no-kill] [--kill-chunks 24] [--json out.json] [--dir DIR]

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
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, installed or not
sys.path.insert(0, str(Path(__file__).resolve().parent))      # embed_throughput beside it, imported too

import torch  # noqa: E402

from embed_throughput import Sampler, make_checkpoint, make_images, read_all  # noqa: E402

from vit_triton.pipelines.embed import CHUNK_SIZE, GPU_BATCH_SIZE as BATCH  # noqa: E402 -- embed's defaults

REPO = Path(__file__).resolve().parents[1]
MODELS = {"vit-b": "vit_base_patch16_224", "dinov2-l": "vit_large_patch14_dinov2"}
_DONE = re.compile(r"this run: (\d+) images in ([\d.]+) s.*decoded (\d+) on the GPU and (\d+) on the CPU")


def _command(n: int | None, checkpoint: Path, inputs: Path, output: Path, workers: int | None, decode: str,
             chunk: int, overwrite: bool = True) -> list[str]:
    """embed under torchrun with n processes, or, with n None, one plain process."""
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}"] if n else []
    cmd = [sys.executable, *launcher, "-m", "vit_triton", "embed", str(inputs), "--model", str(checkpoint),
           "--output", str(output), "--no-progress", "--decode", decode, "--chunk-size", str(chunk)]
    return cmd + (["--overwrite"] if overwrite else []) + ([] if workers is None else ["--num-workers", str(workers)])


def _env(gpu: int | None = None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return env if gpu is None else {**env, "CUDA_VISIBLE_DEVICES": str(gpu)}


def rank_workers(n: int) -> int:
    """The decoding workers embed gives a rank at n GPUs of this host by default: its share of the CPUs, less one."""
    return (os.cpu_count() or 1) // n - 1


def rank_rows(total: int, n: int, chunk: int, rank: int) -> list[int]:
    """Which of `total` inputs rank `rank` of n embeds, in order: its chunks, rank, rank + n, ... (as embed deals
    the chunks of a fresh output); the one-GPU output's rows of them, where every image is readable."""
    return [k for start in range(rank * chunk, total, n * chunk) for k in range(start, min(start + chunk, total))]


def run(n: int, checkpoint: Path, inputs: Path, output: Path, decode: str, workers: int | None = None,
        chunk: int = CHUNK_SIZE, independent: bool = False) -> dict:
    """One embed run over n GPUs: torchrun, or with `independent` n plain single-GPU embeds at once (embed i on GPU i
    with the chunks rank i would take, into OUTPUT-i). images/s from embed's own report (the time after the model is
    loaded, the final merge included; with `independent` each process's, summed), and the steady rate a GPU: each
    rank's (process's) chunks after its first, over the time from its first chunk's end to its last's (rank r embeds
    chunks r, r + n, ...; a chunk's end is when its done marker appears), averaged over the ranks that end two chunks
    or more, and the slowest rank's. Also where the rest of the time went: from the start of the command to the
    first marker, and from the last marker to the command's end (rank 0's merge of what is left, and the exit)."""
    paths = inputs.read_text().split()
    if independent:   # (command, environment, its work folder, its number of paths, which rank it stands for)
        jobs = []
        for i in range(n):
            part = [paths[k] for k in rank_rows(len(paths), n, chunk, i)]
            listed = output.with_name(f"{output.stem}-{i}.txt")
            listed.write_text("\n".join(part) + "\n")
            out = output.with_name(f"{output.stem}-{i}{output.suffix}")
            jobs.append((_command(None, checkpoint, listed, out, workers, decode, chunk), _env(i), out, len(part), i))
    else:
        jobs = [(_command(n, checkpoint, inputs, output, workers, decode, chunk), _env(), output, len(paths), None)]
    ended = {}   # (rank, job, chunk) -> (time its marker appeared, its images)
    with Sampler(n) as s:
        start = time.perf_counter()
        procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for cmd, env, *_ in jobs]
        outs: dict[int, tuple[str, str]] = {}
        readers = [threading.Thread(target=lambda j=j, p=p: outs.setdefault(j, p.communicate()), daemon=True)
                   for j, p in enumerate(procs)]
        for reader in readers:
            reader.start()
        while any(reader.is_alive() for reader in readers):
            for j, (_, _, out, total, rank) in enumerate(jobs):
                for marker in out.with_name(out.name + ".partial").glob("chunk-*.json"):
                    k = int(marker.stem.split("-")[1])
                    ended.setdefault((k % n if rank is None else rank, j, k),
                                     (time.perf_counter(), min(chunk, total - k * chunk)))
            time.sleep(0.1)
        end = time.perf_counter()
    images = seconds = rate = 0.0
    decoded = [0, 0]
    for j, proc in enumerate(procs):
        stdout, stderr = outs[j]
        if proc.returncode != 0:
            raise RuntimeError(f"embed with {n} GPU(s) failed:\n{stderr[-4000:]}")
        count, secs, on_gpu, on_cpu = _DONE.search(stdout).groups()
        images, seconds, rate = images + int(count), max(seconds, float(secs)), rate + int(count) / float(secs)
        decoded = [decoded[0] + int(on_gpu), decoded[1] + int(on_cpu)]
    steady = []
    for rank in range(n):
        times = sorted(v for (r, *_), v in ended.items() if r == rank)
        if len(times) > 1:
            steady.append(sum(size for _, size in times[1:]) / (times[-1][0] - times[0][0]))
    marks = [t for t, _ in ended.values()]
    return {"gpus": n, "independent": independent,
            "workers_per_gpu": workers if workers is not None else rank_workers(n),
            "images": int(images), "seconds": seconds, "decoded_on_gpu": decoded[0], "decoded_on_cpu": decoded[1],
            "wall_seconds": end - start, "chunk_size": chunk,
            "first_chunk_end_s": min(marks) - start, "after_last_chunk_s": end - max(marks),
            "images_per_s": rate,
            "images_per_s_per_gpu": rate / n,
            "steady_images_per_s_per_gpu": sum(steady) / len(steady) if steady else None,
            "slowest_rank_steady_images_per_s": min(steady) if steady else None,
            "steady_images_per_s_by_rank": steady,
            "ranks_with_a_steady_rate": len(steady), "chunks": len(ended),
            "cpu_busy": s.cpu_busy, "gpu_util_percent": s.gpu_util}


def difference(table, reference, chunk: int) -> dict:
    """Where two outputs of the same inputs differ: rows, the largest embedding difference, and the chunks."""
    import numpy as np

    if table.column("path").to_pylist() != reference.column("path").to_pylist():
        return {"same_paths": False}
    a, b = (t.column("embedding").combine_chunks().flatten().to_numpy().astype(np.float32).reshape(t.num_rows, -1)
            for t in (table, reference))
    rows = np.flatnonzero((a != b).any(1))
    return {"same_paths": True, "rows_differing": len(rows), "max_abs_difference": float(np.abs(a - b).max()),
            "chunks_differing": sorted({int(r) // chunk for r in rows})}


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


def kill_and_resume(n: int, checkpoint: Path, inputs: Path, output: Path, decode: str, chunk: int) -> dict:
    """kill -9 of rank n-1 once two chunks are written, then the same command again."""
    work = output.with_name(output.name + ".partial")
    proc = subprocess.Popen(_command(n, checkpoint, inputs, output, None, decode, chunk), env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while len(list(work.glob("chunk-*.json"))) < 2:
        if proc.poll() is not None:
            raise RuntimeError(f"the run to kill ended first:\n{proc.stderr.read()[-4000:]}")
        time.sleep(0.2)
    ranks = {_local_rank(p): p for p in _children(proc.pid)}
    victim = ranks[n - 1]
    done_at_kill = len(list(work.glob("chunk-*.json")))
    os.kill(victim, signal.SIGKILL)
    proc.communicate(timeout=300)
    again = subprocess.run(_command(n, checkpoint, inputs, output, None, decode, chunk, overwrite=False),
                           env=_env(), capture_output=True, text=True)
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
    parser.add_argument("--chunk-size", default=str(CHUNK_SIZE),
                        help=f"embed's --chunk-size, multiples of the batch ({BATCH}): one for every model, or one a "
                             f"model in the order of --models (default {CHUNK_SIZE})")
    parser.add_argument("--decode", choices=["cpu", "gpu"], default="gpu", help="embed's --decode (default gpu)")
    parser.add_argument("--share", action=argparse.BooleanOptionalAction, default=True,
                        help="also time one GPU with one rank's share of the CPUs at the largest N (default on)")
    parser.add_argument("--independent", action="store_true",
                        help="also run each N > 1 as N single-GPU embeds at once, without torchrun")
    parser.add_argument("--kill", action=argparse.BooleanOptionalAction, default=True,
                        help="kill -9 a rank of the first model's largest-N run, then resume it (default on)")
    parser.add_argument("--kill-chunks", type=int, default=24, help="chunks of paths the killed run embeds")
    parser.add_argument("--dir", default=None, help="working folder (default: a temporary one)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    gpus = [int(g) for g in args.gpus.split(",")]
    models = args.models.split(",")
    counts = [int(c) for c in args.num_images.split(",")]
    chunks = [int(c) for c in args.chunk_size.split(",")]
    chunks = chunks * len(models) if len(chunks) == 1 else chunks
    if len(counts) != len(models) or len(chunks) != len(models) or any(m not in MODELS for m in models):
        raise SystemExit(f"--models from {', '.join(MODELS)}, with one --num-images each, and one --chunk-size "
                         f"for all or one each")
    if any(c < 1 or c % BATCH for c in chunks):   # a chunk ending in a short batch: batches other runs do not make
        raise SystemExit(f"--chunk-size: positive multiples of {BATCH}, got {args.chunk_size}")
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

    def save() -> None:  # after every run: a call cut short keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))

    for model, count, chunk in zip(models, counts, chunks):
        checkpoint = make_checkpoint(root / MODELS[model], MODELS[model])
        inputs = root / f"{model}.txt"
        inputs.write_text("\n".join(paths[:count]) + "\n")
        warm = root / f"{model}-warm.txt"
        # full batches and the short one the last chunk ends with: every shape the timed runs meet
        warm.write_text("\n".join(paths[:3 * BATCH + count % chunk % BATCH]) + "\n")
        for n in sorted({1, max(gpus)}):  # compile and tune before anything is timed
            run(n, checkpoint, warm, root / f"{model}-warm-{n}.parquet", args.decode, chunk=chunk)
        runs: dict[str, dict] = {}
        results["models"][model] = entry = {"architecture": MODELS[model], "images": count, "chunk_size": chunk,
                                            "runs": runs}
        plan = ([(f"{model}-1", 1, None, False)]
                + ([(f"{model}-1-share", 1, rank_workers(max(gpus)), False)] if max(gpus) > 1 and args.share else [])
                + [(f"{model}-{n}", n, None, False) for n in gpus if n > 1]
                + [(f"{model}-{n}-independent", n, rank_workers(n), True) for n in gpus if n > 1 and args.independent])
        for name, n, workers, independent in plan:
            r = runs[name] = run(n, checkpoint, inputs, root / f"{name}.parquet", args.decode, workers, chunk,
                                 independent)
            one, same = runs[f"{model}-1"], runs.get(f"{model}-1-share", runs[f"{model}-1"])
            if independent:   # embed i holds the one-GPU output's rows of chunks i, i + n, ...
                r["output_equals_one_gpu"] = all(
                    pq.read_table(root / f"{name}-{i}.parquet").equals(reference.take(rank_rows(count, n, chunk, i)))
                    for i in range(n))
            else:
                table = pq.read_table(root / f"{name}.parquet")
                if name == f"{model}-1":   # the first run: the output every other one must equal
                    reference = table
                r["output_equals_one_gpu"] = table.equals(reference)
                if not r["output_equals_one_gpu"]:
                    r["difference"] = difference(table, reference, chunk)
            r["per_gpu_vs_one_gpu"] = r["images_per_s_per_gpu"] / one["images_per_s"]
            r["per_gpu_vs_one_gpu_same_workers"] = r["images_per_s_per_gpu"] / same["images_per_s"]
            if r["steady_images_per_s_per_gpu"] and one["steady_images_per_s_per_gpu"]:
                r["steady_per_gpu_vs_one_gpu"] = r["steady_images_per_s_per_gpu"] / one["steady_images_per_s_per_gpu"]
            ok &= r["output_equals_one_gpu"]
            print(name, json.dumps(r), flush=True)
            save()
        if model == models[0] and max(gpus) > 1 and args.kill:
            kept = min(count, args.kill_chunks * chunk)   # whole chunks: the same batches as the one-GPU run's
            prefix = root / f"{model}-kill.txt"
            prefix.write_text("\n".join(paths[:kept]) + "\n")
            killed = kill_and_resume(max(gpus), checkpoint, prefix, root / f"{model}-killed.parquet", args.decode,
                                     chunk)
            table = pq.read_table(root / f"{model}-killed.parquet")
            killed["output_equals_one_gpu"] = table.equals(reference.slice(0, kept))
            killed["rows"], killed["distinct_paths"] = table.num_rows, len(set(table.column("path").to_pylist()))
            ok &= killed["output_equals_one_gpu"] and killed["rows"] == killed["distinct_paths"] == kept
            print(json.dumps(killed), flush=True)
            entry["kill_and_resume"] = killed
            save()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
