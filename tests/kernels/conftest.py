"""Every kernel test case draws its own random inputs, the same on every run; `one_config` pins the
tuned kernels to one launch config."""

import importlib
import zlib

import pytest
import torch


@pytest.fixture(autouse=True)
def seed(request):
    # The test's id (name and parameters) picks the seed: reproducible, and new data for each case.
    torch.manual_seed(zlib.crc32(request.node.name.encode()))


@pytest.fixture
def one_config(monkeypatch):
    """linear and attention with their first candidate config only, so that two calls that differ in a
    flag run the same tiles (their results can then be compared bit for bit on a GPU too)."""
    linear, attention = (importlib.import_module(f"vit_triton.kernels.{name}") for name in ("linear", "attention"))
    candidates = linear._candidates
    monkeypatch.setattr(linear, "_candidates", lambda m, dtype: candidates(m, dtype)[:1])
    monkeypatch.setattr(attention._attention_kernel, "configs", attention._attention_kernel.configs[:1])
