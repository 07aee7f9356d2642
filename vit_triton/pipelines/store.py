"""The embed command's output: chunks written atomically beside the output, with a manifest, merged
into one file at the end. This is what makes a run resumable after any kill, kill -9 included.

While running, for OUT = embeddings.parquet (or embeddings.npy), the work directory OUT.partial/ holds

  manifest.json         the settings that decide the output; a resumed run must have the same
  inputs.jsonl          the input paths, one JSON string per line: line i is input i
  chunk-000012.npz      chunk 12 (inputs 12*C .. 13*C-1): index, embedding [n, D] (, tokens [n, T, D])
  chunk-000012.json     its done marker, written after the data: rows, and the skipped (index, reason)

Every file goes to a temporary name, is flushed to disk and renamed, so a chunk is either complete
or absent; a resumed run redoes exactly the chunks without a marker. The finished output is

  embeddings.parquet    columns path (string), embedding (fixed-size list), tokens (optional)
  or embeddings.npy [N, D] + embeddings.paths.json (its paths, row for row) (+ embeddings.tokens.npy)
  embeddings.skipped.tsv  path and reason of each input that is not an image or cannot be read

in input order, skipped inputs left out. The settings travel in the output (Parquet metadata, the
paths file), so running a finished command again is recognised and does nothing.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMATS = (".parquet", ".npy")
_META_KEY = b"vit_triton"


class UsageError(ValueError):
    """A problem with what the command was asked to do (exit status 2), not with running it."""


@dataclass(frozen=True)
class Summary:
    output: Path
    done: int                 # images embedded, over all runs of this output
    skipped: int              # inputs listed in the skipped file
    skipped_file: Path
    processed: int = 0        # inputs handled by this run (embedded or skipped)
    seconds: float = 0.0      # this run's time


def write_atomic(path: Path, write) -> None:
    """write(file) into a temporary file beside `path`, flushed to disk, then renamed onto it."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _json_bytes(obj) -> bytes:
    return json.dumps(obj, indent=1).encode()


