"""Choosing a launch config by timing the candidates, remembered in memory and on disk.

Triton's autotuner cannot keep its choices on disk for a kernel whose arguments depend on the
config (it refuses to cache configs with a pre_hook), and linear's do: its TMA descriptors are
built on the host with the config's tile shape. Nor does it share them between processes starting together.
So linear's and attention's launchers time their candidates themselves, through this small tuner:

- each candidate is launched and timed from CUDA-graph replays (graph_time), which times the GPU
  work alone: at a few hundred rows a launch costs more in Python than on the GPU, and host-timed
  loops would rank the candidates by noise. A first call tunes while other threads of the process
  may be using CUDA (a DataLoader's pin-memory thread allocating page-locked memory, a thread copying
  batches on a side stream). So the capture is thread-local (in CUDA's default, global, mode their
  calls break the capture and, through PyTorch's random generator, every later random draw of the
  process), on a stream of the capturing thread's own (capture_stream);
- the choice is kept per key in memory and in a JSON file under $VIT_TRITON_CACHE_DIR (default
  ~/.cache/vit-triton), one file per kernel source, candidate list, GPU and Triton version, so a
  second process starts without timing anything;
- one process of a host tunes at a time (a lock file beside the choices), and a key another process chose
  meanwhile is taken, not timed again: candidates that sum in another order give other roundings, so torchrun's
  ranks, starting together, must share their picks to compute what one GPU computes;
- a key with no pick on disk takes the one the package ships for the GPU, where it has one
  (kernels/tuned/<gpu>.json, written by scripts/ship_tuned.py on that GPU for the shapes users run, as vLLM
  ships its kernel configs): launched once, which compiles it, and timed against nothing, so a first run on a
  known GPU compiles one config a key instead of every candidate. The shipped picks are keyed by the candidate
  list, not by the kernel's source: after an edit they are still taken, the one that no longer fits this GPU's
  resources is tuned over;
- inside a CUDA-graph capture nothing can be timed: an unseen key takes the first candidate
  (vit_triton.compile warms up before it captures, so its graphs hold tuned launches).

Sizes that vary with the input (linear's rows, attention's token counts, patch_embed's patches) enter every
tuning key, this tuner's and Triton's autotuner's, as size_bucket(n): n rounded up to 4 values a power of two,
so a new image or batch size near a tuned one reuses its picks; the kernels still get the exact sizes.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import json
import os
import statistics
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import torch
import triton

from .common import cdiv


class Config(NamedTuple):
    """One launch of a tiled kernel: tile shape, warps, pipeline stages and programs per SM (0: one
    per tile)."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int
    persistent: int = 1


def size_bucket(n: int) -> int:
    """n rounded up to the next 2^k * (1, 1.25, 1.5 or 1.75), n itself up to 8 (197 and 224 -> 224, 225 -> 256):
    a tuning key for a size that varies with the input. Within a bucket a size changes by less than a quarter,
    seldom enough to reorder the candidates; powers of two end buckets, so no bucket straddles a threshold there."""
    shift = max(n.bit_length() - 3, 0)
    return cdiv(n, 1 << shift) << shift


_THREAD = threading.local()
CU_STREAM_NON_BLOCKING = 1


def capture_stream(device: torch.device | None = None) -> torch.cuda.Stream:
    """A CUDA stream for capturing graphs that no other thread can be handed: one per thread and
    device, made by the driver (non-blocking, never destroyed).

    torch.cuda.Stream() gives out PyTorch's pooled streams in turn, 32 a device, so a stream taken for
    a capture can be the one another thread is copying on; its copies and their events then land in the
    capture, and that thread's next pin_memory() fails with "CUDA error: invalid argument" (seen on an
    H100 when tuning beside a thread that copies on a stream of its own)."""
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    streams = _THREAD.__dict__.setdefault("streams", {})
    if index not in streams:
        with torch.cuda.device(index):
            torch.cuda.synchronize()   # the device's primary context current on this thread, for the driver
            handle = ctypes.c_void_p()
            error = ctypes.CDLL("libcuda.so.1").cuStreamCreate(ctypes.byref(handle), CU_STREAM_NON_BLOCKING)
        if error:
            raise RuntimeError(f"cuStreamCreate failed with CUDA driver error {error}")
        streams[index] = torch.cuda.ExternalStream(handle.value, device=torch.device("cuda", index))
    return streams[index]


