"""Small helpers that every layer may use and that import nothing heavy: the command line's argument types,
atomic file writes, and the message for a missing optional dependency."""

from __future__ import annotations

import argparse
import importlib
import os
import re
from pathlib import Path


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the pip command that installs it."""


def require(module: str, extra: str, purpose: str):
    """import_module(module), or MissingExtra naming the extra of vit-triton that brings it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(f"{purpose} needs {module.split('.')[0]}, which is not installed: "
                           f'pip install "vit-triton[{extra}]"') from None


def write_atomic(path: Path, write) -> None:
    """write(file) into a temporary file beside `path`, flushed to disk, then renamed onto it."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# argparse types: a bad value becomes argparse's usage error (exit 2) naming the option and what it expects.
def positive_int(text: str) -> int:
    """An integer of at least 1."""
    if not re.fullmatch(r"\s*\+?\d+\s*", text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def natural_int(text: str) -> int:
    """An integer of at least 0."""
    if not re.fullmatch(r"\s*\+?\d+\s*", text):
        raise argparse.ArgumentTypeError(f"expected an integer of at least 0, got {text!r}")
    return int(text)


def image_size(text: str) -> tuple[int, int]:
    """An --image-size value: N (a square) or HxW, positive integers, as (height, width)."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:[xX]\s*(\d+)\s*)?", text)
    if not match or int(match.group(1)) < 1 or int(match.group(2) or 1) < 1:
        raise argparse.ArgumentTypeError(f"expected an image size N or HxW (height x width, positive integers), "
                                         f"got {text!r}")
    height = int(match.group(1))
    return height, int(match.group(2) or height)


def batch_sizes(text: str) -> list[int]:
    """A --batch-sizes value: comma-separated positive integers, in order."""
    if not re.fullmatch(r"\d+(,\d+)*", text) or 0 in (sizes := [int(b) for b in text.split(",")]):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return sizes
