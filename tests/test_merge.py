"""Rank 0's merge of the chunks into a Parquet output while the run embeds (store.Merge), without a model: chunks
whose markers appear over time, in and out of order, merged in input order on the merge's thread; finishing gives
the table of their parts concatenated, with the run's metadata in the schema; adding to a finished output; an
error on the thread raised by finish(); a run stopped early leaves its chunks for the next one."""

import json
import os
import threading
import time

import numpy as np
import pytest

from vit_triton.pipelines import store as store_module
from vit_triton.pipelines.store import ChunkStore

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

D, T = 3, 2  # embedding width, tokens a row


@pytest.fixture(autouse=True)
def quick_polls(monkeypatch):
    monkeypatch.setattr(store_module, "_POLL_SECONDS", 0.01)


def _store(tmp_path, name: str = "out.parquet") -> ChunkStore:
    return ChunkStore(tmp_path / name, {"input": str(tmp_path), "chunk_size": 4})


def _prepare(store: ChunkStore, inputs: list[str]) -> list[str]:
    inputs, _ = store.prepare(lambda: inputs, log=lambda msg: None)
    return inputs


def _rows(names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(embedding [n, D], tokens [n, T, D]) of inputs named by numbers: input "7" has 7 in every value."""
    values = np.array([float(n) for n in names], dtype=np.float32)
    return np.repeat(values, D).reshape(-1, D), np.repeat(values, T * D).reshape(-1, T, D)


def _parts(store: ChunkStore, chunk: int, inputs: list[str]) -> list[list[str]]:
    """The rows of a chunk's parts: its inputs but those ending in "x" (skipped), up to 3 a part, at least one part."""
    good = [inputs[i] for i in store.chunk_range(chunk, inputs) if not inputs[i].endswith("x")]
    return [good[i:i + 3] for i in range(0, len(good), 3)] or [[]]


def _write_chunk(store: ChunkStore, chunk: int, inputs: list[str], tokens: bool = False) -> None:
    """Chunk `chunk` done, as ChunkWriter writes it: its parts, then its marker."""
    parts = _parts(store, chunk, inputs)
    for p, part in enumerate(parts):
        embedding, token_rows = _rows(part)
        store.write_part(chunk, p, part, embedding, token_rows if tokens else None)
    skipped = [(inputs[i], "not an image") for i in store.chunk_range(chunk, inputs) if inputs[i].endswith("x")]
    store.finish_chunk(chunk, len(parts), sum(map(len, parts)), skipped)


def _expected(names: list[str], tokens: bool = False):
    """The table of these rows, built here: what the merge must write."""
    embedding, token_rows = _rows(names)
    columns = {"path": pa.array(names, pa.string()),
               "embedding": pa.FixedSizeListArray.from_arrays(pa.array(embedding.ravel()), D)}
    if tokens:
        columns["tokens"] = pa.FixedSizeListArray.from_arrays(
            pa.FixedSizeListArray.from_arrays(pa.array(token_rows.ravel()), D), T)
    return pa.table(columns)


def _wait_for(condition, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _still(condition, seconds: float = 0.2) -> bool:
    """Whether `condition` holds all along `seconds` (time for several polls)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not condition():
            return False
        time.sleep(0.01)
    return True


def test_chunks_are_merged_in_order_as_their_markers_appear(tmp_path):
    store = _store(tmp_path)
    # 5 chunks of 4: chunk 1 is all skipped (no rows), chunk 4 has 2 inputs
    inputs = _prepare(store, ["0", "1", "2x", "3", "4x", "5x", "6x", "7x", "8", "9", "10", "11", "12", "13",
                              "14", "15", "16", "17x"])
    with store.merging(inputs) as merge:
        _write_chunk(store, 1, inputs, tokens=True)
        assert _still(lambda: not merge.markers)  # chunk 0 first
        _write_chunk(store, 0, inputs, tokens=True)
        _wait_for(lambda: len(merge.markers) == 2)
        _write_chunk(store, 3, inputs, tokens=True)
        assert _still(lambda: len(merge.markers) == 2)
        _write_chunk(store, 2, inputs, tokens=True)
        _wait_for(lambda: len(merge.markers) == 4)  # merged on the thread: nothing yet where the output goes
        assert not store.output.exists() and list(store.work.glob("out.parquet.tmp-*"))
        _write_chunk(store, 4, inputs, tokens=True)
        summary = merge.finish()
    good = [n for n in inputs if not n.endswith("x")]
    assert (summary.done, summary.skipped) == (len(good), len(inputs) - len(good))
    table = pq.read_table(store.output)
    assert table.equals(_expected(good, tokens=True))
    meta = {"settings": store.settings, "cwd": os.getcwd(), "done": len(good), "skipped": len(inputs) - len(good)}
    assert pq.read_schema(store.output).metadata == {b"vit_triton": json.dumps(meta).encode()}
    assert store.final_metadata() == meta
    assert store.skipped_file.read_text().splitlines() == ["path\treason"] + [
        f"{n}\tnot an image" for n in inputs if n.endswith("x")]
    assert not store.work.exists()

    # the bytes of a file written with the metadata from the start, as the merge at the end wrote it before: one
    # row group a part
    reference = tmp_path / "reference.parquet"
    schema = _expected([], tokens=True).schema.with_metadata({b"vit_triton": json.dumps(meta).encode()})
    writer = pq.ParquetWriter(reference, schema, use_dictionary=False, write_statistics=["path"])
    for k in range(store.num_chunks(inputs)):
        for part in _parts(store, k, inputs):
            writer.write_table(_expected(part, tokens=True))
    writer.close()
    assert store.output.read_bytes() == reference.read_bytes()


def test_added_to_a_finished_output_its_row_groups_come_first(tmp_path):
    store = _store(tmp_path)
    first = _prepare(store, ["0", "1", "2x", "3", "4"])
    with store.merging(first) as merge:
        for k in range(store.num_chunks(first)):
            _write_chunk(store, k, first)
        merge.finish()
    old = pq.read_table(store.output)

    added = _prepare(store, [*first, "5", "6x", "7", "8", "9"])
    assert added == ["5", "6x", "7", "8", "9"]
    with store.merging(added) as merge:
        _write_chunk(store, 0, added)
        _wait_for(lambda: len(merge.markers) == 1)
        _write_chunk(store, 1, added)
        summary = merge.finish()
    good = ["0", "1", "3", "4", "5", "7", "8", "9"]
    table = pq.read_table(store.output)
    assert table.equals(_expected(good)) and table.slice(0, 4).equals(old)
    assert (summary.done, summary.skipped) == (8, 2)
    assert store.final_metadata() == {"settings": store.settings, "cwd": os.getcwd(), "done": 8, "skipped": 2}
    assert store.skipped_file.read_text() == "path\treason\n2x\tnot an image\n6x\tnot an image\n"


def test_an_error_on_the_thread_is_raised_by_finish(tmp_path, monkeypatch):
    store = _store(tmp_path)
    inputs = _prepare(store, [str(i) for i in range(8)])
    row_group = store_module._row_group
    threads = []

    def failing(arrays):
        threads.append(threading.current_thread().name)
        if len(threads) == 2:
            raise OSError("disk full")
        return row_group(arrays)

    monkeypatch.setattr(store_module, "_row_group", failing)
    with pytest.raises(OSError, match="disk full"):
        with store.merging(inputs) as merge:
            _write_chunk(store, 0, inputs)
            _write_chunk(store, 1, inputs)
            _wait_for(lambda: len(threads) == 2)
            merge.finish()
    assert threads == ["vit-triton merge"] * 2
    assert not store.output.exists() and not list(store.work.glob("out.parquet.tmp-*"))
    assert len(store.pending(inputs)) == 0  # the chunks stay, for the next run to merge


def test_a_run_stopped_early_leaves_its_chunks_and_no_output(tmp_path):
    store = _store(tmp_path)
    inputs = [str(i) for i in range(12)]
    _prepare(store, inputs)
    with pytest.raises(KeyboardInterrupt):
        with store.merging(inputs) as merge:
            _write_chunk(store, 0, inputs)
            _write_chunk(store, 1, inputs)
            _wait_for(lambda: len(merge.markers) == 2)
            raise KeyboardInterrupt
    assert "vit-triton merge" not in [t.name for t in threading.enumerate()]
    assert not store.output.exists() and not list(store.work.glob("out.parquet.tmp-*"))
    assert store.pending(inputs) == [2]

    # the next run: a killed run's partial output is removed, the chunks done are merged again
    (store.work / "out.parquet.tmp-1").write_bytes(b"PAR1 half a file")
    assert _prepare(store, inputs) == inputs and store.pending(inputs) == [2]
    assert not (store.work / "out.parquet.tmp-1").exists()
    with store.merging(inputs) as merge:
        _write_chunk(store, 2, inputs)
        merge.finish()
    assert pq.read_table(store.output).equals(_expected(inputs))


def test_input_names_come_back_as_written_whatever_their_characters(tmp_path):
    # Line and paragraph separators, quotes, backslashes, non-ASCII: the work directory's list keeps one name a line.
    names = ["a\nb.jpg", "c\u2028d.jpg", "e\x0bf\x85.jpg", "\\n.jpg", 'q"uote.jpg', "ü/ß.jpg", " .jpg", ""]
    store = _store(tmp_path)
    assert _prepare(store, names) == names
    assert store.read_inputs() == names
    assert _store(tmp_path).read_inputs() == names   # as another rank, or a resumed run, reads them
