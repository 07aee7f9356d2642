"""Image files as a stream of pixel batches: which files an INPUT names, and a Dataset that decodes
and resizes them (in DataLoader workers), turning unreadable files into reasons instead of errors."""

from __future__ import annotations

import ctypes
import glob
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image
from torch.utils.data import Dataset

from .decode import UnreadableImage, load_image
from .preprocess import Preprocess

_GLOB_CHARS = "*?["
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def list_inputs(spec: str) -> list[str]:
    """The files INPUT names, in a fixed order.

    A directory: every file under it, recursively, sorted, hidden files and directories (".name")
    left out; non-images among them are listed as skipped later, not dropped silently. A file with
    an image suffix: that one image. Another file: a list of paths, one per line (relative paths
    are relative to the current directory). Anything else with * ? or [: a glob pattern (** spans
    directories). Raises FileNotFoundError if INPUT is none of these or names no file.
    """
    path = Path(spec)
    if path.is_dir():
        files = []
        for root, dirs, names in os.walk(path, followlinks=True):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            files += [os.path.join(root, n) for n in sorted(names) if not n.startswith(".")]
    elif path.is_file():
        if path.suffix.lower() in Image.registered_extensions():
            return [spec]
        with open(path, encoding="utf-8") as f:
            files = [line.rstrip("\r\n") for line in f if line.strip()]
    elif any(c in spec for c in _GLOB_CHARS):
        files = sorted(p for p in glob.glob(spec, recursive=True) if not os.path.isdir(p))
    else:
        raise FileNotFoundError(f"INPUT {spec}: no such file or directory, and not a glob pattern")
    if not files:
        raise FileNotFoundError(f"INPUT {spec}: names no files")
    return files


@dataclass
class Batch:
    """Decoded images of one batch: uint8 pixels [n, C, H, W] of the readable ones, in order, with
    their indices in the input list; the unreadable ones as (index, reason)."""

    indices: list[int]
    pixels: torch.Tensor
    skipped: list[tuple[int, str]]

    def pin_memory(self) -> Batch:  # called by DataLoader(pin_memory=True) in its pinning thread
        self.pixels = self.pixels.pin_memory()
        return self


class ImageFiles(Dataset):
    """Item i: (i, uint8 pixels [C, H, W] resized and cropped by `preprocess`, or None, reason or None)."""

    def __init__(self, paths: list[str], preprocess: Preprocess) -> None:
        self.paths = paths
        self.preprocess = preprocess
        self.mode = "L" if preprocess.channels == 1 else "RGB"

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor | None, str | None]:
        try:
            image = load_image(self.paths[index], self.mode)
        except UnreadableImage as e:
            return index, None, str(e)
        return index, self.preprocess.resize_crop(image), None

    def collate(self, items: list[tuple[int, torch.Tensor | None, str | None]]) -> Batch:
        good = [(i, p) for i, p, _ in items if p is not None]
        c, (h, w) = self.preprocess.channels, self.preprocess.size
        pixels = torch.stack([p for _, p in good]) if good else torch.empty(0, c, h, w, dtype=torch.uint8)
        return Batch([i for i, _ in good], pixels, [(i, reason) for i, p, reason in items if p is None])


def worker_init(main_pid: int, _: int) -> None:
    """worker_init_fn, with the DataLoader's process bound as main_pid (functools.partial): one thread per
    worker, the parallelism being across workers; on Linux the worker dies with its parent, which it would
    otherwise outlive after a kill -9 (blocked on a slow file, say)."""
    torch.set_num_threads(1)
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        try:
            os.kill(main_pid, 0)  # still there? If it died before prctl, no signal will come
        except ProcessLookupError:
            os._exit(1)
