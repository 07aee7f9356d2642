"""What this design could reach with cuBLAS's GEMMs and epilogues that cost nothing, beside the peers (CUDA only).

The bound: vit-triton's forward with every linear layer replaced by cuBLAS's F.linear with the bias alone (no
activation, no residual add, so the GEMM epilogues cost nothing), its own attention, LayerNorm and patch
embedding kept. Its output is not a ViT's (it only times the same work); vit-triton's real forward and
torch.compile(timm) run beside it in one process, each replayed as a CUDA graph (the compiled peers as their mode
runs them), timed as `vit-triton bench` times (median of CUDA events, 100 ms warm-up, 400 ms), in rounds of
alternating order, then each for 1.5 s at a stretch with the board's energy (bench/power.py). A target above the
bound's speed-up needs GEMMs faster than cuBLAS's or attention and LayerNorm faster than ours.

    python scripts/design_bound.py [--model vit_base_patch16_224] [--batch-sizes 32,256]
        [--modes reduce-overhead,max-autotune-no-cudagraphs@256] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics

import torch
import torch.nn.functional as F
import triton
import triton.testing

import vit_triton.model.layers as layers_module
from vit_triton.bench.numerics import randomize_
from vit_triton.bench.power import Board
from vit_triton.bench.systems import COMPILE_MODES, allow_recompiles, timm_model
from vit_triton.utils import batch_sizes
from vit_triton.model import PRESETS, ViT
from vit_triton.runtime import CUDAGraphRunner

SUSTAINED_S = 1.5


def cublas_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, **_) -> torch.Tensor:
    """x @ weight.T + bias by cuBLAS; the activation, residual and scale that vit_triton's linear takes are dropped."""
    return F.linear(x, weight, bias)


def graph_replay(model: ViT, pixels: torch.Tensor, linear) -> tuple[CUDAGraphRunner, object]:
    """(runner, replay) of the model's forward captured with `linear` as its GEMM; the runner holds the graph's
    buffers and must be kept while the replay is used."""
    real = layers_module.linear
    layers_module.linear = linear
    try:
        runner = CUDAGraphRunner(model)
        runner.capture(tuple(pixels.shape), pixels.dtype)
    finally:
        layers_module.linear = real
    return runner, runner.graph(tuple(pixels.shape), pixels.dtype).replay


def measure(model_name: str, batch: int, modes: list[str], rounds: int, board: Board) -> list[dict]:
    """One row per system at this batch size: ms (bench timing, median over rounds), speed-up against the best
    peer, and the sustained run's ms, mJ an image, W and SM clock."""
    cfg = PRESETS[model_name]
    dev, dtype = torch.device("cuda"), torch.bfloat16
    pixels = torch.randn(batch, cfg.in_chans, cfg.image_size, cfg.image_size, device=dev).to(dtype)
    ours = randomize_(ViT(cfg, device=dev)).to(dtype).eval()
    held, runs = [], {}   # held: the runners, which keep their graphs' buffers
    for name, linear in (("vit-triton+cudagraph", layers_module.linear),
                         ("bound: cuBLAS GEMMs, free epilogues", cublas_linear)):
        runner, runs[name] = graph_replay(ours, pixels, linear)
        held.append(runner)
    for mode in modes:
        peer = torch.compile(randomize_(timm_model(cfg)).to(dev, dtype).eval(), mode=mode, dynamic=False)
        with torch.inference_mode():
            peer(pixels)   # compiles
            peer(pixels)   # reduce-overhead records its graphs on the second call
        runs[f"timm+compile:{mode}"] = (lambda p: lambda: p(pixels))(peer)
    times = {name: [] for name in runs}
    with torch.inference_mode():
        for r in range(rounds):
            for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
                times[name].append(triton.testing.do_bench(runs[name], warmup=100, rep=400, return_mode="median"))
        spent = {name: board.sustained(run, SUSTAINED_S) for name, run in runs.items()}
    peers = [statistics.median(t) for name, t in times.items() if name.startswith("timm")]
    best = min(peers) if peers else None
    rows = []
    for name, t in times.items():
        ms = statistics.median(t)
        rows.append(dict(model=model_name, batch=batch, system=name, ms=ms, rounds_ms=t,
                         speedup=best / ms if best else None,
                         sustained_ms=spent[name]["ms"], mj_per_image=1000 * spent[name]["joules"] / batch,
                         watts=spent[name]["watts"], sm_mhz=spent[name]["sm_mhz"]))
    return rows


def round_count(text: str) -> int:
    if not re.fullmatch(r"[1-9]\d*", text):
        raise argparse.ArgumentTypeError(f"--rounds must be a positive integer, got {text!r}")
    return int(text)


def peer_modes(text: str) -> list[tuple[str, int | None]]:
    """(mode, batch or None for every batch) for each MODE or MODE@BATCH."""
    modes = []
    for item in text.split(","):
        mode, _, batch = item.partition("@")
        if mode not in COMPILE_MODES or (batch and not re.fullmatch(r"[1-9]\d*", batch)):
            raise argparse.ArgumentTypeError(f"--modes takes MODE or MODE@BATCH with MODE one of {COMPILE_MODES}, "
                                             f"got {item!r}")
        modes.append((mode, int(batch) if batch else None))
    return modes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_base_patch16_224", choices=sorted(PRESETS))
    parser.add_argument("--batch-sizes", type=batch_sizes, default=[32, 256])
    parser.add_argument("--modes", type=peer_modes,
                        default=peer_modes("reduce-overhead,max-autotune-no-cudagraphs@256"),
                        help="torch.compile modes of the peers; MODE@B times that mode at batch B only")
    parser.add_argument("--rounds", type=round_count, default=3)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, "design_bound needs a CUDA device\n")
    board = Board(torch.device("cuda"))
    allow_recompiles()
    rows = []
    for batch in args.batch_sizes:
        modes = [mode for mode, only in args.modes if only in (None, batch)]
        rows += measure(args.model, batch, modes, args.rounds, board)
        for row in rows[-len(modes) - 2:]:
            against = f"{row['speedup']:5.3f}x the best peer" if row["speedup"] else "no peer at this batch"
            print(f"{args.model} {batch:4d}  {row['system']:38s} {row['ms']:8.3f} ms  {against}  sustained "
                  f"{row['sustained_ms']:8.3f} ms {row['mj_per_image']:7.2f} mJ an image {row['watts']:4.0f} W "
                  f"{row['sm_mhz']:5.0f} MHz", flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
