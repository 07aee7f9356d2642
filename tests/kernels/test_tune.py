"""The launch-config tuner: the fastest candidate per key, kept in memory and on disk."""

import json
import threading

import pytest

from vit_triton.kernels.tuning import Config, Tuner

CONFIGS = [Config(64, 64, 64, 4, 3), Config(128, 128, 64, 8, 4), Config(64, 32, 128, 4, 4, 0)]


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
