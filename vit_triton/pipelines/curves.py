"""A fine-tuning run's curves: metrics.jsonl (one JSON object a line, appended as the run goes) and its plot,
curves.png.

Lines are {"kind": "step", "epoch", "step", "loss", "lr", "images_per_s"} every --log-interval optimizer steps
(loss: the mean over that step's images; lr: the largest of the parameter groups', the head's) and {"kind":
"epoch", "epoch", "step", "train_loss", "val_loss", "val_top1", "seconds"} at each epoch's end (val_* null without
validation). A checkpoint records the file's length, and a resumed run cuts the lines written after it, so that
each step is in the file once.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..utils import require, write_atomic


class Curves:
    def __init__(self, directory: Path) -> None:
        self.path, self.plot_path = directory / "metrics.jsonl", directory / "curves.png"

    def length(self) -> int:
        """The file's length in bytes, what a checkpoint records."""
        return self.path.stat().st_size if self.path.exists() else 0

    def truncate(self, length: int) -> None:
        """Cut the lines written after a checkpoint that recorded `length`."""
        with open(self.path, "ab") as f:
            f.truncate(length)

    def append(self, record: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def records(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line]

    def plot(self) -> None:
        """curves.png: the loss (training steps, and each epoch's training and validation mean) and the learning
        rate against the step, the validation top-1 against the epoch."""
        figure = require("matplotlib.figure", "train", "vit-triton finetune's curves.png")
        records = self.records()
        steps = [r for r in records if r["kind"] == "step"]
        epochs = [r for r in records if r["kind"] == "epoch"]
        fig = figure.Figure(figsize=(13, 4))
        loss, top1, lr = fig.subplots(1, 3)
        loss.plot([r["step"] for r in steps], [r["loss"] for r in steps], color="tab:blue", alpha=0.5, linewidth=1,
                  label="training (step)")
        loss.plot([r["step"] for r in epochs], [r["train_loss"] for r in epochs], "o-", color="tab:blue",
                  label="training (epoch)")
        validated = [r for r in epochs if r["val_loss"] is not None]
        loss.plot([r["step"] for r in validated], [r["val_loss"] for r in validated], "o-", color="tab:orange",
                  label="validation")
        loss.set(xlabel="step", ylabel="loss", title="loss")
        loss.legend(fontsize=8)
        top1.plot([r["epoch"] for r in validated], [100 * r["val_top1"] for r in validated], "o-", color="tab:green")
        top1.set(xlabel="epoch", ylabel="%", title="validation top-1")
        lr.plot([r["step"] for r in steps], [r["lr"] for r in steps], color="tab:purple")
        lr.set(xlabel="step", ylabel="learning rate", title="learning rate (head)")
        for ax in (loss, top1, lr):
            ax.grid(alpha=0.3)
        fig.tight_layout()
        write_atomic(self.plot_path, lambda f: fig.savefig(f, format="png", dpi=100))
