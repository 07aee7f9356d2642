"""scikit-learn's handwritten digits learned by `vit-triton finetune` and by timm's own model with the same recipe,
from the same initial weights.

Writes the digits as an ImageFolder (digits_imagefolder.py), creates a ViT with timm (random weights drawn from
--seed, a 10-class head named 0-9) and saves it as timm saves a hub checkpoint, then

1. runs `vit-triton finetune` on it, as a user runs it (a subprocess), with the recipe below;
2. trains timm's model, loaded from the same files, with that run's own recipe (training/settings.json) on its own
   samples (training/data.json): the same batches in the same order with the same augmentation of each image
   (LabeledImages, EpochBatches), timm.optim's AdamW and timm.scheduler's cosine schedule stepped every optimizer
   step, cross entropy with label smoothing, drop path, the same precision; timm's forward and backward instead of
   vit-triton's.

Both runs write metrics.jsonl and curves.png (OUT/vit-triton/, OUT/timm/); OUT/summary.json holds each epoch's
validation top-1 of both, and OUT/curves.png draws them together. Run again on the same OUT, it continues the
vit-triton run where it stopped (finetune --resume) and trains timm's model again. Needs vit-triton installed with its
test extra (timm, scikit-learn, matplotlib).

    python scripts/digits_vs_timm.py OUT [--epochs 40] [--size 32] [--device cuda] [--seed 0] [--batch-size 64]
        [--depth 6] [--width 192] [--drop-path 0.1] [--per-class N] [--precision P]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from digits_imagefolder import write_digits  # noqa: E402

# By default a ViT-Tiny (192 wide, 3 heads) of 6 blocks over 4 x 4 patches: 64 tokens and a class token at 32 px.
MODEL = "vit_tiny_patch16_224"
# From random weights, so no layer decay; a mild crop (a digit is centred), no flip (a flipped digit is another).
RECIPE = ["--lr", "1e-3", "--warmup-epochs", "3", "--weight-decay", "0.05", "--layer-decay", "1", "--smoothing", "0.1",
          "--scale", "0.6", "1", "--ratio", "0.8", "1.25", "--hflip", "0", "--log-interval", "10"]


def model_args(size: int, depth: int, width: int) -> dict:
    """timm's create_model arguments: MODEL at `size` pixels, `depth` blocks `width` wide (64-wide heads), 10
    classes."""
    return dict(img_size=size, patch_size=4, depth=depth, embed_dim=width, num_heads=max(1, width // 64),
                num_classes=10)


def save_initial(directory: Path, args: dict, seed: int) -> None:
    """timm's model with random weights from `seed`, in timm's hub layout (config.json, model.safetensors)."""
    import timm
    from timm.models._hub import save_for_hf

    torch.manual_seed(seed)
    size = args["img_size"]
    model = timm.create_model(MODEL, pretrained=False, **args)
    save_for_hf(model, str(directory), model_config={"label_names": [str(d) for d in range(10)]},
                safe_serialization=True)
    config = json.loads((directory / "config.json").read_text())
    # What timm writes since 1.0.31 and older versions did not: the arguments it was created with, its input size.
    config["model_args"] = {**args, **config.get("model_args", {})}
    config["pretrained_cfg"]["input_size"] = [3, size, size]
    (directory / "config.json").write_text(json.dumps(config, indent=2))


def finetune_timm(checkpoint: Path, run: Path, out: Path, device: torch.device) -> list[dict]:
    """The recipe of the vit-triton run in `run` through timm's model loaded from `checkpoint`; its epochs' records."""
    import timm
    from safetensors.torch import load_file
    from torch.utils.data import DataLoader

    from vit_triton import from_pretrained
    from vit_triton.data import Preprocess
    from vit_triton.data.labeled import LabeledImages, Sample
    from vit_triton.pipelines.curves import Curves
    from vit_triton.pipelines.finetune import STATE, EpochBatches, augmentation, optimization

    s = json.loads((run / STATE / "settings.json").read_text())
    data = json.loads((run / STATE / "data.json").read_text())
    classes = data["classes"]
    train, val = ([Sample(*row) for row in data[k]] for k in ("train", "val"))
    pre = Preprocess.for_model(from_pretrained(str(checkpoint), device="cpu"))
    config = json.loads((checkpoint / "config.json").read_text())
    torch.manual_seed(s["seed"])
    model = timm.create_model(config["architecture"], pretrained=False, drop_path_rate=s["drop_path"],
                              drop_rate=s["drop"], **config["model_args"])
    model.load_state_dict(load_file(checkpoint / "model.safetensors"))
    dtype = torch.bfloat16 if s["precision"] == "bf16" else torch.float32
    model = model.to(device, dtype)
    per_epoch = len(train) // s["batch_size"]
    optimizer, scheduler = optimization(model, s, per_epoch)
    train_set = LabeledImages(train, classes, augmentation(pre, s), pre.channels, seed=s["seed"])
    val_set = LabeledImages(val, classes, pre.resize_crop, pre.channels)
    autocast = torch.autocast(device.type, torch.bfloat16, enabled=s["precision"] == "bf16-mixed")
    workers = min(4, max(1, (os.cpu_count() or 1) - 1))
    curves, step, records = Curves(out), 0, []
    out.mkdir(parents=True, exist_ok=True)
    curves.path.unlink(missing_ok=True)
    for epoch in range(s["epochs"]):
        started, total = time.perf_counter(), 0.0
        model.train()
        batches = EpochBatches(len(train), s["batch_size"], s["seed"], epoch, 0, 0, 1)
        for pixels, labels in DataLoader(train_set, batch_sampler=batches, num_workers=workers):
            pixels, labels = pre.normalize(pixels.to(device)).to(dtype), labels.to(device)
            with autocast:
                logits = model(pixels)
            loss = F.cross_entropy(logits.float(), labels, label_smoothing=s["smoothing"], reduction="sum")
            (loss / s["batch_size"]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            scheduler.step_update(step)
            total += loss.item()
        model.eval()
        val_loss = correct = 0.0
        with torch.no_grad():
            for pixels, labels in DataLoader(val_set, batch_size=s["batch_size"], num_workers=workers):
                pixels, labels = pre.normalize(pixels.to(device)).to(dtype), labels.to(device)
                with autocast:
                    logits = model(pixels).float()
                val_loss += F.cross_entropy(logits, labels, reduction="sum").item()
                correct += (logits.argmax(-1) == labels).sum().item()
        record = {"kind": "epoch", "epoch": epoch + 1, "step": step,
                  "train_loss": total / (per_epoch * s["batch_size"]), "val_loss": val_loss / len(val),
                  "val_top1": correct / len(val), "seconds": time.perf_counter() - started}
        curves.append(record)
        records.append(record)
        print(f"timm: epoch {epoch + 1}/{s['epochs']}: training loss {record['train_loss']:.4f}, validation top-1 "
              f"{100 * record['val_top1']:.2f}%", file=sys.stderr, flush=True)
    curves.plot()
    return records


def plot(out: Path, runs: dict[str, list[dict]]) -> None:
    import matplotlib.figure

    fig = matplotlib.figure.Figure(figsize=(6, 4))
    ax = fig.subplots()
    for name, records in runs.items():
        ax.plot([r["epoch"] for r in records], [100 * r["val_top1"] for r in records], "o-", markersize=3, label=name)
    ax.set(xlabel="epoch", ylabel="validation top-1 (%)", title="digits, the same recipe and initial weights")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.savefig(out / "curves.png", dpi=120, bbox_inches="tight")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, metavar="OUT", help="folder for the data, both runs and the summary")
    parser.add_argument("--epochs", type=int, default=40, help="epochs of both runs (default 40)")
    parser.add_argument("--size", type=int, default=32, help="image side in pixels (default 32)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split and the initial weights (default 0)")
    parser.add_argument("--per-class", type=int, default=None, help="at most this many images of each digit")
    parser.add_argument("--batch-size", type=int, default=64, help="images a step (default 64)")
    parser.add_argument("--depth", type=int, default=6, help="blocks (default 6)")
    parser.add_argument("--width", type=int, default=192, help="embedding width (default 192)")
    parser.add_argument("--drop-path", type=float, default=0.1, help="stochastic depth rate (default 0.1)")
    parser.add_argument("--precision", default=None, help="finetune's --precision (default its own)")
    args = parser.parse_args(argv)
    from vit_triton.pipelines.finetune import STATE

    run = args.out / "vit-triton"
    resume = (run / STATE / "settings.json").is_file()   # a run of this OUT stopped, or finished: continue it
    if not resume:
        write_digits(args.out / "digits", size=args.size, seed=args.seed, per_class=args.per_class)
        save_initial(args.out / "initial", model_args(args.size, args.depth, args.width), args.seed)
    command = [sys.executable, "-m", "vit_triton", "finetune", str(args.out / "digits" / "train"), "--val",
               str(args.out / "digits" / "val"), "--model", str(args.out / "initial"), "--output", str(run),
               "--epochs", str(args.epochs), "--device", args.device, "--no-progress", "--batch-size",
               str(args.batch_size), "--drop-path", str(args.drop_path), *RECIPE, *(["--resume"] if resume else [])]
    if args.precision:
        command += ["--precision", args.precision]
    subprocess.run(command, check=True)
    ours = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "epoch"]
    theirs = finetune_timm(args.out / "initial", run, args.out / "timm", torch.device(args.device))
    plot(args.out, {"vit-triton finetune": ours, "timm, the same recipe": theirs})
    summary = {"model": MODEL, "model_args": model_args(args.size, args.depth, args.width),
               "batch_size": args.batch_size, "drop_path": args.drop_path, "recipe": RECIPE,
               "epochs": args.epochs, "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "torch": torch.__version__,
               **{name: {"val_top1": [r["val_top1"] for r in records],
                         "epoch_seconds": [r["seconds"] for r in records]}
                  for name, records in (("vit-triton", ours), ("timm", theirs))}}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(f"validation top-1 after {args.epochs} epochs: vit-triton {100 * ours[-1]['val_top1']:.2f}%, timm "
          f"{100 * theirs[-1]['val_top1']:.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
