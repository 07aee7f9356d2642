"""The launch-config tuner: the fastest candidate per key, kept in memory and on disk."""

import importlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import triton

from tests.kernels.checks import check, rand
from vit_triton.kernels import linear
from vit_triton.kernels import tuning
from vit_triton.kernels.tuning import Config, Tuner, candidates_digest, size_bucket, tuned_picks

pytestmark = pytest.mark.tuning

LINEAR = importlib.import_module("vit_triton.kernels.linear")   # the module; the package exports the function

CONFIGS = [Config(64, 64, 64, 4, 3), Config(128, 128, 64, 8, 4), Config(64, 32, 128, 4, 4, 0)]


class CountingTimer:
    """Runs each launch it is asked to time; counts them. The first candidate timed is the fastest."""

    def __init__(self):
        self.calls = 0

    def __call__(self, fn):
        fn()
        self.calls += 1
        return float(self.calls)


class FakeTimer:
    """Times each config as given; counts the calls."""

    def __init__(self, times):
        self.times, self.calls = times, 0

    def __call__(self, fn):
        self.calls += 1
        return self.times[fn()]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("VIT_TRITON_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_picks_the_fastest_and_remembers_it(cache_dir):
    timer = FakeTimer({CONFIGS[0]: 3.0, CONFIGS[1]: 1.0, CONFIGS[2]: 2.0})
    tuner = Tuner("k", "source", timer)
    assert tuner.pick(("a", 1), CONFIGS, lambda c: c) == CONFIGS[1]
    assert timer.calls == 3
    assert tuner.pick(("a", 1), CONFIGS, lambda c: c) == CONFIGS[1]
    assert timer.calls == 3, "a known key is not timed again"
    timer.times[CONFIGS[2]] = 0.5
    assert tuner.pick(("b", 1), CONFIGS, lambda c: c) == CONFIGS[2]
    (saved,) = cache_dir.glob("k-*.json")
    assert json.loads(saved.read_text()) == {repr(("a", 1)): list(CONFIGS[1]), repr(("b", 1)): list(CONFIGS[2])}


def test_a_new_process_reads_the_disk_and_times_nothing(cache_dir):
    Tuner("k", "source", FakeTimer({CONFIGS[0]: 3.0, CONFIGS[1]: 1.0, CONFIGS[2]: 2.0})).pick(("a",), CONFIGS, lambda c: c)
    later = FakeTimer({})   # raises KeyError if asked to time anything
    assert Tuner("k", "source", later).pick(("a",), CONFIGS, lambda c: c) == CONFIGS[1]
    assert later.calls == 0


def test_changed_source_or_candidates_are_timed_afresh(cache_dir):
    times = {CONFIGS[0]: 3.0, CONFIGS[1]: 1.0, CONFIGS[2]: 2.0}
    Tuner("k", "source", FakeTimer(times)).pick(("a",), CONFIGS, lambda c: c)
    for source, configs in (("edited source", CONFIGS), ("source", CONFIGS[::2])):
        timer = FakeTimer(times)
        Tuner("k", source, timer).pick(("a",), configs, lambda c: c)
        assert timer.calls == len(configs)


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    """The package's shipped picks read from a folder of the test's own (tuned/cpu.json, the CPU's name)."""
    monkeypatch.setattr(tuning, "SHIPPED_DIR", tmp_path / "tuned")
    tuning.shipped_picks.cache_clear()
    yield tmp_path / "tuned" / "cpu.json"
    tuning.shipped_picks.cache_clear()


def ship(path, picks):
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps(picks))
    tuning.shipped_picks.cache_clear()


def test_a_shipped_pick_is_launched_not_timed(cache_dir, shipped):
    ship(shipped, {"k": {candidates_digest(CONFIGS): {repr(("a",)): list(CONFIGS[2])}}})
    timer, launched = FakeTimer({}), []   # timing anything raises KeyError
    assert Tuner("k", "source", timer).pick(("a",), CONFIGS, launched.append) == CONFIGS[2]
    assert timer.calls == 0 and launched == [CONFIGS[2]], "launched once (compiled), timed against nothing"
    (saved,) = cache_dir.glob("k-*.json")   # and kept with the process's own picks
    assert json.loads(saved.read_text()) == {repr(("a",)): list(CONFIGS[2])}


def test_shipped_picks_for_another_key_kernel_or_candidate_list_are_not_taken(shipped):
    times = {CONFIGS[0]: 3.0, CONFIGS[1]: 1.0, CONFIGS[2]: 2.0}
    ship(shipped, {"k": {candidates_digest(CONFIGS): {repr(("a",)): list(CONFIGS[2])},
                         candidates_digest(CONFIGS[:2]): {repr(("b",)): list(CONFIGS[2])}},   # not a candidate
                   "other": {candidates_digest(CONFIGS): {repr(("c",)): list(CONFIGS[2])}}})
    for key, configs in ((("b",), CONFIGS[:2]), (("c",), CONFIGS), (("d",), CONFIGS)):
        timer = FakeTimer(times)
        assert Tuner("k", "source", timer).pick(key, configs, lambda c: c) == CONFIGS[1]
        assert timer.calls == len(configs)


