"""embed's output store without a model (store.py): runs whose "embeddings" are the numbers their input files hold,
to check what a later run makes of an output: files replaced in place embedded again, a resumed run redoing the
chunks of files changed since it started, the output's own files in INPUT, INPUT and --model spelled otherwise or
given from another directory, and kills while merging."""

import functools
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from vit_triton.data.sources import file_stat, is_shard, list_inputs
from vit_triton.pipelines import store as store_module
from vit_triton.pipelines.store import ChunkStore, UsageError

pq = pytest.importorskip("pyarrow.parquet")


def _store_run(store: ChunkStore, list_inputs, log=lambda msg: None, chunks: int | None = None) -> str:
    """A run into `store`, holding its lock, without a model: an input that reads "7" has the embedding [7], a tar
    shard (NAME.tar) that reads "1,2" the rows NAME.tar#0 [1] and NAME.tar#1 [2], one that reads anything else is
    skipped; an input that is no file reads as its name. With `chunks`, it stops after that many chunks (a run
    killed). Returns prepare's state."""
    with store.lock():
        inputs, state = store.prepare(list_inputs, log)
        if inputs is None:
            return state
        for k in store.pending(inputs)[:chunks]:
            names, values, skipped = [], [], []
            for i in store.chunk_range(k, inputs):
                text = Path(inputs[i]).read_text() if os.path.isfile(inputs[i]) else inputs[i]
                if not re.fullmatch(r"\d+(,\d+)*", text):
                    skipped.append((inputs[i], "not a number"))
                    continue
                numbers = text.split(",")
                names += [f"{inputs[i]}#{j}" for j in range(len(numbers))] if is_shard(inputs[i]) else [inputs[i]]
                values += numbers
            store.write_part(k, 0, names, np.array(values, dtype=np.int64).reshape(-1, 1), None)
            store.finish_chunk(k, 1, len(names), skipped)
        if chunks is None:
            with store.merging(inputs) as merge:
                merge.finish()
    return state


def _rows(output: Path) -> list[tuple[str, int]]:
    """(name, value) of each row of a finished output of _store_run, in order."""
    if output.suffix == ".npy":
        names = json.loads(output.with_suffix(".paths.json").read_text())["paths"]
        return list(zip(names, np.load(output).ravel().tolist()))
    table = pq.read_table(output)
    return list(zip(table["path"].to_pylist(), [v[0] for v in table["embedding"].to_pylist()]))


