"""Runs every kernel through Triton's interpreter on machines without a CUDA device (TRITON_INTERPRET must
be set before triton is imported, which conftest.py precedes); torch.compile's caches in a folder of this run's
own; `one_config` pins the tuned kernels to one launch config."""

import atexit
import importlib
import os
import shutil
import tempfile

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
    """linear and attention with their first candidate config only, so that two calls that differ in a
    flag run the same tiles (their results can then be compared bit for bit on a GPU too)."""
    linear, attention = (importlib.import_module(f"vit_triton.kernels.{name}") for name in ("linear", "attention"))
    for name in ("_plain_candidates", "_tma_candidates"):
        candidates = getattr(linear, name)
        monkeypatch.setattr(linear, name, lambda m, dtype, candidates=candidates: candidates(m, dtype)[:1])
    monkeypatch.setattr(attention._attention_kernel, "configs", attention._attention_kernel.configs[:1])
