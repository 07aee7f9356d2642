"""Labelled images for fine-tuning: the samples and classes of a training or validation INPUT, and the Datasets
that decode them.

Three layouts, local or at URLs fsspec opens:

- a folder of class subfolders (torchvision's ImageFolder): TRAIN/cat/1.jpg is of class "cat"; the files under a
  class folder, at any depth, are its images;
- a CSV file of `path,label` rows (a first row `path,label` is a header), paths relative to the CSV's folder;
- tar shards (webdataset's layout, as sources.list_inputs names them) whose samples carry their class in KEY.cls
  (an integer or a name) or in KEY.json ("label" or "cls"), beside KEY.jpg (or another image suffix).

Labels are names (strings); classes are sorted as ImageFolder sorts its folders, by name, but as numbers where
every label is an integer (2 before 10). Every image is decoded once when the INPUT is scanned (`scan`): a file
that cannot be read is listed with its reason, never silently dropped, and training then reads only images known
to decode. A shard's images are found as the shard is read; each one is then read back by its byte offset.
"""

from __future__ import annotations

import csv
import io
import json
import os
import posixpath
import re
import tarfile
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset

from .decode import UnreadableImage, decode_image
from .sources import StrictTarInfo, filesystem, is_image_name, is_shard, is_url, list_inputs, open_source, read_bytes

CSV_HEADER = ["path", "label"]
# webdataset's sample key: a member's path up to the first dot of its file name; the rest is its field.
_KEY = re.compile(r"^((?:.*/)?[^./]+)\.([^/]*)$")


@dataclass(frozen=True)
class Sample:
    """One labelled image: its name (a path or URL, or SHARD#MEMBER), the file holding it, its class name, and
    for a shard member where its bytes lie in the shard (offset, size)."""

    name: str
    path: str
    label: str
    offset: int = -1
    size: int = 0

    def read(self) -> bytes:
        """The image's bytes; UnreadableImage when they cannot be read."""
        if self.offset < 0:
            return read_bytes(self.path)
        try:
            with open_source(self.path) as f:
                f.seek(self.offset)
                data = f.read(self.size)
        except Exception as e:  # noqa: BLE001 -- the file system's and the network's errors alike
            raise UnreadableImage(f"cannot read file: {e}") from None
        if len(data) != self.size:
            raise UnreadableImage(f"cannot read file: {self.size} bytes expected at offset {self.offset}, "
                                  f"got {len(data)}")
        return data


@dataclass(frozen=True)
class Source:
    """A unit of scanning: an image file with its label, or a tar shard (label None: its samples carry theirs)."""

    path: str
    label: str | None = None


class Listing(NamedTuple):
    """What an INPUT names: its sources in a fixed order, (name, reason) of each file left out (outside the class
    folders), and whether its labels are folder names (ImageFolder's layout, sorted as names) or given (a CSV's or
    the shards', integers among them sorted as numbers)."""

    sources: list[Source]
    skipped: list[tuple[str, str]]
    folders: bool


def list_sources(spec: str) -> Listing:
    """The Listing of INPUT `spec`. Raises FileNotFoundError when spec names nothing, ValueError for a layout it
    is not (image files without labels, a malformed CSV, an empty class folder) naming what is expected."""
    if _suffix(spec) == ".csv":
        return Listing(_csv_sources(spec), [], False)
    files = list_inputs(spec)
    if is_shard(files[0]):
        return Listing([Source(f) for f in files], [], False)
    if not _is_dir(spec):
        raise ValueError(f"{spec} names image files without labels: expected a folder of class subfolders "
                         f"(ImageFolder's layout), a CSV of path,label rows, or tar shards whose samples carry "
                         f"a .cls or .json label")
    return Listing(*_folder_sources(spec, files), True)


def _suffix(spec: str) -> str:
    path = spec.split("?", 1)[0] if is_url(spec) else spec
    return os.path.splitext(path)[1].lower()


def _is_dir(spec: str) -> bool:
    if not is_url(spec):
        return os.path.isdir(spec)
    fs, path = filesystem(spec)
    return fs.isdir(path)


