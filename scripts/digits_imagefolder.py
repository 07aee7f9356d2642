"""scikit-learn's handwritten digits as an ImageFolder data set, for trying `vit-triton finetune` without a download.

load_digits is 1,797 real 8 x 8 grayscale scans of handwritten digits (UCI's optical recognition data set, 16 grey
levels), 10 classes, shipped inside scikit-learn. This writes each as a PNG, its levels stretched to 0-255 and
upscaled bicubically to --size pixels, into OUT_DIR/train/<digit>/ and OUT_DIR/val/<digit>/: of each digit a
random --val-fraction (drawn from --seed) goes to val. --per-class keeps only that many images of each digit
(before the split), for a short run.

    python scripts/digits_imagefolder.py OUT_DIR [--val-fraction 0.2] [--size 32] [--seed 0] [--per-class N]
    vit-triton finetune OUT_DIR/train --val OUT_DIR/val --model CHECKPOINT --output RUN_DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from PIL import Image


def write_digits(out: Path, val_fraction: float = 0.2, size: int = 32, seed: int = 0,
                 per_class: int | None = None) -> dict[str, int]:
    """Write the split; {"train": n, "val": m} images written."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise SystemExit('digits_imagefolder.py needs scikit-learn: pip install scikit-learn (or ".[test]")') from None
    digits = load_digits()
    rng = np.random.default_rng(seed)
    counts = {"train": 0, "val": 0}
    for digit in range(10):
        members = np.flatnonzero(digits.target == digit)[:per_class]
        order = rng.permutation(len(members))
        held = set(order[:round(val_fraction * len(members))].tolist())
        for k, i in enumerate(members):
            split = "val" if k in held else "train"
            folder = out / split / str(digit)
            folder.mkdir(parents=True, exist_ok=True)
            levels = (digits.images[i] * (255 / 16)).round().astype(np.uint8)
            Image.fromarray(levels, "L").resize((size, size), Image.Resampling.BICUBIC).save(folder / f"{i:04d}.png")
            counts[split] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", metavar="OUT_DIR", type=Path, help="folder to write train/ and val/ into")
    parser.add_argument("--val-fraction", type=float, default=0.2, help="of each digit, to val (default 0.2)")
    parser.add_argument("--size", type=int, default=32, help="side of the PNGs in pixels (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the split (default 0)")
    parser.add_argument("--per-class", type=int, default=None, help="at most this many images of each digit")
    args = parser.parse_args(argv)
    if not 0 <= args.val_fraction < 1 or args.size < 1 or (args.per_class is not None and args.per_class < 1):
        parser.error("--val-fraction must be in [0, 1), --size and --per-class at least 1")
    counts = write_digits(args.out, args.val_fraction, args.size, args.seed, args.per_class)
    print(f"wrote {counts['train']} training and {counts['val']} validation images of 10 digits under {args.out}/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
