"""Where images come from: the image files or tar shards an INPUT names, on a local disk or at any URL fsspec
opens (s3://, gs://, https://, ...), and their bytes. Plain local paths never go through fsspec.

A tar shard is webdataset's layout, the one img2dataset writes: samples KEY.jpg (or .png, .webp, ...) beside
KEY.txt and KEY.json. It is read as a stream, never indexed first: its images are found as it is read.
"""

from __future__ import annotations

import glob
import itertools
import os
import re
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlsplit

from PIL import Image

from ..utils import MissingExtra, require
from .decode import UnreadableImage, read_file

SHARD_SUFFIX = ".tar"
_GLOB_CHARS = "*?["
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_BRACES = re.compile(r"\{([^{}]*)\}")
_RANGE = re.compile(r"(-?\d+)\.\.(-?\d+)")


def is_url(path: str) -> bool:
    """Whether `path` is a URL (protocol://...), read through fsspec, rather than a local path."""
    return _URL.match(path) is not None


def is_shard(path: str) -> bool:
    """Whether `path` names a tar shard: it ends in .tar (a URL's query string aside)."""
    return (urlsplit(path).path if is_url(path) else path).lower().endswith(SHARD_SUFFIX)


def is_image_name(path: str) -> bool:
    """Whether `path` ends in an image suffix that Pillow registers (.jpg, .png, .webp, ...)."""
    return os.path.splitext(path)[1].lower() in Image.registered_extensions()


def absolute(spec: str) -> str:
    """INPUT as the output records and compares it: a URL as it is, a local path made absolute."""
    return spec if is_url(spec) else os.path.abspath(spec)


def file_stat(path: str) -> tuple[int, int] | None:
    """(size in bytes, modification time in ns) of a local file, which tell a file replaced in place; None for a
    URL, or a path that cannot be looked up."""
    if is_url(path):
        return None
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_size, stat.st_mtime_ns


def expand_braces(spec: str) -> list[str]:
    """The names of a brace pattern as webdataset writes it: {00000..00099} (integers, zero-padded to the width
    of an end with a leading zero) or {a,b,c}; several braces give every combination. A brace holding neither
    stays as it is."""
    for match in _BRACES.finditer(spec):
        body, numbers = match.group(1), _RANGE.fullmatch(match.group(1))
        if numbers:
            first, last = (int(n) for n in numbers.groups())
            padded = [n for n in numbers.groups() if len(n.lstrip("-")) > 1 and n.lstrip("-").startswith("0")]
            width = max(map(len, numbers.groups())) if padded else 0
            step = 1 if last >= first else -1
            choices = [f"{n:0{width}d}" for n in range(first, last + step, step)]
        elif "," in body:
            choices = body.split(",")
        else:
            continue
        head, tails = spec[:match.start()], expand_braces(spec[match.end():])
        return [head + choice + tail for choice, tail in itertools.product(choices, tails)]
    return [spec]


def list_inputs(spec: str) -> list[str]:
    """The image files or the tar shards INPUT names, in a fixed order; local paths or URLs.

    A directory: every file under it, recursively, sorted, hidden files and directories (".name") left out;
    non-images among them are listed as skipped later, not dropped silently. A file with an image or .tar
    suffix: that one. Another file: a list of paths or URLs, one per line (relative paths are relative to the
    current directory). A brace pattern (data/{00000..00099}.tar): its names, not looked up beyond the first
    (a missing one is listed as skipped when it is read). Anything else with * ? or [: a glob pattern (**
    spans directories). A URL names the same through fsspec.

    INPUT names tar shards when it names at least one .tar file and no image file: the other files beside them
    (img2dataset's .parquet and _stats.json) are left out. Raises FileNotFoundError if INPUT is none of these
    or names no file, ValueError if it names both shards and images or a protocol fsspec does not know, and
    MissingExtra if fsspec or the protocol's package is not installed.
    """
    names = expand_braces(spec)
    if names != [spec]:
        if not _exists(names[0]):
            raise FileNotFoundError(f"INPUT {spec}: names no files ({names[0]}, the first of its {len(names)} "
                                    f"names, does not exist)")
        files = names
    else:
        files = _list_url(spec) if is_url(spec) else _list_local(spec)
    if not files:
        raise FileNotFoundError(f"INPUT {spec}: names no files")
    shards = [f for f in files if is_shard(f)]
    if not shards:
        return files
    images = [f for f in files if is_image_name(f)]
    if images:
        raise ValueError(f"INPUT {spec}: names both tar shards and image files ({shards[0]}, {images[0]}, ...): "
                         f"name one kind, the shards alone with a glob such as 'data/*.tar'")
    return shards


def _list_local(spec: str) -> list[str]:
    path = Path(spec)
    if path.is_dir():
        files = []
        for root, dirs, names in os.walk(path, followlinks=True):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            files += [os.path.join(root, n) for n in sorted(names) if not n.startswith(".")]
        return files
    if path.is_file():
        if is_image_name(spec) or is_shard(spec):
            return [spec]
        with open(path, encoding="utf-8") as f:
            return _lines(f)
    if any(c in spec for c in _GLOB_CHARS):
        return sorted(p for p in glob.glob(spec, recursive=True) if not os.path.isdir(p))
    raise FileNotFoundError(f"INPUT {spec}: no such file or directory, and not a glob pattern")