def _folder_sources(spec: str, files: list[str]) -> tuple[list[Source], list[tuple[str, str]]]:
    root = spec.rstrip("/") + "/"
    sources, outside = [], []
    for f in files:
        relative = f[len(root):] if is_url(spec) else os.path.relpath(f, spec).replace(os.sep, "/")
        label, sep, _ = relative.partition("/")
        if sep:
            sources.append(Source(f, label))
        else:
            outside.append((f, "not in a class folder (ImageFolder's layout: TRAIN/CLASS/IMAGE)"))
    if not is_url(spec):   # a class folder without files is not listed by list_inputs: look for one
        labels = {s.label for s in sources}
        empty = sorted(e.name for e in os.scandir(spec) if e.is_dir() and not e.name.startswith(".")
                       and e.name not in labels)
        if empty:
            raise ValueError(f"{spec}: class folder {os.path.join(spec, empty[0])} holds no files" +
                             (f" (nor do {len(empty) - 1} other(s): {', '.join(empty[1:4])})" if len(empty) > 1
                              else ""))
    if not sources:
        raise ValueError(f"{spec}: no class folders: expected ImageFolder's layout, {root}CLASS/IMAGE")
    return sources, outside


def _csv_sources(spec: str) -> list[Source]:
    try:
        with open_source(spec) as f:
            text = f.read().decode("utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{spec}: no such file") from None
    rows = list(csv.reader(io.StringIO(text)))
    base = posixpath.dirname(spec) if is_url(spec) else os.path.dirname(spec)
    sources = []
    for line, row in enumerate(rows, 1):
        if not row or (line == 1 and [c.strip().lower() for c in row] == CSV_HEADER):
            continue
        if len(row) != 2 or not row[0].strip() or not row[1].strip():
            raise ValueError(f"{spec}, line {line}: expected a path and a label (path,label), got {row}")
        path, label = row[0].strip(), row[1].strip()
        if not (is_url(path) or os.path.isabs(path)):
            path = (posixpath.join if is_url(spec) else os.path.join)(base, path)
        sources.append(Source(path, label))
    if not sources:
        raise ValueError(f"{spec}: no rows: expected path,label rows")
    return sources


def scan_source(source: Source) -> tuple[list[Sample], list[tuple[str, str]]]:
    """(the readable labelled images of a source, (name, reason) of each one left out): every image is decoded."""
    if source.label is not None:
        try:
            decode_image(read_bytes(source.path))
        except UnreadableImage as e:
            return [], [(source.path, str(e))]
        return [Sample(source.path, source.path, source.label)], []
    return _scan_shard(source.path)


def _scan_shard(shard: str) -> tuple[list[Sample], list[tuple[str, str]]]:
    """The labelled images of a shard, streamed: a sample's members (KEY.jpg, KEY.cls, KEY.json) are adjacent, as
    webdataset writes them. A damaged shard keeps the images before the damage, and is listed itself."""
    samples, skipped = [], []
    key, images, label = None, [], None

    def finish() -> None:
        for name, offset, size in images:
            if label is None:
                skipped.append((f"{shard}#{name}", f"no label: no {key}.cls, nor a {key}.json with 'label' or 'cls'"))
            else:
                samples.append(Sample(f"{shard}#{name}", shard, label, offset, size))

    try:
        file = open_source(shard)
    except Exception as e:  # noqa: BLE001 -- as in sources.read_bytes
        return [], [(shard, f"cannot read file: {getattr(e, 'strerror', None) or f'{type(e).__name__}: {e}'}")]
    count = 0
    with file:
        try:
            with tarfile.open(fileobj=file, mode="r|", tarinfo=StrictTarInfo) as tar:
                for member in tar:
                    match = _KEY.match(member.name)
                    if not member.isfile() or match is None:
                        continue
                    if match.group(1) != key:
                        finish()
                        key, images, label = match.group(1), [], None
                    field = match.group(2).lower()
                    if is_image_name(member.name):
                        count += 1
                        try:
                            decode_image(tar.extractfile(member).read())
                            images.append((member.name, member.offset_data, member.size))
                        except UnreadableImage as e:
                            skipped.append((f"{shard}#{member.name}", str(e)))
                    elif field == "cls":
                        label = _label(tar.extractfile(member).read().decode("utf-8", "replace")) or label
                    elif field == "json":
                        label = _json_label(tar.extractfile(member).read()) or label
        except Exception as e:  # noqa: BLE001 -- tarfile's, the file system's and the network's errors alike
            skipped.append((shard, f"truncated or corrupt tar after {count} image(s): {e}"))
        finish()
    return samples, skipped


