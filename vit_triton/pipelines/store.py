"""The embed command's output: chunks written atomically beside the output, with a manifest, merged
into one file in input order. This is what makes a run resumable after any kill, kill -9 included.

While running, for OUT = embeddings.parquet (or embeddings.npy), the run holds a lock on OUT.lock
(one run at a time into an output; the kernel releases it when the process dies), and the work
directory OUT.partial/ holds

  manifest.json         the settings that decide the output (a resumed run must have the same), the working
                        directory relative paths are relative to, and the finished output's inputs replaced in place
  inputs.jsonl          the input paths (image files or tar shards), one JSON string per line: line i is input i
  stats.json            each input's [size, mtime_ns] when it was listed (null for a URL or a missing file)
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
  or embeddings.npy [N, D] + embeddings.paths.json (an object: "paths", those of the rows in order, and the
                        run's "settings", "cwd", "done" and "skipped") (+ embeddings.tokens.npy)
  embeddings.skipped.tsv  path and reason of each input that is not an image or cannot be read
  embeddings.inputs.tsv   path, size and mtime_ns of each input (image file or tar shard) as it was listed

in input order (a shard's images in archive order, named SHARD#MEMBER), skipped inputs left out. The
settings travel in the output (Parquet metadata, the paths file), and for shards the list of those read, so
running a finished command again is recognised: it embeds only the files new in INPUT, and those replaced in
place (another size or modification time than the inputs file records), and writes their rows after the
output's, the replaced files' old rows and skipped entries left out (inputs gone from INPUT are named, and stay in
the output). A resumed run likewise embeds again the done chunks of files changed since it started. INPUT, and
--model where it is a local checkpoint, are recorded and compared as absolute paths (a URL or hub id as it is):
imgs, imgs/ and ./imgs are one folder. The inputs' paths are recorded as INPUT lists them: relative ones only
name the same files from the working directory the output was started in, where a later run must be.
The output's own files, in INPUT, are no inputs.
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
from collections.abc import Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..data.sources import absolute, file_stat, is_shard, is_url
from ..utils import require, write_atomic

FORMATS = (".parquet", ".npy")
_META_KEY = b"vit_triton"
_INPUTS_HEADER = ("path", "size", "mtime_ns")


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
    phases: dict[str, float] = field(default_factory=dict)   # this run's wall-clock seconds in each phase, in order


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
        self.settings = _resolved(settings)
        self.chunk_size: int = settings["chunk_size"]
        self.work = self.output.with_name(self.output.name + ".partial")
        self.lock_file = self.output.with_name(self.output.name + ".lock")
        stem = self.output.name.removesuffix(self.output.suffix)
        self.skipped_file = self.output.with_name(stem + ".skipped.tsv")
        self.paths_file = self.output.with_name(stem + ".paths.json")
        self.tokens_file = self.output.with_name(stem + ".tokens.npy")
        self.inputs_file = self.output.with_name(stem + ".inputs.tsv")
        self._done_file = self.output if self.output.suffix == ".parquet" else self.paths_file
        files = [os.path.abspath(p) for p in (self.output, self.lock_file, self.skipped_file, self.paths_file,
                                              self.tokens_file, self.inputs_file)]
        self._own_files = set(files)
        self._own_prefixes = (os.path.abspath(self.work) + os.sep, *(f + ".tmp-" for f in files))

    # -- starting, resuming --

    @contextmanager
    def lock(self):
        """Hold OUT.lock for the with-block: a POSIX record lock, which the kernel releases when the process
        ends, however (kill -9 included), and which child processes do not inherit. Raises UsageError,
        naming the process that holds it, while another one does, and for an output path that cannot be a file."""
        for folder in self.output.parents:   # the nearest one there must be a directory
            if folder.exists():
                if not folder.is_dir():
                    raise UsageError(f"--output {self.output}: {folder} is a file, not a directory")
                break
        if self.output.is_dir():
            raise UsageError(f"--output {self.output} is a directory: expected a file's path, ending in "
                             f"{' or '.join(FORMATS)}")
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
        """Start a run or pick one up: (inputs, "new" | "resumed"), (the inputs new in INPUT or replaced in place,
        "added") to add to this finished output, or (None, "complete") when it is finished with the same settings
        and INPUT has nothing new; log(message) says what changed in INPUT. list_inputs() lists INPUT; this
        output's own files among them are left out. Rank 0 only, holding the lock."""
        if overwrite:
            self._remove_outputs()
        if (self.work / "manifest.json").is_file():
            manifest = self.manifest()
            self._check_same(manifest["settings"], f"a run into {self.output} was started")
            inputs = self.read_inputs()
            self._check_cwd(manifest.get("cwd"), inputs)
            for stale in self.work.glob("*.tmp-*"):  # left by a killed run
                stale.unlink()
            written = self.written_inputs(base=True) if self._base(self._done_file).is_file() else []
            added, _ = _changes(written + inputs, self._listed(list_inputs))
            if added:
                log(f"vit-triton embed: {len(added)} file(s) new in INPUT since this run started are not part of "
                    f"it: run the command again when it is done to add them")
            self._redo_changed(inputs, log)
            return inputs, "resumed"
        if self._done_file.is_file() or self.output.is_file():
            meta = self.final_metadata()
            if meta is None:
                raise UsageError(f"{self.output} exists and was not written by vit-triton embed: choose another "
                                 f"--output or pass --overwrite")
            self._check_same(meta["settings"], f"{self.output} was written")
            written = self.written_inputs()
            self._check_cwd(meta.get("cwd"), written)
            listed = self._listed(list_inputs)
            if ("shards" in meta) != is_shard(listed[0]):
                kinds = ("image files", "tar shards") if is_shard(listed[0]) else ("tar shards", "image files")
                raise UsageError(f"{self.output} was written from {kinds[0]}, but INPUT now names {kinds[1]}: "
                                 f"pass --overwrite to start over")
            added, removed = _changes(written, listed)
            if removed:
                log(f"vit-triton embed: warning: {len(removed)} input(s) of {self.output} are no longer in INPUT "
                    f"(the first: {removed[0]}): they stay in it; pass --overwrite to embed INPUT as it is now")
            replaced = self._replaced(listed)   # {the path listed: its name in the output}
            if not added and not replaced:
                return None, "complete"
            if added:
                log(f"vit-triton embed: {len(added)} file(s) new in INPUT since {self.output} was written: "
                    f"embedding them, to add after its {meta['done']} rows")
            if replaced:
                log(f"vit-triton embed: {len(replaced)} file(s) of {self.output} changed since it was written (size "
                    f"or modification time; the first: {next(iter(replaced))}): embedding them again, their rows "
                    f"to replace the old ones, after the others")
            chosen = set(added) | replaced.keys()
            inputs = [p for p in listed if p in chosen]
            self._start(inputs, base=True, replaced=list(replaced.values()))
            return inputs, "added"
        inputs = self._listed(list_inputs)
        self._start(inputs, base=False)
        return inputs, "new"

    def owns(self, path: str) -> bool:
        """Whether an input path is one of this output's own files: a finished output's, the lock, the work
        directory's, or a temporary file of one of them."""
        if is_url(path):
            return False
        path = os.path.abspath(path)
        return path in self._own_files or path.startswith(self._own_prefixes)

    def _listed(self, list_inputs) -> list[str]:
        """list_inputs(), this output's own files left out; UsageError if nothing else is left."""
        inputs = [p for p in list_inputs() if not self.owns(p)]
        if not inputs:
            raise UsageError(f"INPUT {self.settings['input']}: names no files but those of the output {self.output}")
        return inputs

    def _check_cwd(self, cwd: str | None, names: list[str]) -> None:
        """UsageError if `names`, the output's inputs, hold paths relative to `cwd`, the directory the output was
        started in, and this run is elsewhere: there they would name other files."""
        if cwd and cwd != os.getcwd() and any(not is_url(n) and not os.path.isabs(n) for n in names):
            raise UsageError(f"{self.output} names its inputs by paths relative to {cwd}, where it was started: "
                             f"run the command from there")

    def _replaced(self, listed: list[str]) -> dict[str, str]:
        """{path in `listed`: its name in the finished output} of its inputs whose size or modification time is not
        what the output's inputs file records (none where it records none)."""
        recorded = {absolute(name): (name, stat) for name, stat in _read_stats(self.inputs_file)}
        replaced = {}
        for path in listed:
            name, stat = recorded.get(absolute(path), (None, None))
            if name is not None and file_stat(path) != stat:
                replaced[path] = name
        return replaced

    def _redo_changed(self, inputs: list[str], log) -> None:
        """Of a run being resumed: the done chunks of inputs whose size or modification time changed since it
        started lose their markers, to be embedded again; every input's stat is recorded as it is now (the
        chunks still to do read them now)."""
        stats_file = self.work / "stats.json"
        now = [file_stat(p) for p in inputs]
        then = self.input_stats() if stats_file.is_file() else now   # a run started by an older version: unknown
        per_chunk = self._inputs_per_chunk(inputs)
        changed = [i for i, (a, b) in enumerate(zip(then, now)) if a != b and self._marker(i // per_chunk).is_file()]
        chunks = sorted({i // per_chunk for i in changed})
        for k in chunks:
            self._marker(k).unlink()
        if chunks:
            log(f"vit-triton embed: {len(changed)} file(s) changed since this run started (size or modification "
                f"time; the first: {inputs[changed[0]]}): embedding their {len(chunks)} chunk(s) again")
        write_atomic(stats_file, lambda f: f.write(json.dumps(now).encode()))

    def _start(self, inputs: list[str], base: bool, replaced: Sequence[str] = ()) -> None:
        shutil.rmtree(self.work, ignore_errors=True)
        self.work.mkdir(parents=True)
        if base:
            # The finished output as it is now, for the merge to read (and again after a kill while merging).
            for path in (self.output, self.tokens_file, self.paths_file, self.skipped_file, self.inputs_file):
                if path.is_file():
                    _snapshot(path, self._base(path))
        write_atomic(self.work / "inputs.jsonl", lambda f: f.writelines(
            (json.dumps(p) + "\n").encode() for p in inputs))
        write_atomic(self.work / "stats.json", lambda f: f.write(json.dumps([file_stat(p) for p in inputs]).encode()))
        # The manifest last: a work directory without one is from a run killed while starting.
        write_atomic(self.work / "manifest.json", lambda f: f.write(_json_bytes(
            {"settings": self.settings, "num_inputs": len(inputs), "cwd": os.getcwd(), "replaced": list(replaced)})))

    def _base(self, path: Path) -> Path:
        """Where the work directory keeps the finished output's file `path` while new inputs are added to it."""
        return self.work / f"base.{path.name}"

    def _check_same(self, saved: dict, what: str) -> None:
        saved = _resolved(saved)  # as it is recorded now, if it was not
        diff = [f"{k}: {saved.get(k)!r} then, {v!r} now" for k, v in self.settings.items() if saved.get(k) != v]
        if diff:
            raise UsageError(f"{what} with other settings ({'; '.join(diff)}): run it with the same ones to "
                             f"resume, or pass --overwrite to start over")

    def _remove_outputs(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)
        for path in (self.output, self.skipped_file, self.paths_file, self.tokens_file, self.inputs_file):
            path.unlink(missing_ok=True)

    def manifest(self) -> dict:
        """manifest.json of the run: {"settings", "num_inputs", "cwd", "replaced"}."""
        return json.loads((self.work / "manifest.json").read_text())

    def input_stats(self) -> list[tuple[int, int] | None]:
        """stats.json: each input's (size, mtime_ns) as this run recorded it."""
        return [tuple(s) if s else None for s in json.loads((self.work / "stats.json").read_text())]

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
        """{"settings", "cwd", "done", "skipped"} (and "shards") of a finished output (of its copy in the work
        directory with base), None if it is not one of ours."""
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
        skipped_file = self._base(self.skipped_file) if base else self.skipped_file
        return self.row_names(base) + [path for path, _ in _read_tsv(skipped_file)]

    def row_names(self, base: bool = False) -> list[str]:
        """The names of a finished output's rows (of its copy in the work directory with base), in order."""
        output, paths_file = (self._base(p) if base else p for p in (self.output, self.paths_file))
        if output.suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(output, columns=["path"])["path"].to_pylist()
        return json.loads(paths_file.read_text())["paths"]

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
        manifest = store.manifest()
        self._cwd, replaced = manifest.get("cwd"), manifest.get("replaced", [])
        self._gone = set(replaced)
        self._gone_members = tuple(f"{shard}#" for shard in replaced) if is_shard(inputs[0]) else ()
        # Which of the finished output's rows stay (None: all): not those of the inputs replaced in place.
        self._kept = (np.array([self._stays(name) for name in store.row_names(base=True)], dtype=bool)
                      if self._base and replaced else None)
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

    def _stays(self, name: str) -> bool:
        """Whether a row, skipped entry or input of the finished output stays in it: not one of an input replaced
        in place (a shard's rows are named SHARD#MEMBER)."""
        return name not in self._gone and not name.startswith(self._gone_members)

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
        """Stop the thread (raising what it raised), merge the chunks it did not, write the skipped-files list and the
        inputs file, put the output in place, remove the work directory. Every chunk must be done."""
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
        rows = (old["done"] if self._kept is None else int(self._kept.sum())) + sum(m["rows"] for m in self.markers)
        skipped = self._base_rows(store.skipped_file) + [
            (name, reason) for m in self.markers for name, reason in m["skipped"]]
        write_atomic(store.skipped_file, lambda f: f.write(tsv_bytes(skipped)))
        recorded = self._base_rows(store.inputs_file) + [
            (path, *(stat or ("", ""))) for path, stat in zip(self.inputs, store.input_stats())]
        write_atomic(store.inputs_file, lambda f: f.write(tsv_bytes(recorded, _INPUTS_HEADER)))
        meta = {"settings": store.settings, "cwd": self._cwd, "done": rows, "skipped": len(skipped)}
        if is_shard(self.inputs[0]):  # what a later run compares INPUT with: its rows name members, not shards
            meta["shards"] = [shard for shard in old.get("shards", []) if self._stays(shard)] + self.inputs
        if self._parquet:
            self._close_parquet(meta)
        else:
            self._write_npy(rows, meta)
        shutil.rmtree(store.work)
        return Summary(store.output, rows, len(skipped), store.skipped_file)

    def _base_rows(self, tsv: Path) -> list[tuple[str, ...]]:
        """The rows that stay of the finished output's skipped-files list or inputs file `tsv`; none if not adding."""
        return [row for row in _read_tsv(self.store._base(tsv)) if self._stays(row[0])] if self._base else []

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
                    start = 0
                    for g in range(old.num_row_groups):
                        table = old.read_row_group(g)
                        if self._kept is not None:
                            table, start = table.filter(self._kept[start:start + len(table)]), start + len(table)
                        self._write(table)
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

    def _kept_rows(self, array: np.ndarray):
        """The rows that stay of an array of the finished .npy output (a memmap), a block at a time."""
        if self._kept is None:
            return [array]
        return (array[s:s + _KEEP_BLOCK][self._kept[s:s + _KEEP_BLOCK]] for s in range(0, len(array), _KEEP_BLOCK))

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
            bases = self._kept_rows(np.load(store._base(targets[name]), mmap_mode="r")) if self._base else []
            out, row = None, 0
            for array in itertools.chain(bases, (arrays[name] for arrays in _part_arrays(parts, (name,)))):
                if out is None:   # shaped by the first array: every part has one, if of no rows
                    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=array.dtype, shape=(rows, *array.shape[1:]))
                out[row:row + len(array)] = array
                row += len(array)
            out.flush()
            del out
            os.replace(tmp, targets[name])
        paths = [name for name in store.row_names(base=True) if self._stays(name)] if self._base else []
        paths += [name for arrays in _part_arrays(parts, ("name",)) for name in arrays["name"].tolist()]
        write_atomic(store.paths_file, lambda f: f.write(_json_bytes({**meta, "paths": paths})))


_KEEP_BLOCK = 65536   # rows of a finished .npy output read at a time to leave those replaced out


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


def tsv_bytes(rows: list[tuple], header: tuple[str, ...] = ("path", "reason")) -> bytes:
    text = io.StringIO()
    writer = csv.writer(text, delimiter="\t", lineterminator="\n")
    writer.writerow(header)
    writer.writerows(rows)
    return text.getvalue().encode()


def _read_tsv(path: Path) -> list[tuple[str, ...]]:
    """The rows of a skipped-files list (path, reason) or inputs file (path, size, mtime_ns), header left out; none
    if there is no such file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    return [tuple(row) for row in list(csv.reader(io.StringIO(text), delimiter="\t"))[1:]]


def _read_stats(path: Path) -> list[tuple[str, tuple[int, int] | None]]:
    """(path, (size, mtime_ns) or None) of each input an inputs file records."""
    return [(p, (int(size), int(mtime)) if size else None) for p, size, mtime in _read_tsv(path)]


def _resolved(settings: dict) -> dict:
    """settings with INPUT, and the model where it is a local checkpoint, as absolute paths, as an output records and
    compares them (a URL or a hub id as it is)."""
    model = settings.get("model")
    if model is not None and os.path.exists(os.path.expanduser(model)):   # where from_pretrained reads it
        model = os.path.abspath(os.path.expanduser(model))
    return {**settings, "input": absolute(settings["input"]), **({"model": model} if "model" in settings else {})}


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