def captured(fn: Callable[[], object], calls: int) -> torch.cuda.CUDAGraph:
    """A CUDA graph of `calls` back-to-back calls of fn, captured in thread-local mode on the thread's
    capture_stream (fn compiled and its inputs ready beforehand: graph_time and repeated do both)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=capture_stream(), capture_error_mode="thread_local"):
        for _ in range(calls):
            fn()
    return graph


def graph_time(fn: Callable[[], object], budget_ms: float = 2.0, samples: int = 5) -> float:
    """fn's GPU time in ms: the median of `samples` replays of a CUDA graph holding as many calls of fn
    as fit in about budget_ms (captured)."""
    stream = capture_stream()
    stream.wait_stream(torch.cuda.current_stream())   # fn's inputs, written on the current stream
    with torch.cuda.stream(stream):
        fn()   # compiles, outside the capture

        def replay_ms(calls: int) -> float:
            graph = captured(fn, calls)
            graph.replay()
            times = []
            for _ in range(samples):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                graph.replay()
                end.record(stream)
                end.synchronize()
                times.append(start.elapsed_time(end) / calls)
            return statistics.median(times)

        once = replay_ms(1)
        return replay_ms(max(1, min(1000, int(budget_ms / max(once, 1e-3)))))


def repeated(fn: Callable[[], object], budget_ms: float = 20.0) -> tuple[Callable[[], object], int]:
    """(replay, calls): a CUDA graph of as many calls of fn as take about budget_ms, and how many. A host
    loop of microsecond kernels leaves the GPU idle between launches; replays of this graph keep it busy,
    as a CUDA-graphed forward does."""
    calls = max(1, min(1000, int(budget_ms / max(graph_time(fn), 1e-3))))
    graph = captured(fn, calls)
    torch.cuda.synchronize()
    return graph.replay, calls


def cache_dir() -> Path:
    return Path(os.environ.get("VIT_TRITON_CACHE_DIR", Path.home() / ".cache" / "vit-triton"))


class _HostLock:
    """Held while a Tuner picks: one thread of the process (reentrant: a launch being timed may pick for another
    key, as linear's split rows do) and one process of the host, through flock on cache_dir()/tuning.lock. Where
    that file cannot be made (a read-only cache), the process tunes alone."""

    def __init__(self) -> None:
        self._thread_lock = threading.RLock()
        self._depth = 0
        self._file = None

    def __enter__(self) -> None:
        self._thread_lock.acquire()
        if self._depth == 0:
            try:
                cache_dir().mkdir(parents=True, exist_ok=True)
                self._file = open(cache_dir() / "tuning.lock", "a")  # noqa: SIM115 -- closed in __exit__
                fcntl.flock(self._file, fcntl.LOCK_EX)
            except OSError:
                if self._file is not None:
                    self._file.close()
                self._file = None
        self._depth += 1

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0 and self._file is not None:
            self._file.close()   # which releases the flock
            self._file = None
        self._thread_lock.release()


_HOST_LOCK = _HostLock()


SHIPPED_DIR = Path(__file__).parent / "tuned"


def gpu_name(device: torch.device | None) -> str:
    """The device's name as picks are filed under it: CUDA's name of the GPU, "cpu" otherwise."""
    return torch.cuda.get_device_name(device) if device is not None and device.type == "cuda" else "cpu"


def shipped_file(gpu: str) -> Path:
    """The package's picks for a GPU (gpu_name): NVIDIA H200 -> tuned/nvidia_h200.json."""
    return SHIPPED_DIR / ("".join(c if c.isalnum() else "_" for c in gpu.lower()) + ".json")


def candidates_digest(configs: Sequence[Config]) -> str:
    """A short name of a candidate list: shipped picks are filed under it."""
    return hashlib.sha256(repr(list(configs)).encode()).hexdigest()[:12]


@functools.cache
def shipped_picks(gpu: str) -> dict:
    """{tuner name: {candidates_digest: {repr(key): config}}} that the package ships for `gpu`; {} for none."""
    try:
        return json.loads(shipped_file(gpu).read_text())
    except (OSError, ValueError):
        return {}


_TUNERS: list[Tuner] = []


def tuned_picks() -> dict[str, dict]:
    """Every pick this process's tuners made or read, in shipped_picks' layout, per GPU: what
    scripts/ship_tuned.py files into the package."""
    out: dict[str, dict] = {}
    for tuner in _TUNERS:
        for (key, configs, device), config in tuner.picks():
            by_digest = out.setdefault(gpu_name(device), {}).setdefault(tuner.name, {})
            by_digest.setdefault(candidates_digest(configs), {})[repr(key)] = list(config)
    return out


class Tuner:
    """Picks the fastest Config per key for one kernel; `source` is the kernel's source text (a change
    to it starts a new cache file); `timer(fn)` gives fn's time (default: CUDA-graph replays, ms)."""

    def __init__(self, name: str, source: str, timer: Callable[[Callable[[], object]], float] | None = None) -> None:
        self.name = name
        self._timer = timer or graph_time
        self._source_hash = hashlib.sha256(source.encode()).hexdigest()[:16]
        self._picks: dict[tuple, Config] = {}
        _TUNERS.append(self)

    def picks(self) -> list[tuple[tuple, Config]]:
        """((key, candidates, device), config) of each pick made or read so far."""
        return list(self._picks.items())

    def pick(self, key: tuple, configs: Sequence[Config], launch: Callable[[Config], object],
             device: torch.device | None = None) -> Config:
        """The fastest of `configs` for `key` on `device`; `launch(config)` runs the kernel once with
        that config."""
        if len(configs) == 1:
            return configs[0]
        memo = (key, tuple(configs), device)
        pick = self._picks.get(memo)   # the common case, on every launch: no lock, no file
        if pick is not None:
            return pick
        with _HOST_LOCK:
            if memo in self._picks:
                return self._picks[memo]
            path = self._file(configs, device)
            name = repr(key)
            saved = self._read(path).get(name)
            if saved is not None and Config(*saved) in configs:
                self._picks[memo] = Config(*saved)
                return self._picks[memo]
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                return configs[0]
            shipped = self._shipped(name, configs, launch, device)
            if shipped is not None:
                self._picks[memo] = shipped
                self._write(path, name, shipped)
                return shipped
            times = {}
            for config in configs:
                try:
                    times[config] = self._timer(lambda: launch(config))
                except triton.runtime.errors.OutOfResources:   # too much shared memory for this GPU
                    continue
            best = min(times, key=times.get)
            self._picks[memo] = best
            self._write(path, name, best)
            return best

    def _shipped(self, name: str, configs: Sequence[Config], launch: Callable[[Config], object],
                 device: torch.device | None) -> Config | None:
        """The package's pick for this key on this GPU, if it ships one among `configs` that launches here."""
        saved = shipped_picks(gpu_name(device)).get(self.name, {}).get(candidates_digest(configs), {}).get(name)
        if saved is None or Config(*saved) not in configs:
            return None
        try:
            launch(Config(*saved))
        except triton.runtime.errors.OutOfResources:
            return None
        return Config(*saved)

    def _file(self, configs: Sequence[Config], device: torch.device | None) -> Path:
        ident = "|".join([self._source_hash, triton.__version__, gpu_name(device), repr(list(configs))])
        return cache_dir() / f"{self.name}-{hashlib.sha256(ident.encode()).hexdigest()[:20]}.json"

    @staticmethod
    def _read(path: Path) -> dict:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return {}

    def _write(self, path: Path, name: str, best: Config) -> None:
        """Adds one pick to the file, written whole to a temporary name and renamed into place."""
        picks = self._read(path)
        picks[name] = list(best)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_text(json.dumps(picks, indent=0))
            os.replace(tmp, path)
        except OSError:   # a read-only home: the pick is still kept in memory
            pass
