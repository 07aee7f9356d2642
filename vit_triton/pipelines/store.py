"""The embed command's output: chunks written atomically beside the output, with a manifest, merged
into one file in input order. This is what makes a run resumable after any kill, kill -9 included.

While running, for OUT = embeddings.parquet (or embeddings.npy), the run holds a lock on OUT.lock
(one run at a time into an output; the kernel releases it when the process dies), and the work
directory OUT.partial/ holds

  manifest.json         the settings that decide the output; a resumed run must have the same
  inputs.jsonl          the input paths (image files or tar shards), one JSON string per line: line i is input i
  chunk-000012-0000.npz part 0 of chunk 12's rows (about C a part): name, embedding [n, D] (, tokens [n, T, D])
  chunk-000012.json     its done marker, written after its parts: rows, parts, and the skipped (name, reason)
  base.*                when adding new inputs to a finished output: its files as they were (hard links)
  OUT.tmp-PID           Parquet: the output being merged (by rank 0, a part at a time, as chunks get their markers)

Chunk 12 is image files 12*C .. 13*C-1 (C = chunk_size), or tar shard 12: its images are found as it is
read, so a chunk holds as many rows as it turns out to. Every file goes to a temporary name, is flushed to
disk and renamed, so a chunk is either complete or absent; a resumed run redoes exactly the chunks without a
marker, and the merge from the start (a killed run's partial output is a temporary file, removed). A Parquet
output is merged while the run embeds: a thread of rank 0 appends each chunk once it and those before it are
done, so that the end has only the last chunks left; a .npy output is merged at the end (its size must be known
first). The finished output, renamed into place once complete, is

  embeddings.parquet    columns path (string), embedding (fixed-size list), tokens (optional)
  or embeddings.npy [N, D] + embeddings.paths.json (its paths, row for row) (+ embeddings.tokens.npy)
  embeddings.skipped.tsv  path and reason of each input that is not an image or cannot be read

in input order (a shard's images in archive order, named SHARD#MEMBER), skipped inputs left out. The
settings travel in the output (Parquet metadata, the paths file), and for shards the list of those read, so
running a finished command again is recognised: it embeds only the files new in INPUT and writes their rows
after the output's (inputs gone from INPUT are named, and stay in the output). INPUT is recorded and compared
as an absolute path (a URL as it is): imgs, imgs/ and ./imgs are one folder.
"""

from __future__ import annotations

import csv
import errno
import fcntl
import io
import itertools
import json
import os
import shutil
import threading
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data.sources import absolute, is_shard
from ..utils import require, write_atomic

FORMATS = (".parquet", ".npy")
_META_KEY = b"vit_triton"


class UsageError(ValueError):
    """A problem with what the command was asked to do (exit status 2), not with running it."""


def check_image_size(model, size: tuple[int, int] | None) -> None:
    """UsageError unless the model runs images of --image-size `size` (height, width), if one was given."""
    if size is not None:
        try:
            model.grid(*size)
        except ValueError as e:
            raise UsageError(f"--image-size {size[0]}x{size[1]}: {e}") from None


@dataclass(frozen=True)
class Summary:
    output: Path
    done: int                 # images embedded, over all runs of this output
    skipped: int              # inputs listed in the skipped file
    skipped_file: Path
    processed: int = 0        # inputs handled by this run (embedded or skipped)
    seconds: float = 0.0      # this run's time
    gpu_decoded: int = 0      # images of this run that nvJPEG decoded
    cpu_decoded: int = 0      # images of this run decoded on the CPU


def _json_bytes(obj) -> bytes:
    return json.dumps(obj, indent=1).encode()


