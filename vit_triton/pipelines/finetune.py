"""`vit-triton finetune`: fine-tune a checkpoint's ViT on labelled images into a new classifier, resumable after
any kill, on one process or several (torchrun, DistributedDataParallel).

The parts come from well-kept libraries: augmentation from torchvision.transforms.v2 (RandomResizedCrop and a
horizontal flip, then the checkpoint's own normalization), the optimizer from timm.optim (AdamW, parameter groups
with layer-wise learning-rate decay from the model's group_matcher and no_weight_decay), the schedule from
timm.scheduler (cosine with a linear warm-up, stepped every optimizer step), the loss torch's cross entropy with
label smoothing. Defaults are those of the fine-tuning literature (DeiT, MAE, BEiT).

OUT_DIR holds, as the run goes:

  training/settings.json  the settings that decide the result; --resume refuses other ones
  training/data.json      the classes and the samples of the training and validation sets, found by the scan
  training/checkpoint.pt  the last checkpoint (every --checkpoint-every steps and at each epoch's end, written
                          atomically): model, optimizer, scheduler, the position in the data order, each
                          process's random states
  metrics.jsonl, curves.png   the curves (curves.py)
  train.skipped.tsv, val.skipped.tsv   path and reason of each input that is not a readable labelled image
and at the end the model, written by loaders.save_pretrained in its source library's layout (config.json,
model.safetensors, ...): vit_triton.from_pretrained, transformers or timm, classify and embed load it.

Exactness. A run resumed from a checkpoint computes what the uninterrupted run did, bit for bit on a CPU: each
epoch's order is a permutation drawn from (seed, epoch), cut into global batches, and a resumed epoch starts at
the batch it stopped at; each image's augmentation is drawn from its own seed (seed, epoch, position), whatever
the worker or process that reads it; the random states that drop path and dropout draw from are saved and
restored; a checkpoint is written only between optimizer steps, where no gradient is pending.

Processes. --batch-size is global: under torchrun each of N processes takes batch_size / N images of every batch
(its consecutive slice), and DDP averages the gradients, each process's loss being scaled so that the average is
the mean over the whole batch. N processes therefore train what one does, up to the order of float additions.
Rank 0 writes every file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler

from ..data import Preprocess
from ..data.files import worker_init
from ..data.labeled import LabeledImages, Listing, Sample, class_names, list_sources, scan_source, split_validation
from ..data.sources import absolute
from ..loaders import from_pretrained
from ..utils import MissingExtra, require, write_atomic
from .curves import Curves
from .embed import from_rank0, resolve_device
from .store import UsageError, check_image_size, tsv_bytes

PRECISIONS = ("bf16-mixed", "bf16", "fp32")
SCHEDULES = ("cosine", "tanh")
GPU_BATCH_SIZE = 128    # the default --batch-size on a GPU (8 in the interpreter)
VAL_SPLIT = 0.1         # the default --val-split without --val
LR_PER_512 = 5e-4       # the default --lr: this per 512 images of an optimizer step (DeiT's rule)
STATE = "training"      # OUT_DIR's folder of training state
_CHECKPOINT, _SETTINGS, _DATA = "checkpoint.pt", "settings.json", "data.json"
_SKIPPED = ("train.skipped.tsv", "val.skipped.tsv")
# Options that do not change what a run computes: a resumed run may give other values.
_FREE = ("resume", "workers", "progress", "device", "checkpoint_every", "log_interval")


@dataclass(frozen=True)
class FinetuneOptions:
    """The options of `vit-triton finetune`, named as timm's train.py names them (see cli.py for each one's help)."""

    train: str
    model: str
    output: str
    val: str | None = None
    val_split: float | None = None       # default VAL_SPLIT without val; 0: no validation
    epochs: int = 10
    batch_size: int | None = None        # global; default GPU_BATCH_SIZE on a GPU, 8 in the interpreter
    grad_accum_steps: int = 1
    lr: float | None = None              # default LR_PER_512 * batch_size * grad_accum_steps / 512
    opt: str = "adamw"
    momentum: float = 0.9
    weight_decay: float = 0.05
    layer_decay: float | None = 0.75     # None: none
    sched: str = "cosine"
    warmup_epochs: int = 1
    warmup_lr: float = 1e-6
    min_lr: float = 1e-6
    drop_path: float = 0.1
    drop: float = 0.0
    smoothing: float = 0.1
    clip_grad: float | None = None
    scale: tuple[float, float] = (0.08, 1.0)
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    hflip: float = 0.5
    image_size: tuple[int, int] | None = None   # default: the checkpoint's
    linear_probe: bool = False
    grad_checkpointing: bool = False
    precision: str | None = None         # default bf16-mixed on a GPU, fp32 in the interpreter
    seed: int = 42
    workers: int | None = None           # default: this process's share of the CPUs, less one
    checkpoint_every: int = 500          # optimizer steps; 0: at each epoch's end only
    log_interval: int = 50
    resume: bool = False
    device: str | None = None
    progress: bool | None = None         # default: when stderr is a terminal
    cuda_graph: bool = True              # one process on a GPU without grad_checkpointing: each micro-batch replayed


@dataclass(frozen=True)
class FinetuneSummary:
    output: Path
    classes: int
    train_images: int
    val_images: int
    skipped: int               # inputs of TRAIN and VAL listed in the skipped files
    epochs: int
    steps: int
    val_top1: float | None     # of the last epoch, None without validation
    val_loss: float | None
    seconds: float             # this run's


def finetune(opts: FinetuneOptions, log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> FinetuneSummary | None:
    """Run (or with opts.resume continue) one fine-tuning; the summary on rank 0, None elsewhere.

    Raises UsageError for bad options or inputs (one class, an empty class folder, a class without a readable
    image, an image size the model cannot take, an OUT_DIR in use), CheckpointNotFound for a model that is not
    there, MissingExtra without torchvision, timm or matplotlib (the "train" extra)."""
    for module in ("torchvision.transforms.v2", "timm.optim", "matplotlib.figure"):
        require(module, "train", "vit-triton finetune")
    _check_options(opts)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(opts.device, int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        device = torch.device("cuda", torch.cuda.current_device())   # with its index, which DDP needs
    rank = 0
    if world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        rank = dist.get_rank()
    try:
        return _Run(opts, device, rank, world, log if rank == 0 else lambda msg: None).run()
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


def _check_options(opts: FinetuneOptions) -> None:
    checks = [
        ("--epochs", opts.epochs, opts.epochs >= 1, "at least 1"),
        ("--batch-size", opts.batch_size, opts.batch_size is None or opts.batch_size >= 1, "at least 1"),
        ("--grad-accum-steps", opts.grad_accum_steps, opts.grad_accum_steps >= 1, "at least 1"),
        ("--val-split", opts.val_split, opts.val_split is None or 0 <= opts.val_split < 1, "in [0, 1)"),
        ("--lr", opts.lr, opts.lr is None or opts.lr > 0, "positive"),
        ("--layer-decay", opts.layer_decay, opts.layer_decay is None or 0 < opts.layer_decay <= 1, "in (0, 1]"),
        ("--weight-decay", opts.weight_decay, opts.weight_decay >= 0, "at least 0"),
        ("--warmup-epochs", opts.warmup_epochs, 0 <= opts.warmup_epochs, "at least 0"),
        ("--drop-path", opts.drop_path, 0 <= opts.drop_path < 1, "in [0, 1)"),
        ("--drop", opts.drop, 0 <= opts.drop < 1, "in [0, 1)"),
        ("--smoothing", opts.smoothing, 0 <= opts.smoothing < 1, "in [0, 1)"),
        ("--clip-grad", opts.clip_grad, opts.clip_grad is None or opts.clip_grad > 0, "positive"),
        ("--scale", opts.scale, 0 < opts.scale[0] <= opts.scale[1] <= 1, "MIN MAX with 0 < MIN <= MAX <= 1"),
        ("--ratio", opts.ratio, 0 < opts.ratio[0] <= opts.ratio[1], "MIN MAX with 0 < MIN <= MAX"),
        ("--hflip", opts.hflip, 0 <= opts.hflip <= 1, "in [0, 1]"),
        ("--precision", opts.precision, opts.precision in (None, *PRECISIONS), f"one of {', '.join(PRECISIONS)}"),
        ("--sched", opts.sched, opts.sched in SCHEDULES, f"one of {', '.join(SCHEDULES)}"),
        ("--checkpoint-every", opts.checkpoint_every, opts.checkpoint_every >= 0, "at least 0"),
        ("--log-interval", opts.log_interval, opts.log_interval >= 1, "at least 1"),
        ("--workers", opts.workers, opts.workers is None or opts.workers >= 0, "at least 0"),
    ]
    for name, value, ok, expected in checks:
        if not ok:
            raise UsageError(f"{name} must be {expected}, got {value}")
    if opts.val is not None and opts.val_split:
        raise UsageError("--val and --val-split are two ways of choosing the validation images: give one")
    import timm.optim

    if opts.opt.lower() not in timm.optim.list_optimizers():
        raise UsageError(f"--opt {opts.opt}: not an optimizer of timm.optim (timm.optim.list_optimizers(): adamw, "
                         f"sgd, lamb, lion, ...)")


def _settings(opts: FinetuneOptions, on_gpu: bool, world: int) -> dict:
    """The options that decide the result, defaults resolved; INPUTs as absolute paths."""
    batch = opts.batch_size or (GPU_BATCH_SIZE if on_gpu else 8)
    settings = {k: v for k, v in dataclasses.asdict(opts).items() if k not in _FREE}
    settings.update(
        train=absolute(opts.train), val=opts.val and absolute(opts.val), batch_size=batch,
        val_split=VAL_SPLIT if opts.val is None and opts.val_split is None else opts.val_split or 0.0,
        lr=opts.lr or LR_PER_512 * batch * opts.grad_accum_steps / 512,
        precision=opts.precision or ("bf16-mixed" if on_gpu else "fp32"), processes=world,
        layer_decay=None if opts.layer_decay == 1 or opts.linear_probe else opts.layer_decay,
        image_size=list(opts.image_size) if opts.image_size else None, scale=list(opts.scale),
        ratio=list(opts.ratio))
    if batch % world:
        raise UsageError(f"--batch-size {batch} is global: it must be a multiple of the {world} processes, each taking "
                         f"an equal share of every batch")
    return settings


def augmentation(pre: Preprocess, settings: dict):
    """A training image's transform (PIL image -> uint8 [C, H, W]) under these settings (training/settings.json's):
    RandomResizedCrop to the model's size with its resampling filter, then a horizontal flip."""
    from torchvision.transforms import v2

    return v2.Compose([
        v2.RandomResizedCrop(pre.size, scale=tuple(settings["scale"]), ratio=tuple(settings["ratio"]),
                             interpolation=v2.InterpolationMode(pre.resample), antialias=True),
        v2.RandomHorizontalFlip(settings["hflip"]), v2.PILToTensor()])