def test_a_shipped_pick_that_does_not_fit_this_gpu_is_tuned_over(shipped):
    ship(shipped, {"k": {candidates_digest(CONFIGS): {repr(("a",)): list(CONFIGS[0])}}})

    def launch(config):
        if config == CONFIGS[0]:
            raise triton.runtime.errors.OutOfResources(240000, 232448, "shared memory")
        return config

    timer = FakeTimer({CONFIGS[1]: 1.0, CONFIGS[2]: 2.0})
    assert Tuner("k", "source", timer).pick(("a",), CONFIGS, launch) == CONFIGS[1]
    assert timer.calls == 3


def test_tuned_picks_ship_to_a_new_machine(cache_dir, shipped, tmp_path, monkeypatch):
    # A process tunes; its picks, in the shipped layout, let a process with an empty cache time nothing.
    tuner = Tuner("shipping", "source", FakeTimer({CONFIGS[0]: 3.0, CONFIGS[1]: 1.0, CONFIGS[2]: 2.0}))
    tuner.pick(("a", 7), CONFIGS, lambda c: c)
    picks = tuned_picks()["cpu"]["shipping"]
    assert picks == {candidates_digest(CONFIGS): {repr(("a", 7)): list(CONFIGS[1])}}
    ship(shipped, {"shipping": picks})
    monkeypatch.setenv("VIT_TRITON_CACHE_DIR", str(tmp_path / "new machine"))
    later = FakeTimer({})
    assert Tuner("shipping", "source", later).pick(("a", 7), CONFIGS, lambda c: c) == CONFIGS[1]
    assert later.calls == 0


def test_ship_tuned_merges_into_the_gpus_file(tmp_path):
    from tests.scripts import load_script

    merge_into = load_script("ship_tuned.py").merge_into
    path = tmp_path / "tuned" / "nvidia_h200.json"
    merge_into(path, {"linear": {"d1": {"(1,)": [1], "(2,)": [2]}}, "attention": {"d2": {"(3,)": [3]}}})
    held = merge_into(path, {"linear": {"d1": {"(2,)": [5]}, "d3": {"(4,)": [4]}}})
    assert held == json.loads(path.read_text()) == {"linear": {"d1": {"(1,)": [1], "(2,)": [5]}, "d3": {"(4,)": [4]}},
                                                    "attention": {"d2": {"(3,)": [3]}}}
    assert [p.name for p in path.parent.iterdir()] == ["nvidia_h200.json"]
    assert tuning.shipped_file("NVIDIA H200").name == "nvidia_h200.json"


def test_one_candidate_is_not_timed():
    timer = FakeTimer({})
    assert Tuner("k", "source", timer).pick(("a",), CONFIGS[:1], lambda c: c) == CONFIGS[0]
    assert timer.calls == 0


def test_a_corrupt_cache_file_is_timed_over(cache_dir):
    tuner = Tuner("k", "source", FakeTimer({CONFIGS[0]: 3.0, CONFIGS[1]: 1.0, CONFIGS[2]: 2.0}))
    tuner.pick(("a",), CONFIGS, lambda c: c)
    (saved,) = cache_dir.glob("k-*.json")
    saved.write_text("{not json")
    timer = FakeTimer({CONFIGS[0]: 1.0, CONFIGS[1]: 3.0, CONFIGS[2]: 2.0})
    assert Tuner("k", "source", timer).pick(("a",), CONFIGS, lambda c: c) == CONFIGS[0]
    assert json.loads(saved.read_text()) == {repr(("a",)): list(CONFIGS[0])}


def test_a_launch_being_timed_may_pick_for_another_key():
    # linear times a config that runs its last rows with the pick for their own key, from inside the
    # timing of the outer key: the same thread takes the tuner's lock again.
    times = {CONFIGS[0]: 3.0, CONFIGS[1]: 1.0, CONFIGS[2]: 2.0}
    tuner = Tuner("k", "source", FakeTimer(times))
    inner = []

    def launch(config):
        inner.append(tuner.pick(("rest",), CONFIGS[1:], lambda c: c))
        return config

    picked = []
    worker = threading.Thread(target=lambda: picked.append(tuner.pick(("whole",), CONFIGS, launch)), daemon=True)
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive(), "the nested pick deadlocked"
    assert picked == [CONFIGS[1]]
    assert set(inner) == {CONFIGS[1]}


def test_a_key_seen_with_other_candidates_is_timed_again():
    # The pick in memory is for one candidate list: a list without it is timed, and its own pick returned.
    timer = FakeTimer({CONFIGS[0]: 3.0, CONFIGS[1]: 1.0, CONFIGS[2]: 2.0})
    tuner = Tuner("k", "source", timer)
    assert tuner.pick(("a",), CONFIGS, lambda c: c) == CONFIGS[1]
    assert tuner.pick(("a",), CONFIGS[::2], lambda c: c) == CONFIGS[2]
    assert timer.calls == 5