def _list_url(spec: str) -> list[str]:
    fs, path = filesystem(spec)
    if any(c in urlsplit(spec).path for c in _GLOB_CHARS):  # a ? after the path starts a query, not a pattern
        wild = min(i for i in map(path.find, _GLOB_CHARS) if i >= 0)
        fixed = path[:wild].rsplit("/", 1)[0] + "/"  # the folder the wildcards start in
        return sorted(fs.unstrip_protocol(p) for p in fs.glob(path)
                      if not _hidden(p[len(fixed):]) and not fs.isdir(p))
    # By its name before anything else: asking whether an https:// URL is a directory downloads it.
    if is_image_name(spec) or is_shard(spec):
        if fs.exists(path):
            return [spec]
    elif fs.isdir(path):
        root = path.rstrip("/") + "/"
        found = [p for p in fs.find(path) if not _hidden(p[len(root):])]
        return [fs.unstrip_protocol(p) for p in sorted(found, key=lambda p: _walk_order(p[len(root):]))]
    elif fs.isfile(path):
        with fs.open(path, "rt", encoding="utf-8") as f:
            return _lines(f)
    raise FileNotFoundError(f"INPUT {spec}: no such file or directory, and not a glob pattern")


def _hidden(relative: str) -> bool:
    """Whether a path below a listed folder, or matched by a pattern's wildcards, is hidden (as the local listing
    and Python's glob leave it out): a name on it starts with a dot."""
    return any(part.startswith(".") for part in relative.split("/"))


def _lines(file) -> list[str]:
    return [line.rstrip("\r\n") for line in file if line.strip()]


def _walk_order(relative: str) -> list[tuple[int, str]]:
    """Sort key that puts a folder's files in os.walk's order, as the local listing has them: a directory's
    files first, then its subdirectories', each by name."""
    *dirs, name = relative.split("/")
    return [(1, d) for d in dirs] + [(0, name)]


def filesystem(url: str):
    """(fsspec file system, path in it) of a URL. MissingExtra when fsspec, or the package of the URL's protocol
    (s3fs for s3://, ...), is not installed; ValueError for a protocol fsspec does not know."""
    fsspec = require("fsspec", "embed", f"reading {url}")
    protocol = url.split("://", 1)[0]
    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:  # fsspec knows the protocol; its message names the package it lacks
        raise MissingExtra(f"{url}: fsspec's {protocol}:// file system needs a package that is not installed: "
                           f"{e}") from None
    except ValueError:
        raise ValueError(f"{url}: no fsspec file system reads {protocol}:// URLs (expected a protocol such as "
                         f"s3, gs, https or file)") from None


def _exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    fs, inner = filesystem(path)
    return fs.exists(inner)


def open_source(path: str) -> BinaryIO:
    """The file at a local path or a URL, open for reading bytes."""
    if not is_url(path):
        return open(path, "rb")
    fs, inner = filesystem(path)
    return fs.open(inner, "rb")


def _cannot_read(e: Exception) -> UnreadableImage:
    return UnreadableImage(f"cannot read file: {getattr(e, 'strerror', None) or f'{type(e).__name__}: {e}'}")


def read_bytes(path: str) -> bytes:
    """The bytes of the file at a local path or a URL; UnreadableImage when it cannot be read."""
    if not is_url(path):
        return read_file(path)
    try:
        with open_source(path) as f:
            return f.read()
    except Exception as e:  # noqa: BLE001 -- each fsspec back end raises its own errors for a failed read
        raise _cannot_read(e) from None


class StrictTarInfo(tarfile.TarInfo):
    """A tar header that ends the archive only where its end-of-archive block is: tarfile takes a missing, cut
    or corrupt header after the first one for the end, which would drop the rest of a damaged shard unseen."""

    @classmethod
    def fromtarfile(cls, tar: tarfile.TarFile) -> tarfile.TarInfo:
        try:
            return super().fromtarfile(tar)
        except tarfile.EOFHeaderError:  # a block of zeros: the end of the archive
            raise
        except tarfile.EmptyHeaderError:
            raise tarfile.ReadError("unexpected end of data") from None
        except tarfile.HeaderError as e:
            raise tarfile.ReadError(f"bad header ({e})") from None


def tar_images(shard: str) -> Iterator[tuple[str, bytes]]:
    """(member name, bytes) of each image of the tar shard at a local path or URL, streamed in archive order;
    its other members (a sample's .txt, .json, ...) are passed over. Raises UnreadableImage when the shard cannot
    be opened, or at the first damage (truncated or corrupt), after the images before it."""
    try:
        file = open_source(shard)
    except Exception as e:  # noqa: BLE001 -- as in read_bytes
        raise _cannot_read(e) from None
    count = 0
    with file:
        try:
            with tarfile.open(fileobj=file, mode="r|", tarinfo=StrictTarInfo) as tar:
                for member in tar:
                    if member.isfile() and is_image_name(member.name):
                        yield member.name, tar.extractfile(member).read()
                        count += 1
        except Exception as e:  # noqa: BLE001 -- tarfile's, the file system's and the network's errors alike
            raise UnreadableImage(f"truncated or corrupt tar after {count} image(s): {e}") from None