class ChunkStore:
    """The output of one embed command: its work directory while running, its files when done."""

    def __init__(self, output: str | os.PathLike, settings: dict) -> None:
        self.output = Path(output)
        if self.output.suffix not in FORMATS:
            raise UsageError(f"--output must end in {' or '.join(FORMATS)} (Parquet, or NumPy + a paths file), "
                             f"got {self.output}")
        if self.output.suffix == ".parquet":
            require("pyarrow.parquet", "embed", "--output *.parquet")
        self.settings = _absolute_input(settings)
        self.chunk_size: int = settings["chunk_size"]
        self.work = self.output.with_name(self.output.name + ".partial")
        self.lock_file = self.output.with_name(self.output.name + ".lock")
        stem = self.output.name.removesuffix(self.output.suffix)
        self.skipped_file = self.output.with_name(stem + ".skipped.tsv")
        self.paths_file = self.output.with_name(stem + ".paths.json")
        self.tokens_file = self.output.with_name(stem + ".tokens.npy")
        self._done_file = self.output if self.output.suffix == ".parquet" else self.paths_file

    # -- starting, resuming --

    @contextmanager
    def lock(self):
        """Hold OUT.lock for the with-block: a POSIX record lock, which the kernel releases when the process
        ends, however (kill -9 included), and which child processes do not inherit. Raises UsageError,
        naming the process that holds it, while another one does."""
        self.lock_file.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(self.lock_file, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno not in (errno.EACCES, errno.EAGAIN):
                    raise
                raise UsageError(f"another vit-triton embed run (PID {self._lock_holder()}) is writing "
                                 f"{self.output}: it holds {self.lock_file}; wait for it to end, or stop it") from None
            if _same_file(fd, self.lock_file):
                break
            os.close(fd)  # removed by a run that just ended (see below): lock the file now at its path
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
            yield
        finally:
            self.lock_file.unlink(missing_ok=True)  # still holding it, so that no one locks the removed file
            os.close(fd)

    def _lock_holder(self) -> str:
        try:
            return self.lock_file.read_text().strip() or "?"
        except OSError:
            return "?"

    def prepare(self, list_inputs, log, overwrite: bool = False) -> tuple[list[str] | None, str]:
        """Start a run or pick one up: (inputs, "new" | "resumed"), (the inputs new in INPUT, "added") to add
        to this finished output, or (None, "complete") when it is finished with the same settings and INPUT
        has nothing new; log(message) says what changed in INPUT. Rank 0 only, holding the lock."""
        if overwrite:
            self._remove_outputs()
        if (self.work / "manifest.json").is_file():
            saved = json.loads((self.work / "manifest.json").read_text())["settings"]
            self._check_same(saved, f"a run into {self.output} was started")
            for stale in self.work.glob("*.tmp-*"):  # left by a killed run
                stale.unlink()
            inputs = self.read_inputs()
            written = self.written_inputs(base=True) if self._base(self._done_file).is_file() else []
            added, _ = _changes(written + inputs, list_inputs())
            if added:
                log(f"vit-triton embed: {len(added)} file(s) new in INPUT since this run started are not part of "
                    f"it: run the command again when it is done to add them")
            return inputs, "resumed"
        if self._done_file.is_file() or self.output.is_file():
            meta = self.final_metadata()
            if meta is None:
                raise UsageError(f"{self.output} exists and was not written by vit-triton embed: choose another "
                                 f"--output or pass --overwrite")
            self._check_same(meta["settings"], f"{self.output} was written")
            listed = list_inputs()
            if ("shards" in meta) != is_shard(listed[0]):
                kinds = ("image files", "tar shards") if is_shard(listed[0]) else ("tar shards", "image files")
                raise UsageError(f"{self.output} was written from {kinds[0]}, but INPUT now names {kinds[1]}: "
                                 f"pass --overwrite to start over")
            added, removed = _changes(self.written_inputs(), listed)
            if removed:
                log(f"vit-triton embed: warning: {len(removed)} input(s) of {self.output} are no longer in INPUT "
                    f"(the first: {removed[0]}): they stay in it; pass --overwrite to embed INPUT as it is now")
            if not added:
                return None, "complete"
            log(f"vit-triton embed: {len(added)} file(s) new in INPUT since {self.output} was written: embedding "
                f"them, to add after its {meta['done']} rows")
            self._start(added, base=True)
            return added, "added"
        inputs = list_inputs()
        self._start(inputs, base=False)
        return inputs, "new"

    def _start(self, inputs: list[str], base: bool) -> None:
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        if base:
            # The finished output as it is now, for the merge to read (and again after a kill while merging).
            for path in (self.output, self.tokens_file, self.paths_file, self.skipped_file):
                if path.is_file():
                    _snapshot(path, self._base(path))
        write_atomic(self.work / "inputs.jsonl", lambda f: f.writelines(
            (json.dumps(p) + "\n").encode() for p in inputs))
        # The manifest last: a work directory without one is from a run killed while starting.
        write_atomic(self.work / "manifest.json", lambda f: f.write(_json_bytes(
            {"settings": self.settings, "num_inputs": len(inputs)})))

    def _base(self, path: Path) -> Path:
        """Where the work directory keeps the finished output's file `path` while new inputs are added to it."""
        return self.work / f"base.{path.name}"

    def _check_same(self, saved: dict, what: str) -> None:
        saved = _absolute_input(saved)  # as it is recorded now, if it was not
        diff = [f"{k}: {saved.get(k)!r} then, {v!r} now" for k, v in self.settings.items() if saved.get(k) != v]
        if diff:
            raise UsageError(f"{what} with other settings ({'; '.join(diff)}): run it with the same ones to "
                             f"resume, or pass --overwrite to start over")

    def _remove_outputs(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)
        for path in (self.output, self.skipped_file, self.paths_file, self.tokens_file):
            path.unlink(missing_ok=True)

    def read_inputs(self) -> list[str]:
        # One JSON array of the lines: a quarter of the time of a json.loads a line (millions of inputs, every rank).
        text = (self.work / "inputs.jsonl").read_text(encoding="utf-8")
        return json.loads("[" + text.rstrip("\n").replace("\n", ",") + "]")

    def _inputs_per_chunk(self, inputs: list[str]) -> int:
        return 1 if inputs and is_shard(inputs[0]) else self.chunk_size

    def num_chunks(self, inputs: list[str]) -> int:
        return -(-len(inputs) // self._inputs_per_chunk(inputs))

    def chunk_range(self, chunk: int, inputs: list[str]) -> range:
        """The indices of chunk `chunk`'s inputs: chunk_size image files, or one tar shard."""
        size = self._inputs_per_chunk(inputs)
        return range(chunk * size, min((chunk + 1) * size, len(inputs)))

    def pending(self, inputs: list[str]) -> list[int]:
        """Chunks without a done marker, in order."""
        return [k for k in range(self.num_chunks(inputs)) if not self._marker(k).is_file()]

    def _marker(self, chunk: int) -> Path:
        return self.work / f"chunk-{chunk:06d}.json"

    def _part(self, chunk: int, part: int) -> Path:
        return self.work / f"chunk-{chunk:06d}-{part:04d}.npz"

    # -- writing --

    def write_part(self, chunk: int, part: int, names: list[str], embedding: np.ndarray,
                   tokens: np.ndarray | None) -> None:
        """Rows of a chunk, in order: part 0, 1, ... of it; finish_chunk says how many parts it has."""
        arrays = {"name": np.array(names, dtype=str), "embedding": embedding,
                  **({"tokens": tokens} if tokens is not None else {})}
        write_atomic(self._part(chunk, part), lambda f: np.savez(f, **arrays))

    def finish_chunk(self, chunk: int, parts: int, rows: int, skipped: list[tuple[str, str]]) -> None:
        """The done marker of a chunk whose `parts` parts are written: it has `rows` rows, and `skipped` (name,
        reason), in order, are its inputs that are not embedded."""
        write_atomic(self._marker(chunk), lambda f: f.write(_json_bytes(
            {"rows": rows, "parts": parts, "skipped": skipped})))

    def merging(self, inputs: list[str]) -> Merge:
        """Rank 0's merge of the chunks, started: a Parquet output takes each chunk as it is done, in order, on a
        thread of its own while the run embeds. Use it as a context manager around the run and call its finish()."""
        return Merge(self, inputs).start()

    # -- reading a finished output --

    def final_metadata(self, base: bool = False) -> dict | None:
        """{"settings", "done", "skipped"} of a finished output (of its copy in the work directory with base),
        None if it is not one of ours."""
        output, paths_file = (self._base(p) if base else p for p in (self.output, self.paths_file))
        try:
            if output.suffix == ".parquet":
                import pyarrow.parquet as pq

                raw = (pq.read_schema(output).metadata or {}).get(_META_KEY)
                return json.loads(raw) if raw else None
            meta = json.loads(paths_file.read_text())
            return meta if "settings" in meta and output.is_file() else None
        except (OSError, ValueError):
            return None

    def written_inputs(self, base: bool = False) -> list[str]:
        """The inputs of a finished output (of its copy in the work directory with base): the shards it read;
        else the paths of its rows, then those of its skipped-files list (none if that was deleted: they are
        tried again)."""
        meta = self.final_metadata(base)
        if "shards" in meta:
            return meta["shards"]
        output, paths_file, skipped_file = (self._base(p) if base else p
                                            for p in (self.output, self.paths_file, self.skipped_file))
        if output.suffix == ".parquet":
            import pyarrow.parquet as pq

            paths = pq.read_table(output, columns=["path"])["path"].to_pylist()
        else:
            paths = json.loads(paths_file.read_text())["paths"]
        return paths + [path for path, _ in _read_tsv(skipped_file)]

    def finished_summary(self) -> Summary:
        meta = self.final_metadata()
        return Summary(self.output, meta["done"], meta["skipped"], self.skipped_file)


_POLL_SECONDS = 0.25  # how often the merging thread looks for the next chunk's marker


class Merge:
    """Rank 0's merge of the chunks into the output, in input order, after the finished output's rows when adding to
    it. For Parquet, start() runs a thread that appends each chunk's rows once its marker is there, so that finish()
    has only the chunks not merged yet left to do; a .npy output is merged by finish() alone (its memmap needs the
    row count up front). Left without finish() (a context manager), it stops the thread and removes the partial file;
    the chunks stay for the next run."""

    def __init__(self, store: ChunkStore, inputs: list[str]) -> None:
        self.store, self.inputs = store, inputs
        self.num_chunks = store.num_chunks(inputs)
        self.markers: list[dict] = []  # those of the chunks merged so far, in order
        self._base = store._base(store._done_file).is_file()
        self._parquet = store.output.suffix == ".parquet"
        # In the work directory, named as a temporary file: a later run removes it, whatever killed this one.
        self._partial = store.work / f"{store.output.name}.tmp-{os.getpid()}"
        self._writer = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._error: Exception | None = None

    def __enter__(self) -> Merge:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self) -> Merge:
        if self._parquet:
            self._thread = threading.Thread(target=self._follow, name="vit-triton merge", daemon=True)
            self._thread.start()
        return self

    def _follow(self) -> None:
        """The thread: each chunk once its marker is there, in order, until all are merged or stop is set. Most of
        its time is in file reads and pyarrow's writing, which release the GIL. It keeps the run's CPU priority: a
        nice value even 3 higher let it fall behind on busy CPUs (to 37 of 49 chunks) and left the end its work."""
        try:
            while len(self.markers) < self.num_chunks and not self._stop.is_set():
                if self.store._marker(len(self.markers)).is_file():
                    self._take(len(self.markers))
                else:
                    self._stop.wait(_POLL_SECONDS)
        except Exception as e:  # finish() raises it
            self._error = e

    def _halt(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def close(self) -> None:
        """Stop the thread; unless finish() put the output in place, remove the partial file."""
        self._halt()
        if self._writer is not None:
            with suppress(Exception):  # a file being discarded: its errors would only hide what stopped the run
                self._writer.close()
        self._partial.unlink(missing_ok=True)

    def finish(self) -> Summary:
        """Stop the thread (raising what it raised), merge the chunks it did not, write the skipped-files list, put
        the output in place, remove the work directory. Every chunk must be done."""
        self._halt()
        if self._error is not None:
            raise self._error
        store = self.store
        missing = [k for k in range(self.num_chunks) if not store._marker(k).is_file()]
        if missing:
            raise RuntimeError(f"cannot finish {store.output}: chunks {missing[:10]} are not done")
        for k in range(len(self.markers), self.num_chunks):
            self._take(k)
        old = store.final_metadata(base=True) if self._base else {"done": 0}
        rows = old["done"] + sum(m["rows"] for m in self.markers)
        skipped = (_read_tsv(store._base(store.skipped_file)) if self._base else []) + [
            (name, reason) for m in self.markers for name, reason in m["skipped"]]
        write_atomic(store.skipped_file, lambda f: f.write(tsv_bytes(skipped)))
        meta = {"settings": store.settings, "done": rows, "skipped": len(skipped)}
        if is_shard(self.inputs[0]):  # what a later run compares INPUT with: its rows name members, not shards
            meta["shards"] = old.get("shards", []) + self.inputs
        if self._parquet:
            self._close_parquet(meta)
        else:
            self._write_npy(rows, meta)
        shutil.rmtree(store.work)
        return Summary(store.output, rows, len(skipped), store.skipped_file)

    def _parts(self, chunk: int, marker: dict) -> list[Path]:
        return [self.store._part(chunk, p) for p in range(marker["parts"])]

    def _take(self, chunk: int) -> None:
        """Merge the next chunk: read its marker and, for Parquet, write its parts' rows (after the finished
        output's row groups, for the first)."""
        marker = json.loads(self.store._marker(chunk).read_text())
        if self._parquet:
            if chunk == 0 and self._base:
                import pyarrow.parquet as pq

                with pq.ParquetFile(self.store._base(self.store.output)) as old:
                    for g in range(old.num_row_groups):
                        self._write(old.read_row_group(g))
            for arrays in _part_arrays(self._parts(chunk, marker)):
                self._write(_row_group(arrays))
        self.markers.append(marker)

    def _write(self, table) -> None:
        if self._writer is None:
            import pyarrow.parquet as pq

            # No dictionary or statistics for the features: float vectors repeat nothing and are not filtered on,
            # and encoding them took 45% of the merge (200,000 ViT-B rows: 2.2 s, 1.2 s without).
            self._writer = pq.ParquetWriter(str(self._partial), table.schema.remove_metadata(),
                                            use_dictionary=False, write_statistics=["path"])
        self._writer.write_table(table.cast(self._writer.schema))

    def _close_parquet(self, meta: dict) -> None:
        """Close the partial file with `meta` in its schema, flushed to disk, and rename it onto the output.
        ParquetWriter takes its schema's metadata when it opens (add_key_value_metadata, pyarrow 13+, adds to the
        footer but not to the schema pq.read_schema gives): the footer it wrote is replaced by one of the same row
        groups and the schema with `meta`, which gives the bytes a writer given `meta` from the start writes."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        self._writer.close()
        empty = pa.BufferOutputStream()  # a file without rows, for its footer
        pq.write_metadata(self._writer.schema.with_metadata({_META_KEY: json.dumps(meta).encode()}), empty)
        footer = pq.read_metadata(pa.BufferReader(empty.getvalue()))
        footer.append_row_groups(pq.read_metadata(str(self._partial)))
        tail = pa.BufferOutputStream()
        footer.write_metadata_file(tail)  # PAR1, the footer, its length (4 bytes), PAR1
        with open(self._partial, "r+b") as f:
            end = f.seek(-8, os.SEEK_END)  # a Parquet file ends with the same three
            f.truncate(end - int.from_bytes(f.read(4), "little"))
            f.seek(0, os.SEEK_END)
            f.write(tail.getvalue()[4:])
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._partial, self.store.output)

    def _write_npy(self, rows: int, meta: dict) -> None:
        store = self.store
        parts = [part for k, m in enumerate(self.markers) for part in self._parts(k, m)]
        with np.load(parts[0]) as first:   # which arrays the parts hold (nothing read yet)
            held = first.files
        targets = {"embedding": store.output, "tokens": store.tokens_file}
        # The paths file says the output is complete: gone first (a finished output's, when adding to it), back last.
        store.paths_file.unlink(missing_ok=True)
        for name in [n for n in ("embedding", "tokens") if n in held]:
            tmp = targets[name].with_name(targets[name].name + f".tmp-{os.getpid()}")
            bases = [np.load(store._base(targets[name]), mmap_mode="r")] if self._base else []
            out, row = None, 0
            for array in itertools.chain(bases, (arrays[name] for arrays in _part_arrays(parts, (name,)))):
                if out is None:   # shaped by the first array: every part has one, if of no rows
                    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=array.dtype, shape=(rows, *array.shape[1:]))
                out[row:row + len(array)] = array
                row += len(array)
            out.flush()
            del out
            os.replace(tmp, targets[name])
        paths = json.loads(store._base(store.paths_file).read_text())["paths"] if self._base else []
        paths += [name for arrays in _part_arrays(parts, ("name",)) for name in arrays["name"].tolist()]
        write_atomic(store.paths_file, lambda f: f.write(_json_bytes({**meta, "paths": paths})))


def _part_arrays(parts: list[Path], names: tuple[str, ...] | None = None):
    """Each part's arrays, by name: those of `names` (default: all), the only members of its .npz read."""
    for part in parts:
        with np.load(part) as data:
            yield {name: data[name] for name in names or data.files}


def _row_group(arrays: dict):
    """A part's rows as a table: path, embedding (, tokens)."""
    import pyarrow as pa

    columns = {"path": pa.array(arrays["name"].tolist(), pa.string()),
               "embedding": _fixed_size_lists(arrays["embedding"])}
    if "tokens" in arrays:
        columns["tokens"] = _fixed_size_lists(arrays["tokens"])
    return pa.table(columns)


def tsv_bytes(rows: list[tuple[str, str]]) -> bytes:
    text = io.StringIO()
    writer = csv.writer(text, delimiter="\t", lineterminator="\n")
    writer.writerow(["path", "reason"])
    writer.writerows(rows)
    return text.getvalue().encode()


def _read_tsv(path: Path) -> list[tuple[str, str]]:
    """The (path, reason) rows of a skipped-files list; none if there is no such file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return [(p, reason) for p, reason in list(csv.reader(io.StringIO(text), delimiter="\t"))[1:]]


def _absolute_input(settings: dict) -> dict:
    return {**settings, "input": absolute(settings["input"])}


def _changes(old: list[str], new: list[str]) -> tuple[list[str], list[str]]:
    """(the paths of `new` not in `old`, in new's order; those of `old` not in `new`), compared as absolute paths."""
    old_abs, new_abs = ([absolute(p) for p in paths] for paths in (old, new))
    had, has = set(old_abs), set(new_abs)
    return [p for p, a in zip(new, new_abs) if a not in had], [p for p, a in zip(old, old_abs) if a not in has]


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except FileNotFoundError:
        return False


def _snapshot(path: Path, copy: Path) -> None:
    """`copy` is `path` as it is now, whatever happens to `path` later: a hard link (its files are replaced,
    never changed in place), or a copy where the file system has no hard links."""
    try:
        os.link(path, copy)
    except OSError:
        with open(path, "rb") as f:
            write_atomic(copy, lambda out: shutil.copyfileobj(f, out))


def _fixed_size_lists(array: np.ndarray):
    """[n, D] -> fixed_size_list<D>; [n, T, D] -> fixed_size_list<fixed_size_list<D>, T>."""
    import pyarrow as pa

    values = pa.array(np.ascontiguousarray(array).reshape(-1))
    for size in reversed(array.shape[1:]):
        values = pa.FixedSizeListArray.from_arrays(values, size)
    return values