def test_size_bucket():
    sizes = range(1, 5000)
    buckets = [size_bucket(n) for n in sizes]
    assert buckets == sorted(buckets), "monotone"
    assert all(size_bucket(b) == b for b in buckets)
    assert [size_bucket(n) for n in range(9)] == list(range(9)), "exact for small sizes"
    assert all(n <= b < 1.25 * n for n, b in zip(sizes, buckets) if n > 8), "nearby sizes only"
    for k in range(3, 12):   # 4 buckets a power of two, ending at it
        assert sorted({size_bucket(n) for n in range(2 ** k + 1, 2 ** (k + 1) + 1)}) == [
            2 ** k * q // 4 for q in (5, 6, 7, 8)]
    assert size_bucket(197) == size_bucket(211) != size_bucket(226)   # ViT-B/16: 224 x 224, 224 x 240, 240 x 240 px


def test_size_bucket_keeps_linear_candidate_lists_apart():
    # The rows of one bucket get one TMA candidate list: its thresholds are ends of buckets.
    for rows in (LINEAR.TINY_M_ROWS // 2, LINEAR.TINY_M_ROWS, LINEAR.SMALL_M_ROWS):
        assert size_bucket(rows) == rows < size_bucket(rows + 1)


@pytest.mark.parametrize("kernel", ["tma", "plain"])
def test_linear_shares_a_pick_between_nearby_row_counts(kernel, monkeypatch):
    # Nearby row counts (a new image size, a new batch) take the pick of their bucket, untimed; far ones are timed.
    # On the GPU too, these 32-row tiles of a 128-wide product launch no second wave to split (whole_wave_rows).
    timer = CountingTimer()
    monkeypatch.setattr(LINEAR, "_TUNER", Tuner("linear", "source", timer))
    candidates = [Config(32, 32, 32, 4, 1), Config(32, 64, 32, 4, 1)]
    monkeypatch.setattr(LINEAR, f"_{kernel}_candidates", lambda m, dtype: candidates)
    w, b = rand(128, 40, dtype=torch.bfloat16), rand(128, dtype=torch.bfloat16)
    w = w if kernel == "tma" else w.new_empty(128, 41)[:, 1:].copy_(w)   # rows 2 bytes off 16: no TMA
    for rows, timed in ((197, 2), (210, 2), (400, 4)):
        x = rand(rows, 40, dtype=torch.bfloat16)
        check(linear(x, w, b), lambda x, w, b: F.linear(x, w, b), x, w, b)
        assert timer.calls == timed, rows


RANK = """
import sys, time, pathlib
from vit_triton.kernels.tuning import Config, Tuner
rank, folder = int(sys.argv[1]), pathlib.Path(sys.argv[2])
configs = [Config(64, 64, 64, 4, 3), Config(128, 128, 64, 8, 4)]
timed = []

def timer(fn):
    timed.append(fn())
    time.sleep(0.3)
    return float(configs.index(timed[-1]) != rank)   # each process, timing alone, would pick its own

(folder / f"ready{rank}").touch()
while not (folder / "go").exists():
    time.sleep(0.01)
print(configs.index(Tuner("k", "source", timer).pick(("a",), configs, lambda c: c)), len(timed))
"""


def test_processes_tuning_together_share_one_pick(cache_dir):
    # torchrun's ranks start together: one times the candidates and every other takes its pick, however its own
    # timing would rank them (candidates that sum in another order give other roundings, and the ranks must
    # compute what one GPU computes).
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), str(cache_dir)], stdout=subprocess.PIPE,
                              text=True, cwd=Path(__file__).parents[2]) for rank in (0, 1)]
    deadline = time.monotonic() + 120
    while not all((cache_dir / f"ready{rank}").exists() for rank in (0, 1)):
        assert time.monotonic() < deadline and all(r.poll() is None for r in ranks), "a rank did not start"
        time.sleep(0.05)
    (cache_dir / "go").touch()
    (pick0, timed0), (pick1, timed1) = (r.communicate(timeout=120)[0].split() for r in ranks)
    assert pick0 == pick1
    assert sorted([int(timed0), int(timed1)]) == [0, 2], "one rank times both candidates, the other none"


def test_the_shipped_files_hold_launch_configs_of_known_tuners():
    # each file under kernels/tuned: {tuner: {candidates digest: {key: config}}}, read back as the tuner reads it
    files = sorted(tuning.SHIPPED_DIR.glob("*.json"))
    assert files, "no shipped picks"
    names = {"attention", "attention_backward", "linear", "linear_backward"}
    for path in files:
        picks = json.loads(path.read_text())
        assert set(picks) <= names, path
        for by_digest in picks.values():
            for by_key in by_digest.values():
                for config in by_key.values():
                    config = Config(*config)
                    assert config.block_m > 0 and config.warps in (1, 2, 4, 8, 16) and config.stages > 0