def _write(folder: Path, texts: dict[str, str]) -> dict[str, str]:
    """Files of `folder` holding `texts` (by name); {name: its path}."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (folder / name).write_text(text)
    return {name: str(folder / name) for name in texts}


def _replace(path: str, text: str) -> None:
    """`path` given `text`, its modification time a second later than it was (a write within the same clock tick
    as the last one would leave it)."""
    mtime = os.stat(path).st_mtime_ns
    Path(path).write_text(text)
    os.utime(path, ns=(mtime + 10**9, mtime + 10**9))


def test_an_output_of_image_files_is_not_added_to_from_shards(tmp_path):
    store = ChunkStore(tmp_path / "e.npy", {"input": str(tmp_path), "chunk_size": 2})
    _store_run(store, lambda: ["0", "1", "2"])
    with pytest.raises(UsageError, match=r"e.npy was written from image files, but INPUT now names tar shards: pass "
                                         r"--overwrite to start over"):
        store.prepare(lambda: ["3.tar"], log=lambda msg: None)


def test_adding_to_an_output_survives_a_kill_while_merging(tmp_path, monkeypatch):
    # The merge reads the finished output's files as they were when the run started (hard links in the work
    # directory), not the output being replaced: killed between its .npy and its paths file, a resumed run
    # writes every row once.
    store = ChunkStore(tmp_path / "e.npy", {"input": str(tmp_path), "chunk_size": 2})
    _store_run(store, lambda: ["0", "1", "2"])
    write_atomic = store_module.write_atomic

    def killed_at_the_paths_file(path, write):
        if path == store.paths_file:
            raise KeyboardInterrupt
        write_atomic(path, write)

    monkeypatch.setattr(store_module, "write_atomic", killed_at_the_paths_file)
    with pytest.raises(KeyboardInterrupt):
        _store_run(store, lambda: ["0", "1", "2", "3", "4"])
    assert np.load(tmp_path / "e.npy").ravel().tolist() == [0, 1, 2, 3, 4] and not store.paths_file.exists()
    monkeypatch.setattr(store_module, "write_atomic", write_atomic)
    _store_run(store, lambda: ["0", "1", "2", "3", "4"])
    assert np.load(tmp_path / "e.npy").ravel().tolist() == [0, 1, 2, 3, 4]
    assert json.loads(store.paths_file.read_text())["paths"] == ["0", "1", "2", "3", "4"]


@pytest.mark.parametrize("name", ["e.npy", "e.parquet"])
def test_files_replaced_in_place_are_embedded_again(name, tmp_path):
    f = _write(tmp_path / "in", {"f0": "0", "f1": "1", "f2": "2", "f3": "x", "f4": "4"})
    output = tmp_path / name
    store = ChunkStore(output, {"input": str(tmp_path / "in"), "chunk_size": 2})
    listing = functools.partial(list_inputs, str(tmp_path / "in"))
    assert _store_run(store, listing) == "new"
    assert _rows(output) == [(f["f0"], 0), (f["f1"], 1), (f["f2"], 2), (f["f4"], 4)]
    assert store.skipped_file.read_text() == f"path\treason\n{f['f3']}\tnot a number\n"

    _replace(f["f1"], "11")   # another size
    _replace(f["f3"], "3")    # the same size: its modification time tells; skipped before, an image now
    logs = []
    assert _store_run(store, listing, logs.append) == "added"
    assert logs == [(f"vit-triton embed: 2 file(s) of {output} changed since it was written (size or modification "
                     f"time; the first: {f['f1']}): embedding them again, their rows to replace the old ones, after "
                     f"the others")]
    assert _rows(output) == [(f["f0"], 0), (f["f2"], 2), (f["f4"], 4), (f["f1"], 11), (f["f3"], 3)]
    assert store.skipped_file.read_text() == "path\treason\n"
    meta = store.final_metadata()
    assert (meta["cwd"], meta["done"], meta["skipped"]) == (os.getcwd(), 5, 0)
    recorded = [line.split("\t") for line in store.inputs_file.read_text().splitlines()]
    assert recorded == [["path", "size", "mtime_ns"]] + [[f[n], *map(str, file_stat(f[n]))]
                                                         for n in ("f0", "f2", "f4", "f1", "f3")]
    assert _store_run(store, listing) == "complete"


def test_a_shard_replaced_in_place_is_read_again(tmp_path):
    f = _write(tmp_path / "in", {"a.tar": "1,2", "b.tar": "3", "c.tar": "y"})
    output = tmp_path / "s.npy"
    store = ChunkStore(output, {"input": str(tmp_path / "in"), "chunk_size": 2})
    listing = functools.partial(list_inputs, str(tmp_path / "in"))
    _store_run(store, listing)
    assert _rows(output) == [(f"{f['a.tar']}#0", 1), (f"{f['a.tar']}#1", 2), (f"{f['b.tar']}#0", 3)]
    _replace(f["a.tar"], "5")
    _replace(f["c.tar"], "6")
    assert _store_run(store, listing) == "added"
    assert _rows(output) == [(f"{f['b.tar']}#0", 3), (f"{f['a.tar']}#0", 5), (f"{f['c.tar']}#0", 6)]
    assert store.skipped_file.read_text() == "path\treason\n"
    assert store.final_metadata()["shards"] == [f["b.tar"], f["a.tar"], f["c.tar"]]


def test_a_resumed_run_embeds_again_the_done_chunks_of_files_changed_since_it_started(tmp_path):
    f = _write(tmp_path / "in", {"f0": "0", "f1": "1", "f2": "2", "f3": "3"})
    store = ChunkStore(tmp_path / "e.parquet", {"input": str(tmp_path / "in"), "chunk_size": 2})
    listing = functools.partial(list_inputs, str(tmp_path / "in"))
    assert _store_run(store, listing, chunks=1) == "new"   # killed after chunk 0
    _replace(f["f1"], "11")
    logs = []
    assert _store_run(store, listing, logs.append) == "resumed"
    assert logs == [(f"vit-triton embed: 1 file(s) changed since this run started (size or modification time; the "
                     f"first: {f['f1']}): embedding their 1 chunk(s) again")]
    assert _rows(tmp_path / "e.parquet") == [(f["f0"], 0), (f["f1"], 11), (f["f2"], 2), (f["f3"], 3)]


def test_the_outputs_own_files_in_input_are_no_inputs(tmp_path):
    folder = tmp_path / "in"
    f = _write(folder, {"f0": "0", "f1": "1"})
    store = ChunkStore(folder / "e.npy", {"input": str(folder), "chunk_size": 1})
    listing = functools.partial(list_inputs, str(folder))
    assert _store_run(store, listing, chunks=1) == "new"   # e.npy.lock was there; e.npy.partial/ is now
    logs = []
    assert _store_run(store, listing, logs.append) == "resumed" and logs == []
    assert _rows(folder / "e.npy") == [(f["f0"], 0), (f["f1"], 1)]
    assert store.skipped_file.read_text() == "path\treason\n"
    assert sorted(p.name for p in folder.iterdir()) == ["e.inputs.tsv", "e.npy", "e.paths.json", "e.skipped.tsv",
                                                        "f0", "f1"]
    assert _store_run(store, listing) == "complete"
    with pytest.raises(UsageError, match=f"INPUT {folder}: names no files but those of the output {folder}/e.npy"):
        store.prepare(lambda: [str(folder / "e.npy"), str(folder / "e.npy.lock")], log=lambda msg: None)


def test_input_and_model_are_compared_as_absolute_paths_and_relative_inputs_from_their_directory(tmp_path,
                                                                                               monkeypatch):
    _write(tmp_path / "in", {"f0": "0"})
    (tmp_path / "ckpt").mkdir()
    monkeypatch.chdir(tmp_path)
    settings = {"input": "in", "model": "./ckpt/", "chunk_size": 2}
    assert _store_run(ChunkStore("abs.npy", settings), lambda: list_inputs(str(tmp_path / "in"))) == "new"
    assert _store_run(ChunkStore("rel.npy", settings), lambda: list_inputs("in")) == "new"

    monkeypatch.chdir(tmp_path / "in")
    there = {"input": ".", "model": str(tmp_path / "ckpt"), "chunk_size": 2}
    assert _store_run(ChunkStore("../abs.npy", there), lambda: list_inputs(".")) == "complete"
    with pytest.raises(UsageError, match=f"rel.npy names its inputs by paths relative to {tmp_path}, where it was "
                                         f"started: run the command from there"):
        _store_run(ChunkStore("../rel.npy", there), lambda: list_inputs("."))
    assert ChunkStore("x.npy", {**there, "model": "org/name"}).settings["model"] == "org/name"   # a hub id