class ChunkStore:
    """The output of one embed command: its work directory while running, its files when done."""

    def __init__(self, output: str | os.PathLike, settings: dict) -> None:
        self.output = Path(output)
        if self.output.suffix not in FORMATS:
            raise UsageError(f"--output must end in {' or '.join(FORMATS)} (Parquet, or NumPy + a paths file), "
                             f"got {self.output}")
        self.settings = settings
        self.chunk_size: int = settings["chunk_size"]
        self.work = self.output.with_name(self.output.name + ".partial")
        stem = self.output.name.removesuffix(self.output.suffix)
        self.skipped_file = self.output.with_name(stem + ".skipped.tsv")
        self.paths_file = self.output.with_name(stem + ".paths.json")
        self.tokens_file = self.output.with_name(stem + ".tokens.npy")
        self._done_file = self.output if self.output.suffix == ".parquet" else self.paths_file

    # -- starting, resuming --

    def prepare(self, list_inputs, overwrite: bool = False) -> tuple[list[str] | None, str]:
        """Start a run or pick one up: (inputs, "new" | "resumed"), or (None, "complete") when this
        output is already finished with the same settings. Rank 0 only."""
        if overwrite:
            self._remove_outputs()
        if (self.work / "manifest.json").is_file():
            saved = json.loads((self.work / "manifest.json").read_text())["settings"]
            self._check_same(saved, f"a run into {self.output} was started")
            for stale in self.work.glob("*.tmp-*"):  # left by a killed run
                stale.unlink()
            return self.read_inputs(), "resumed"
        if self._done_file.is_file() or self.output.is_file():
            meta = self.final_metadata()
            if meta is None:
                raise UsageError(f"{self.output} exists and was not written by vit-triton embed: choose another "
                                 f"--output or pass --overwrite")
            self._check_same(meta["settings"], f"{self.output} was written")
            return None, "complete"
        inputs = list_inputs()
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        write_atomic(self.work / "inputs.jsonl", lambda f: f.writelines(
            (json.dumps(p) + "\n").encode() for p in inputs))
        # The manifest last: a work directory without one is from a run killed while starting.
        write_atomic(self.work / "manifest.json", lambda f: f.write(_json_bytes(
            {"settings": self.settings, "num_inputs": len(inputs)})))
        return inputs, "new"

    def _check_same(self, saved: dict, what: str) -> None:
        diff = [f"{k}: {saved.get(k)!r} then, {v!r} now" for k, v in self.settings.items() if saved.get(k) != v]
        if diff:
            raise UsageError(f"{what} with other settings ({'; '.join(diff)}): run it with the same ones to "
                             f"resume, or pass --overwrite to start over")

    def _remove_outputs(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)
        for path in (self.output, self.skipped_file, self.paths_file, self.tokens_file):
            path.unlink(missing_ok=True)

    def read_inputs(self) -> list[str]:
        with open(self.work / "inputs.jsonl", encoding="utf-8") as f:
            return [json.loads(line) for line in f]

    def num_chunks(self, num_inputs: int) -> int:
        return -(-num_inputs // self.chunk_size)

    def chunk_range(self, chunk: int, num_inputs: int) -> range:
        return range(chunk * self.chunk_size, min((chunk + 1) * self.chunk_size, num_inputs))

    def pending(self, num_inputs: int) -> list[int]:
        """Chunks without a done marker, in order."""
        return [k for k in range(self.num_chunks(num_inputs)) if not self._marker(k).is_file()]

    def _marker(self, chunk: int) -> Path:
        return self.work / f"chunk-{chunk:06d}.json"

    def _data(self, chunk: int) -> Path:
        return self.work / f"chunk-{chunk:06d}.npz"

    # -- writing --

    def write_chunk(self, chunk: int, indices: np.ndarray, embedding: np.ndarray, tokens: np.ndarray | None,
                    skipped: list[tuple[int, str]]) -> None:
        arrays = {"index": indices, "embedding": embedding, **({"tokens": tokens} if tokens is not None else {})}
        write_atomic(self._data(chunk), lambda f: np.savez(f, **arrays))
        write_atomic(self._marker(chunk), lambda f: f.write(_json_bytes(
            {"rows": len(indices), "skipped": sorted(skipped)})))

    def finalize(self, inputs: list[str]) -> Summary:
        """Merge the chunks into the output, write the skipped-files list, remove the work directory."""
        chunks = range(self.num_chunks(len(inputs)))
        missing = [k for k in chunks if not self._marker(k).is_file()]
        if missing:
            raise RuntimeError(f"cannot finish {self.output}: chunks {missing[:10]} are not done")
        markers = [json.loads(self._marker(k).read_text()) for k in chunks]
        rows = sum(m["rows"] for m in markers)
        skipped = [(inputs[i], reason) for m in markers for i, reason in m["skipped"]]
        write_atomic(self.skipped_file, lambda f: f.write(_tsv(skipped)))
        meta = {"settings": self.settings, "done": rows, "skipped": len(skipped)}
        if self.output.suffix == ".parquet":
            self._write_parquet(chunks, inputs, meta)
        else:
            self._write_npy(chunks, inputs, rows, meta)
        shutil.rmtree(self.work)
        return Summary(self.output, rows, len(skipped), self.skipped_file)

    def _chunk_arrays(self, chunks):
        for k in chunks:
            with np.load(self._data(k)) as data:
                yield {name: data[name] for name in data.files}

    def _write_parquet(self, chunks, inputs: list[str], meta: dict) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        writer = None

        def write(f) -> None:
            nonlocal writer
            for arrays in self._chunk_arrays(chunks):
                columns = {"path": pa.array([inputs[i] for i in arrays["index"]], pa.string()),
                           "embedding": _fixed_size_lists(arrays["embedding"])}
                if "tokens" in arrays:
                    columns["tokens"] = _fixed_size_lists(arrays["tokens"])
                table = pa.table(columns)
                if writer is None:
                    schema = table.schema.with_metadata({_META_KEY: json.dumps(meta).encode()})
                    writer = pq.ParquetWriter(f, schema)
                writer.write_table(table.cast(writer.schema))
            writer.close()

        write_atomic(self.output, write)

    def _write_npy(self, chunks, inputs: list[str], rows: int, meta: dict) -> None:
        first = next(self._chunk_arrays(chunks[:1]))
        targets = {"embedding": self.output, "tokens": self.tokens_file}
        for name in [n for n in ("embedding", "tokens") if n in first]:
            shape, dtype = first[name].shape[1:], first[name].dtype
            tmp = targets[name].with_name(targets[name].name + f".tmp-{os.getpid()}")
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=(rows, *shape))
            row = 0
            for arrays in self._chunk_arrays(chunks):
                out[row:row + len(arrays[name])] = arrays[name]
                row += len(arrays[name])
            out.flush()
            del out
            os.replace(tmp, targets[name])
        paths = [inputs[i] for arrays in self._chunk_arrays(chunks) for i in arrays["index"]]
        # The paths file last: its presence says the output is complete.
        write_atomic(self.paths_file, lambda f: f.write(_json_bytes({**meta, "paths": paths})))

    # -- reading a finished output --

    def final_metadata(self) -> dict | None:
        """{"settings", "done", "skipped"} of a finished output, None if it is not one of ours."""
        try:
            if self.output.suffix == ".parquet":
                import pyarrow.parquet as pq

                raw = (pq.read_schema(self.output).metadata or {}).get(_META_KEY)
                return json.loads(raw) if raw else None
            meta = json.loads(self.paths_file.read_text())
            return meta if "settings" in meta and self.output.is_file() else None
        except (OSError, ValueError):
            return None

    def finished_summary(self) -> Summary:
        meta = self.final_metadata()
        return Summary(self.output, meta["done"], meta["skipped"], self.skipped_file)


def _tsv(rows: list[tuple[str, str]]) -> bytes:
    text = io.StringIO()
    writer = csv.writer(text, delimiter="\t", lineterminator="\n")
    writer.writerow(["path", "reason"])
    writer.writerows(rows)
    return text.getvalue().encode()


def _fixed_size_lists(array: np.ndarray):
    """[n, D] -> fixed_size_list<D>; [n, T, D] -> fixed_size_list<fixed_size_list<D>, T>."""
    import pyarrow as pa

    values = pa.array(np.ascontiguousarray(array).reshape(-1))
    for size in reversed(array.shape[1:]):
        values = pa.FixedSizeListArray.from_arrays(values, size)
    return values