def _label(value) -> str | None:
    """A label as a class name: an integer or a non-empty string; None for anything else."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        return None
    return str(value).strip() or None


def _json_label(data: bytes) -> str | None:
    try:
        obj = json.loads(data)
    except ValueError:
        return None
    return _label(obj.get("label", obj.get("cls"))) if isinstance(obj, dict) else None


def class_names(labels, folders: bool = False) -> list[str]:
    """The classes of `labels`, sorted as ImageFolder sorts class folders (by name); but for labels that are not
    folder names (a CSV's, the shards'), as numbers where every label is an integer, so that label k is class k."""
    names = set(labels)
    if not folders and all(re.fullmatch(r"[+-]?\d+", n) for n in names):
        return sorted(names, key=int)
    return sorted(names)


def split_validation(samples: list[Sample], fraction: float, seed: int) -> tuple[list[Sample], list[Sample]]:
    """(train, val): of each class, a random round(fraction * n) of its n samples (at least 1, at most n - 1,
    none of a class of one) held out for validation, drawn from `seed`; both in the samples' order."""
    if not 0 < fraction < 1:
        raise ValueError(f"the validation fraction must be between 0 and 1, got {fraction}")
    rng = np.random.default_rng(seed)
    by_class: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        by_class.setdefault(s.label, []).append(i)
    held = set()
    for label in class_names(by_class):
        members = by_class[label]
        k = min(max(round(fraction * len(members)), 1), len(members) - 1)
        held.update(members[j] for j in rng.permutation(len(members))[:k])
    return [s for i, s in enumerate(samples) if i not in held], [s for i, s in enumerate(samples) if i in held]


def sample_seed(seed: int, epoch: int, position: int) -> int:
    """The seed of the augmentation of the image at `position` of epoch `epoch`'s order: the same in every run,
    whatever the DataLoader workers, the processes or the point a run was resumed from."""
    return int(np.random.SeedSequence([seed, epoch, position]).generate_state(1, np.uint64)[0])


class LabeledImages(Dataset):
    """Decoded labelled images: item (epoch, position, i) is (uint8 pixels [C, H, W], class index) of sample i,
    made by `transform` (PIL image -> uint8 tensor) under the torch seed sample_seed(seed, epoch, position), which
    torchvision's random transforms draw from; the process's own random state is left as it was. Without a seed
    the item is a plain index i (evaluation, whose transform draws nothing)."""

    def __init__(self, samples: list[Sample], classes: list[str], transform, channels: int,
                 seed: int | None = None) -> None:
        index = {name: i for i, name in enumerate(classes)}
        self.samples, self.labels = samples, [index[s.label] for s in samples]
        self.transform, self.seed = transform, seed
        self.mode = "L" if channels == 1 else "RGB"

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item) -> tuple[torch.Tensor, int]:
        epoch, position, i = item if self.seed is not None else (0, 0, item)
        sample = self.samples[i]
        try:
            image = decode_image(sample.read(), self.mode)
        except UnreadableImage as e:
            # It decoded when the input was scanned: it changed since, which a run must not skip silently.
            raise OSError(f"{sample.name}: {e} (it was readable when the input was scanned)") from None
        if self.seed is None:
            return self.transform(image), self.labels[i]
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(sample_seed(self.seed, epoch, position))
            return self.transform(image), self.labels[i]

