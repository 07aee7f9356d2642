"""Runs every kernel through Triton's interpreter on machines without a CUDA device (TRITON_INTERPRET must
be set before triton is imported, which conftest.py precedes), patching the language once a launch and without
the interpreter's overflow checks; torch.compile's caches in a folder of this run's own; `one_config` pins the
tuned kernels to one launch config (in every test with --first-config); `memory` is a fresh memory:// folder,
`missing_protocol` an fsspec protocol without its package."""

import atexit
import dataclasses
import importlib
import importlib.util
import inspect
import os
import shutil
import tempfile
import uuid

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def _patch_language_once_per_launch() -> None:
    """Triton's interpreter (3.6 to 3.8) patches triton.language again at every call of a @triton.jit helper inside
    a kernel, scanning all of the language's members each time: more than half of a training step's time here.
    The launch's own patch stays in place until the kernel returns, so a helper whose language modules it already
    covers skips the scan (the same code runs, about 2.5x faster); a helper that sees another module (triton's own
    helpers see triton.language.core) patches that one, as before."""
    import triton.language as tl
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None:   # another interpreter: left as it is
        return
    patched, seen = set(), {}   # the language modules the running launch patched; each function's

    def patch_once(fn):
        langs = seen.get(fn)
        if langs is None:
            langs = seen[fn] = {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core)}
        if patched and langs <= patched:
            return None   # a helper's call: its caller ignores the result
        scope = patch(fn)
        if not patched:   # the launch's own patch, which it restores when the kernel returns
            restore = scope.restore

            def restore_and_forget():
                patched.clear()
                restore()

            scope.restore = restore_and_forget
        patched.update(langs)
        return scope

    interpreter._patch_lang = patch_once


def _no_overflow_checks() -> None:
    """The interpreter checks every int32 add, subtract and multiply for overflow by redoing it in int64 (as
    TRITON_DEBUG does on a GPU): about a third of its time, for index arithmetic that the tests' small shapes
    cannot overflow. Off, as on the GPU by default."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    if builder is not None and getattr(builder.options, "sanitize_overflow", False):
        builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_language_once_per_launch()
    _no_overflow_checks()
# Inductor's on-disk cache can hand back a graph compiled against another checkout's ops (their argument lists
# are not in its key): each test run compiles afresh.
os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="vit-triton-inductor-")
atexit.register(shutil.rmtree, os.environ["TORCHINDUCTOR_CACHE_DIR"], ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption("--first-config", action="store_true",
                     help="pin every tuned kernel to its first launch config (one_config) in each test but the "
                          "tuner's own (marked tuning): on a GPU, a run that tunes no shape")


@pytest.fixture(autouse=True)
def _first_config_option(request):
    if request.config.getoption("--first-config") and not request.node.get_closest_marker("tuning"):
        request.getfixturevalue("one_config")


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