def optimization(model: nn.Module, settings: dict, per_epoch: int):
    """(optimizer, scheduler) of `model` under these settings: timm.optim's optimizer with its parameter groups
    (layer-wise decay from the model's group_matcher), timm.scheduler's schedule stepped every optimizer step
    (`per_epoch` an epoch)."""
    import timm.optim
    import timm.scheduler

    s = settings
    optimizer = timm.optim.create_optimizer_v2(model, s["opt"], lr=s["lr"], weight_decay=s["weight_decay"],
                                               momentum=s["momentum"], layer_decay=s["layer_decay"])
    scheduler, _ = timm.scheduler.create_scheduler_v2(
        optimizer, sched=s["sched"], num_epochs=s["epochs"], warmup_epochs=s["warmup_epochs"],
        warmup_lr=s["warmup_lr"], min_lr=s["min_lr"], step_on_epochs=False, updates_per_epoch=per_epoch)
    return optimizer, scheduler


class EpochBatches(Sampler[list[tuple[int, int, int]]]):
    """This process's share of the micro-batches of one epoch, from micro-batch `start` on. The epoch's order is a
    permutation of the n training samples drawn from (seed, epoch), cut into global micro-batches of batch_size
    (a last partial one is dropped, as timm's training loader drops it); process `rank` of `world` takes the
    rank-th slice of batch_size / world of each. Items are (epoch, position in the order, sample index):
    LabeledImages seeds each image's augmentation from them."""

    def __init__(self, n: int, batch_size: int, seed: int, epoch: int, start: int, rank: int, world: int) -> None:
        self.n, self.batch_size, self.seed, self.epoch, self.start = n, batch_size, seed, epoch, start
        self.rank, self.world = rank, world

    def __iter__(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.n)
        share = self.batch_size // self.world
        for b in range(self.start, self.n // self.batch_size):
            first = b * self.batch_size + self.rank * share
            yield [(self.epoch, p, int(order[p])) for p in range(first, first + share)]

    def __len__(self) -> int:
        return self.n // self.batch_size - self.start


class _Classifier(nn.Module):
    """What DDP wraps: the model's logits; for a linear probe the backbone runs without autograd, at inference
    speed, and only the head is recorded."""

    def __init__(self, model: nn.Module, linear_probe: bool) -> None:
        super().__init__()
        self.model, self.linear_probe = model, linear_probe

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        if not self.linear_probe:
            return self.model(pixels)
        with torch.no_grad():
            features = self.model.forward_features(pixels)
        return self.model.forward_head(features)


class _CapturedStep:
    """_Trainer._forward_backward of one process as a CUDA graph: a micro-batch's forward, loss and backward, its
    ~300 kernels issued once by Python and replayed for every micro-batch (all have the training's batch size: a
    last partial one is dropped). Static buffers take each batch's pixels, labels and loss scale, and the loss;
    the backward adds into the parameters' gradients, which therefore stay allocated, zeroed between optimizer
    steps. Two eager micro-batches on a side stream first tune every kernel; their gradients and random draws are
    discarded (the CUDA generator's state is put back), so that a replay draws drop path's and dropout's numbers
    from the generator as an eager step would, and a resumed run's replays draw what the uninterrupted run's did."""

    def __init__(self, trainer: _Trainer, pixels: torch.Tensor, labels: torch.Tensor) -> None:
        self.trainer = trainer
        device = trainer.device
        self.pixels = torch.empty(pixels.shape, dtype=pixels.dtype, device=device)
        self.labels = torch.empty(labels.shape, dtype=labels.dtype, device=device)
        self.scale = torch.zeros((), device=device)
        self.pixels.copy_(pixels)
        self.labels.copy_(labels)
        kept = [p.grad for p in trainer.params]   # this step's earlier micro-batches' sums, if any
        random_state = torch.cuda.get_rng_state(device)
        for p in trainer.params:
            p.grad = torch.zeros_like(p)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._compute()
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        # thread-local: the DataLoader's pin-memory thread keeps calling CUDA while the forward is captured
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            self.loss = self._compute()
        torch.cuda.set_rng_state(random_state, device)
        for p, grad in zip(trainer.params, kept):
            if grad is None:
                p.grad.zero_()
            else:
                p.grad.copy_(grad)

    def _compute(self) -> torch.Tensor:
        t = self.trainer
        # autocast's cast weights must not be cached across replays: a step changes them in place
        mixed = t.s["precision"] == "bf16-mixed"
        autocast = torch.autocast(t.device.type, dtype=torch.bfloat16, enabled=mixed, cache_enabled=False)
        return t.loss_backward(self.pixels, self.labels, self.scale, autocast)

    def __call__(self, pixels: torch.Tensor, labels: torch.Tensor, scale: float) -> torch.Tensor:
        self.pixels.copy_(pixels, non_blocking=True)
        self.labels.copy_(labels, non_blocking=True)
        self.scale.fill_(scale)
        self.graph.replay()
        return self.loss.clone()


class _Scan(Dataset):
    def __init__(self, sources) -> None:
        self.sources = sources

    def __len__(self) -> int:
        return len(self.sources)

    def __getitem__(self, i: int):
        return scan_source(self.sources[i])


def _as_is(item):
    return item


def _random_states(device: torch.device) -> dict:
    """The random states of this process that training draws from, as plain bytes and numbers (which
    all_gather_object and torch.load(weights_only=True) carry)."""
    name, keys, *rest = np.random.get_state()
    return {"torch": torch.get_rng_state().numpy().tobytes(), "python": random.getstate(),
            "numpy": (name, keys.tolist(), *rest),
            "cuda": torch.cuda.get_rng_state(device).numpy().tobytes() if device.type == "cuda" else None}


def _set_random_states(states: dict, device: torch.device) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(states["torch"]), dtype=torch.uint8))
    random.setstate(states["python"])
    name, keys, *rest = states["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), *rest))
    if device.type == "cuda":
        torch.cuda.set_rng_state(torch.frombuffer(bytearray(states["cuda"]), dtype=torch.uint8), device)


class _Run:
    """One finetune command in one process."""

    def __init__(self, opts: FinetuneOptions, device: torch.device, rank: int, world: int, log) -> None:
        self.opts, self.device, self.rank, self.world, self.log = opts, device, rank, world, log
        self.settings = _settings(opts, device.type == "cuda", world)
        self.out = Path(opts.output)
        self.state = self.out / STATE
        self.curves = Curves(self.out)
        workers = opts.workers
        if workers is None:   # decoding and augmenting: every core of this process's share but its own
            workers = max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", world)) - 1)
        self.workers = workers

    # -- collectives, all no-ops in one process --

    def _gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def _sum(self, *values: torch.Tensor) -> list[torch.Tensor]:
        t = torch.stack([v.double() for v in values])
        if self.world > 1:
            import torch.distributed as dist

            dist.all_reduce(t)
        return list(t)

    # -- the run --

    def run(self) -> FinetuneSummary | None:
        start = time.perf_counter()
        _set_seed(self.opts.seed + self.rank)
        s = self.settings
        dtype = torch.bfloat16 if s["precision"] == "bf16" else torch.float32
        model = from_pretrained(self.opts.model, device=self.device, dtype=dtype, drop_path_rate=self.opts.drop_path,
                                drop_rate=self.opts.drop)
        check_image_size(model, self.opts.image_size)
        pre = Preprocess.for_model(model, self.opts.image_size)
        resumed = from_rank0(self._check_output, self.rank, self.world)
        classes, train, val, skipped = self._data(resumed)
        self._set_head(model, classes)
        checkpoint = None
        if resumed and (self.state / _CHECKPOINT).exists():
            checkpoint = torch.load(self.state / _CHECKPOINT, map_location="cpu", weights_only=True)
            model.load_state_dict(checkpoint["model"])
        if self.opts.linear_probe:
            model.requires_grad_(False)
            for head in (model.head, model.head_dist):
                if head is not None:
                    head.requires_grad_(True)
        if self.opts.grad_checkpointing:
            model.set_grad_checkpointing(True)
        steps = _Steps(len(train), s["batch_size"], self.opts.grad_accum_steps, self.opts.epochs)
        optimizer, scheduler = optimization(model, s, steps.per_epoch)
        trainer = _Trainer(self, model, pre, classes, train, val, steps, optimizer, scheduler)
        position = _Position(0, 0, 0, {})
        if checkpoint is not None:
            optimizer.load_state_dict(checkpoint["optimizer"])
            scheduler.load_state_dict(checkpoint["scheduler"])
            position = _Position(checkpoint["epoch"], checkpoint["micro"], checkpoint["step"], checkpoint["last"])
            trainer.restore(checkpoint["processes"][self.rank])
            if self.rank == 0:
                self.curves.truncate(checkpoint["metrics_bytes"])
        self._describe(model, classes, train, val, skipped, steps, position, resumed)
        last = trainer.train(position)
        if self.rank == 0:
            self._save_model(model)
        if self.world > 1:
            import torch.distributed as dist

            dist.barrier()   # the model is written before any process reports success
        if self.rank != 0:
            return None
        return FinetuneSummary(self.out, len(classes), len(train), len(val), skipped, self.opts.epochs,
                               steps.total, last.get("val_top1"), last.get("val_loss"),
                               time.perf_counter() - start)

    def _check_output(self) -> bool:
        """Rank 0: whether this run resumes one in OUT_DIR; a UsageError if OUT_DIR cannot take this run. A run
        exists once its scan succeeded (training/settings.json); before, OUT_DIR may hold the skipped-files lists
        of a scan that failed."""
        settings_file = self.state / _SETTINGS
        if self.opts.resume:
            if not settings_file.is_file():
                raise UsageError(f"--resume: {self.out} holds no fine-tuning run to continue ({settings_file} not "
                                 f"found)")
            saved = json.loads(settings_file.read_text())
            changed = {k: (saved.get(k), v) for k, v in self.settings.items() if saved.get(k) != v}
            if changed:
                raise UsageError(f"--resume: the run in {self.out} was started with other settings: " + "; ".join(
                    f"{k} {old!r} there, {new!r} now" for k, (old, new) in changed.items()))
            return True
        if settings_file.is_file():
            raise UsageError(f"--output {self.out} holds a fine-tuning run: --resume continues it; or choose another "
                             f"--output")
        if self.out.exists() and (not self.out.is_dir() or any(
                f.name not in _SKIPPED and f != self.state for f in self.out.iterdir())):
            raise UsageError(f"--output {self.out} is not an empty folder; choose another --output")
        return False

    # -- data --

    def _data(self, resumed: bool) -> tuple[list[str], list[Sample], list[Sample], int]:
        """(classes, training samples, validation samples, how many inputs were skipped): scanned once (skipped
        inputs listed in OUT_DIR's *.skipped.tsv), then read back from training/data.json."""
        data = from_rank0(lambda: json.loads((self.state / _DATA).read_text()), self.rank, self.world) if resumed \
            else self._scan()
        classes = data["classes"]
        train, val = ([Sample(*row) for row in data[k]] for k in ("train", "val"))
        return classes, train, val, data["skipped"]

    def _scan(self) -> dict:
        s = self.settings
        train, folders, skipped, listed = self._scan_input(self.opts.train, "TRAIN")
        classes = class_names(listed | {t.label for t in train}, folders)
        val, val_skipped = [], []
        if s["val"]:
            val, _, val_skipped, _ = self._scan_input(self.opts.val, "VAL")
        if self.rank == 0:   # first: an error below may send the user to them
            self.out.mkdir(parents=True, exist_ok=True)
            write_atomic(self.out / _SKIPPED[0], lambda f: f.write(tsv_bytes(skipped)))
            if s["val"]:
                write_atomic(self.out / _SKIPPED[1], lambda f: f.write(tsv_bytes(val_skipped)))
        self._check_classes(classes, train, skipped)
        unknown = class_names({v.label for v in val} - set(classes))
        if unknown:
            raise UsageError(f"VAL {self.opts.val}: classes that TRAIN does not have: {', '.join(unknown[:5])}" +
                             (f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""))
        if s["val_split"]:
            train, val = split_validation(train, s["val_split"], s["seed"])
        if len(train) < s["batch_size"]:
            raise UsageError(f"--batch-size {s['batch_size']} is more than the {len(train)} training images: an "
                             f"epoch would have no batch")
        data = {"classes": classes, "train": [dataclasses.astuple(t) for t in train],
                "val": [dataclasses.astuple(v) for v in val], "skipped": len(skipped) + len(val_skipped)}
        if self.rank == 0:   # the run exists from here on: its data, then its settings
            self.state.mkdir(parents=True, exist_ok=True)
            write_atomic(self.state / _DATA, lambda f: f.write(json.dumps(data).encode()))
            write_atomic(self.state / _SETTINGS, lambda f: f.write(json.dumps(self.settings, indent=1).encode()))
        return data

    def _scan_input(self, spec: str, what: str) -> tuple[list[Sample], bool, list[tuple[str, str]], set[str]]:
        """(the readable labelled images of INPUT `spec`, whether its labels are folder names, (name, reason) of the
        inputs left out, the labels its listing gives): rank 0 lists it, every process decodes its share of the
        files and shards."""
        def listing() -> Listing:
            try:
                return list_sources(spec)
            except (FileNotFoundError, ValueError, MissingExtra) as e:
                raise UsageError(f"{what} {str(e).removeprefix('INPUT ')}") from None

        sources, outside, folders = from_rank0(listing, self.rank, self.world)
        mine = _Scan(sources[self.rank::self.world])
        from tqdm import tqdm

        workers = min(self.workers, len(mine))
        loader = DataLoader(mine, batch_size=None, collate_fn=_as_is, num_workers=workers,
                            worker_init_fn=functools.partial(worker_init, os.getpid()) if workers else None)
        bar = tqdm(loader, total=len(mine), unit="file", desc=f"scan {what}", disable=not self._progress,
                   dynamic_ncols=True)
        shares = self._gather(list(bar))
        samples, skipped = [], list(outside)
        for i in range(len(sources)):   # back in the sources' order
            found, left = shares[i % self.world][i // self.world]
            # named as INPUT names them, read from where they are whatever the current directory of a resumed run
            samples += [dataclasses.replace(f, path=absolute(f.path)) for f in found]
            skipped += left
        return samples, folders, skipped, {src.label for src in sources if src.label is not None}

    def _check_classes(self, classes: list[str], train: list[Sample], skipped: list) -> None:
        listed = f"; {len(skipped)} input(s) skipped, listed in {self.out / 'train.skipped.tsv'}" if skipped else ""
        if len(classes) < 2:
            found = f"1 class ({classes[0]})" if classes else "no readable labelled image"
            raise UsageError(f"TRAIN {self.opts.train}: found {found}: a classifier needs at least 2 classes{listed}")
        found = {t.label for t in train}
        empty = [c for c in classes if c not in found]
        if empty:
            raise UsageError(f"TRAIN {self.opts.train}: class {empty[0]!r}" +
                             (f" (and {len(empty) - 1} more)" if len(empty) > 1 else "") +
                             f" has no readable image{listed}")

    @property
    def _progress(self) -> bool:
        show = self.opts.progress if self.opts.progress is not None else sys.stderr.isatty()
        return show and self.rank == 0

    # -- the model --

    def _set_head(self, model, classes: list[str]) -> None:
        """A new head of the classes found, unless the checkpoint's classifier already has these labels in this
        order (a fine-tuned model trained on); the labels become the checkpoint's id2label."""
        labels = dict(enumerate(classes))
        info = model.checkpoint
        self.new_head = model.head is None or info.id2label != labels
        if self.new_head:
            model.reset_classifier(len(classes))
        model.checkpoint = dataclasses.replace(info, id2label=labels)

    def _describe(self, model, classes, train, val, skipped, steps: _Steps, position, resumed: bool) -> None:
        s = self.settings
        validation = (f"{len(val)} images of VAL" if s["val"] else
                      f"{len(val)} images held out of TRAIN (--val-split {s['val_split']})" if val else "none")
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        head = f"a new head of {len(classes)} classes" if self.new_head else "its own head (the same classes)"
        self.log(f"vit-triton finetune: {len(train)} training images of {len(classes)} classes, validation: "
                 f"{validation}; {skipped} input(s) skipped (listed in {self.out}/*.skipped.tsv)")
        self.log(f"vit-triton finetune: {model.checkpoint.architecture} with {head}, {trainable:,} of {total:,} "
                 f"parameters trained{' (linear probe)' if self.opts.linear_probe else ''}; {s['precision']}; batch "
                 f"{s['batch_size']}" + (f" ({s['batch_size'] // self.world} a process)" if self.world > 1 else "") +
                 (f" x {steps.accum} accumulated" if steps.accum > 1 else "") +
                 f"; {s['opt']} lr {s['lr']:.3g}; {steps.per_epoch} steps an epoch, {steps.total} in all")
        if position.step == steps.total:
            self.log(f"vit-triton finetune: the run in {self.out} is finished: writing its model again")
        elif resumed:
            self.log(f"vit-triton finetune: resuming {self.out} at step {position.step} of {steps.total} (epoch "
                     f"{position.epoch + 1})")

    def _save_model(self, model) -> None:
        """The model in its source library's layout, into OUT_DIR beside the training files (each file written
        atomically; a run killed while writing them writes them again when resumed)."""
        from ..loaders import save_pretrained

        save_pretrained(model, self.out)


def _set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass(frozen=True)
class _Position:
    """Where a run is: epochs done, micro-batches of the next epoch done, optimizer steps done, and the metrics of
    the last epoch done."""

    epoch: int
    micro: int
    step: int
    last: dict


@dataclass(frozen=True)
class _Steps:
    """The arithmetic of an epoch: micro-batches (full ones), optimizer steps of `accum` micro-batches (the last
    one of an epoch may have fewer)."""

    images: int
    batch_size: int
    accum: int
    epochs: int

    @property
    def micro(self) -> int:
        return self.images // self.batch_size

    @property
    def per_epoch(self) -> int:
        return math.ceil(self.micro / self.accum)

    @property
    def total(self) -> int:
        return self.per_epoch * self.epochs

    def in_step(self, micro: int) -> int:
        """How many micro-batches the optimizer step of micro-batch `micro` (of its epoch) accumulates."""
        return min(self.accum, self.micro - micro // self.accum * self.accum)


class _Trainer:
    """The training of one process: its share of the data, the model wrapped for DDP, the optimizer steps,
    validation and checkpoints."""

    def __init__(self, run: _Run, model, pre: Preprocess, classes, train, val, steps: _Steps, optimizer,
                 scheduler) -> None:
        self.run, self.model, self.pre, self.steps = run, model, pre, steps
        self.optimizer, self.scheduler = optimizer, scheduler
        s, device = run.settings, run.device
        self.s, self.device = s, device
        self.train_set = LabeledImages(train, classes, augmentation(pre, s), pre.channels, seed=s["seed"])
        self.val_set = LabeledImages(val[run.rank::run.world], classes, pre.resize_crop, pre.channels)
        self.val_images = len(val)
        self.net = _Classifier(model, s["linear_probe"])
        if run.world > 1:
            from torch.nn.parallel import DistributedDataParallel

            self.net = DistributedDataParallel(self.net, device_ids=[device.index] if device.type == "cuda" else None)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.autocast = (torch.autocast(device.type, dtype=torch.bfloat16) if s["precision"] == "bf16-mixed"
                         else contextlib.nullcontext())
        self.epoch_loss = torch.zeros((), dtype=torch.float64, device=device)
        # Captured on the first micro-batch: an eager step on a GPU waits on Python (68 ms against 36 for ViT-B/16
        # in bf16 on an H200). DDP's gradient hooks and checkpointing's recomputation stay eager.
        self.graphed = (run.opts.cuda_graph and device.type == "cuda" and run.world == 1
                        and not run.opts.grad_checkpointing)
        self.captured: _CapturedStep | None = None

    def restore(self, process: dict) -> None:
        """This process's state at the checkpoint: its random states, its share of the epoch's loss so far."""
        _set_random_states(process["random"], self.device)
        self.epoch_loss.fill_(process["epoch_loss"])

    def _loader(self, dataset, **kw) -> DataLoader:
        workers = self.run.workers
        # Its own generator: the DataLoader's base seed must not be drawn from the random state saved in checkpoints.
        return DataLoader(dataset, num_workers=workers, pin_memory=self.device.type == "cuda",
                          worker_init_fn=functools.partial(worker_init, os.getpid()) if workers else None,
                          generator=torch.Generator().manual_seed(self.s["seed"]), **kw)

    def train(self, position: _Position) -> dict:
        """From `position` to the end; the last epoch's metrics."""
        from tqdm import tqdm

        run, steps, s = self.run, self.steps, self.s
        micro, step, last = position.micro, position.step, position.last
        for epoch in range(position.epoch, s["epochs"]):
            started = time.perf_counter()
            batches = EpochBatches(steps.images, s["batch_size"], s["seed"], epoch, micro, run.rank, run.world)
            bar = tqdm(total=steps.per_epoch, initial=micro // steps.accum, unit="step", disable=not run._progress,
                       desc=f"epoch {epoch + 1}/{s['epochs']}", dynamic_ncols=True)
            self._train_mode()
            step_loss = torch.zeros((), dtype=torch.float64, device=self.device)
            clock, images = time.perf_counter(), 0
            for pixels, labels in self._loader(self.train_set, batch_sampler=batches):
                in_step = steps.in_step(micro)
                micro += 1
                ends_step = micro % steps.accum == 0 or micro == steps.micro
                loss = self._forward_backward(pixels, labels, in_step, ends_step)
                step_loss += loss
                self.epoch_loss += loss
                images += len(labels) * run.world
                if not ends_step:
                    continue
                lr = self._lr()
                step += 1
                self._step(step)
                bar.update()
                if step % run.opts.log_interval == 0 or micro == steps.micro:
                    (total,) = run._sum(step_loss)
                    record = {"kind": "step", "epoch": epoch + 1, "step": step,
                              "loss": total.item() / (in_step * s["batch_size"]), "lr": lr,
                              "images_per_s": images / (time.perf_counter() - clock)}
                    bar.set_postfix(loss=f"{record['loss']:.4f}", lr=f"{record['lr']:.2e}",
                                    img_s=f"{record['images_per_s']:.1f}")
                    if run.rank == 0:
                        run.curves.append(record)
                    clock, images = time.perf_counter(), 0
                step_loss.zero_()
                every = run.opts.checkpoint_every
                if every and step % every == 0 and micro < steps.micro:
                    self._checkpoint(_Position(epoch, micro, step, last))
            bar.close()
            last = self._end_epoch(epoch, step, time.perf_counter() - started)
            micro = 0
            self._checkpoint(_Position(epoch + 1, 0, step, last))
        return last

    def _train_mode(self) -> None:
        # A linear probe's frozen backbone runs as at inference (no drop path, no dropout).
        self.model.train(not self.s["linear_probe"])

    def _forward_backward(self, pixels, labels, in_step: int, ends_step: bool) -> torch.Tensor:
        """One micro-batch's forward and backward; its summed loss (float64, detached). Each process's loss is
        scaled by processes / (images of the optimizer step), so that DDP's average of the gradients is the mean
        over the step's images; gradients are synchronised once a step (no_sync before)."""
        scale = self.run.world / (in_step * self.s["batch_size"])
        if self.graphed:
            if self.captured is None:
                self.captured = _CapturedStep(self, pixels, labels)
            return self.captured(pixels, labels, scale)
        sync = self.run.world == 1 or ends_step
        with contextlib.nullcontext() if sync else self.net.no_sync():
            return self.loss_backward(pixels.to(self.device, non_blocking=True),
                                      labels.to(self.device, non_blocking=True), scale, self.autocast)

    def loss_backward(self, pixels, labels, scale, autocast) -> torch.Tensor:
        """The summed cross-entropy of the micro-batch's uint8 pixels and labels (on the device), its backward scaled by
        `scale` (a float, or a captured step's tensor) under `autocast`; the loss detached, in float64."""
        pixels = self.pre.normalize(pixels)
        with autocast:
            logits = self.net(pixels)
        loss = F.cross_entropy(logits.float(), labels, label_smoothing=self.s["smoothing"], reduction="sum")
        (loss * scale).backward()
        return loss.detach().double()

    def _step(self, step: int) -> None:
        """The optimizer step that makes `step` steps, and the learning rate of the next one."""
        if self.s["clip_grad"] is not None:
            nn.utils.clip_grad_norm_(self.params, self.s["clip_grad"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=not self.graphed)   # a captured backward adds into the same tensors
        self.scheduler.step_update(step)

    def _lr(self) -> float:
        return max(group["lr"] for group in self.optimizer.param_groups)

    def _end_epoch(self, epoch: int, step: int, seconds: float) -> dict:
        run, s = self.run, self.s
        (train_loss,) = run._sum(self.epoch_loss)
        self.epoch_loss.zero_()
        val_loss = val_top1 = None
        if self.val_images:
            val_loss, val_top1 = self.validate()
        record = {"kind": "epoch", "epoch": epoch + 1, "step": step,
                  "train_loss": train_loss.item() / (self.steps.micro * s["batch_size"]),
                  "val_loss": val_loss, "val_top1": val_top1, "seconds": seconds}
        validated = (f", validation loss {val_loss:.4f}, top-1 {100 * val_top1:.2f}% of {self.val_images}"
                     if val_top1 is not None else "")
        run.log(f"vit-triton finetune: epoch {epoch + 1}/{s['epochs']}: training loss {record['train_loss']:.4f}"
                f"{validated} ({seconds:.1f} s)")
        if run.rank == 0:
            run.curves.append(record)
            run.curves.plot()
        return record

    def validate(self) -> tuple[float, float]:
        """(mean cross entropy, top-1) over the validation images, each process evaluating its share."""
        self.model.eval()
        loss = torch.zeros((), dtype=torch.float64, device=self.device)
        correct = torch.zeros((), dtype=torch.float64, device=self.device)
        share = max(1, self.s["batch_size"] // self.run.world)
        with torch.no_grad():
            for pixels, labels in self._loader(self.val_set, batch_size=share):
                pixels = self.pre.normalize(pixels.to(self.device, non_blocking=True))
                labels = labels.to(self.device, non_blocking=True)
                with self.autocast:
                    logits = self.model(pixels).float()
                loss += F.cross_entropy(logits, labels, reduction="sum").double()
                correct += (logits.argmax(-1) == labels).sum().double()
        self._train_mode()
        loss, correct = self.run._sum(loss, correct)
        return loss.item() / self.val_images, correct.item() / self.val_images

    def _checkpoint(self, at: _Position) -> None:
        """Every process's state at this point between optimizer steps; rank 0 writes it with the model, the
        optimizer and the scheduler, atomically."""
        processes = self.run._gather({"random": _random_states(self.device), "epoch_loss": self.epoch_loss.item()})
        if self.run.rank != 0:
            return
        payload = {"epoch": at.epoch, "micro": at.micro, "step": at.step, "last": at.last,
                   "model": self.model.state_dict(),
                   "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                   "processes": processes, "metrics_bytes": self.run.curves.length()}
        write_atomic(self.run.state / _CHECKPOINT, lambda f: torch.save(payload, f))
