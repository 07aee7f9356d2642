"""Runs every kernel through Triton's interpreter on machines without a CUDA device (TRITON_INTERPRET must
be set before triton is imported, which conftest.py precedes); torch.compile's caches in a folder of this run's
own; `one_config` pins the tuned kernels to one launch config; `memory` is a fresh memory:// folder,
`missing_protocol` an fsspec protocol without its package."""

import atexit
import importlib
import importlib.util
import os
import shutil
import tempfile
import uuid

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
# Inductor's on-disk cache can hand back a graph compiled against another checkout's ops (their argument lists
# are not in its key): each test run compiles afresh.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="vit-triton-inductor-")
atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


@pytest.fixture
def one_config(monkeypatch):
    """linear and attention, forward and backward, with their first candidate config only, so that two calls that
    differ in a flag run the same tiles (their results can then be compared bit for bit on a GPU too)."""
    linear, attention = (importlib.import_module(f"vit_triton.kernels.{name}") for name in ("linear", "attention"))
    for name in ("_plain_candidates", "_tma_candidates", "_backward_candidates"):
        candidates = getattr(linear, name)
        monkeypatch.setattr(linear, name, lambda *args, candidates=candidates: candidates(*args)[:1])
    for name in ("CANDIDATES", "BACKWARD_CANDIDATES"):
        monkeypatch.setattr(attention, name, getattr(attention, name)[:1])


@pytest.fixture
def memory():
    """(fsspec's in-process memory:// file system, a fresh folder in it), the folder removed afterwards. DataLoader
    workers see it too: they are forked after the test fills it."""
    fsspec = pytest.importorskip("fsspec")
    fs, root = fsspec.filesystem("memory"), f"/{uuid.uuid4().hex}"
    yield fs, root
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture
def missing_protocol() -> tuple[str, str]:
    """(protocol, fsspec's error naming its package) of a protocol fsspec knows whose package is not installed."""
    pytest.importorskip("fsspec")
    from fsspec.registry import known_implementations

    for protocol, spec in known_implementations.items():
        module = spec["class"].split(".")[0]
        if module != "fsspec" and importlib.util.find_spec(module) is None:
            return protocol, spec["err"]
    raise AssertionError("every fsspec protocol's package is installed")
