"""What an INPUT names (folders, lists, globs, brace ranges of tar shards; local or through fsspec) and how a tar
shard is streamed: its images in order, its other members passed over, damage reported after the images before it."""

import io
import re
import tarfile
from pathlib import Path

import pytest

from tests.checkpoints import write_shard
from vit_triton.data import UnreadableImage
from vit_triton.data.sources import expand_braces, list_inputs, read_bytes, tar_images
from vit_triton.utils import MissingExtra


def test_expand_braces():
    assert expand_braces("d/{00000..00003}.tar") == [f"d/0000{i}.tar" for i in range(4)]
    assert expand_braces("{8..11}") == ["8", "9", "10", "11"]
    assert expand_braces("{09..11}/{a,b}") == ["09/a", "09/b", "10/a", "10/b", "11/a", "11/b"]
    assert expand_braces("{3..1}") == ["3", "2", "1"]
    assert expand_braces("x{1}{}.tar") == ["x{1}{}.tar"]  # neither a range nor a list: as it is


TREE = ("b.jpg", "a/c.png", "a/.d.png", "a/.hidden/e.png", "a/notes.txt", "z/f.webp")


def _write_tree(root: Path) -> None:
    for name in TREE:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(b"x")


def test_list_inputs(tmp_path):
    _write_tree(tmp_path)
    root = str(tmp_path)
    assert list_inputs(root) == [f"{root}/b.jpg", f"{root}/a/c.png", f"{root}/a/notes.txt", f"{root}/z/f.webp"]
    assert list_inputs(f"{root}/**/*.png") == [f"{root}/a/c.png"]
    assert list_inputs(f"{root}/b.jpg") == [f"{root}/b.jpg"]
    assert list_inputs(f"{root}/{{b.jpg,a/c.png,nope.jpg}}") == [f"{root}/b.jpg", f"{root}/a/c.png", f"{root}/nope.jpg"]
    (tmp_path / "list.txt").write_text("one.jpg\n\n two.png\r\n")
    assert list_inputs(f"{root}/list.txt") == ["one.jpg", " two.png"]
    with pytest.raises(FileNotFoundError, match="names no files"):
        list_inputs(f"{root}/*.gif")


def test_list_inputs_through_fsspec_as_locally(tmp_path, memory):
    fs, root = memory
    for name in TREE:
        fs.pipe(f"{root}/{name}", b"x")
    _write_tree(tmp_path)
    url, local = f"memory://{root}", str(tmp_path)
    for spec in ("", "/", "/**/*.png", "/b.jpg", "/{b.jpg,z/f.webp}"):
        assert [p.removeprefix(url) for p in list_inputs(url + spec)] == \
            [p.removeprefix(local) for p in list_inputs(local + spec)], spec
    fs.pipe(f"{root}/list.txt", b"s3://bucket/one.jpg\nb.jpg\n")
    assert list_inputs(f"{url}/list.txt") == ["s3://bucket/one.jpg", "b.jpg"]
    assert read_bytes(f"{url}/b.jpg") == b"x"
    with pytest.raises(UnreadableImage, match="cannot read file: FileNotFoundError"):
        read_bytes(f"{url}/nope.jpg")
    with pytest.raises(FileNotFoundError, match=f"INPUT {url}/nope: no such file or directory"):
        list_inputs(f"{url}/nope")


def test_shards_are_listed_as_img2dataset_writes_them(tmp_path):
    for name in ("00000.tar", "00000.parquet", "00000_stats.json", "00001.tar", "00002.tar"):
        (tmp_path / name).write_bytes(b"x")
    root = str(tmp_path)
    shards = [f"{root}/0000{i}.tar" for i in range(3)]
    assert list_inputs(root) == shards  # the other files beside the shards are left out
    assert list_inputs(f"{root}/*.tar") == list_inputs(f"{root}/{{00000..00002}}.tar") == shards
    assert list_inputs(f"{root}/00001.tar") == shards[1:2]
    (tmp_path / "shards.txt").write_text("\n".join(shards + ["https://host/data/00003.tar?download=1"]) + "\n")
    assert list_inputs(f"{root}/shards.txt") == shards + ["https://host/data/00003.tar?download=1"]
    # a brace range is not looked up beyond its first name: at web scale that would be a request per shard
    assert list_inputs(f"{root}/{{00001..00004}}.tar") == [f"{root}/0000{i}.tar" for i in range(1, 5)]
    with pytest.raises(FileNotFoundError, match=rf"INPUT {root}/{{00005..00009}}.tar: names no files "
                                                rf"\({root}/00005.tar, the first of its 5 names, does not exist\)"):
        list_inputs(f"{root}/{{00005..00009}}.tar")
    (tmp_path / "photo.jpg").write_bytes(b"x")
    with pytest.raises(ValueError, match=rf"INPUT {root}: names both tar shards and image files \({root}/00000.tar, "
                                         rf"{root}/photo.jpg, ...\): name one kind, the shards alone with a glob"):
        list_inputs(root)


def test_a_protocol_without_its_package_or_unknown_is_named(missing_protocol):
    protocol, err = missing_protocol
    with pytest.raises(MissingExtra, match=rf"^{protocol}://bucket/data/: fsspec's {protocol}:// file system needs a "
                                           rf"package that is not installed: {re.escape(err)}$"):
        list_inputs(f"{protocol}://bucket/data/")
    with pytest.raises(ValueError, match=r"^nosuch://bucket/x.tar: no fsspec file system reads nosuch:// URLs "
                                         r"\(expected a protocol such as s3, gs, https or file\)$"):
        list_inputs("nosuch://bucket/x.tar")


def _members() -> list[tuple[str, bytes]]:
    return [("000000.jpg", b"a" * 700), ("000000.txt", b"a caption"), ("000000.json", b"{}"),
            ("000001.PNG", b"b" * 1500), ("000001.txt", b"another"), ("000002.webp", b"c" * 300)]


def test_tar_images_streams_a_shards_images(tmp_path, memory):
    data = write_shard(tmp_path / "s.tar", _members())
    want = [(name, body) for name, body in _members() if not name.endswith((".txt", ".json"))]
    assert list(tar_images(str(tmp_path / "s.tar"))) == want
    fs, root = memory
    fs.pipe(f"{root}/s.tar", data)
    assert list(tar_images(f"memory://{root}/s.tar")) == want
    with pytest.raises(UnreadableImage, match="^cannot read file: No such file or directory$"):
        next(tar_images(str(tmp_path / "nope.tar")))


def _offsets(data: bytes) -> dict[str, int]:
    """Member name -> offset of its header in the tar `data`."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return {m.name: m.offset for m in tar.getmembers()}


@pytest.mark.parametrize("damage, kept, reason", [
    ("cut in the data of 000001.PNG", 1, "unexpected end of data"),
    ("cut between two samples", 1, "unexpected end of data"),
    ("cut in the header of 000001.PNG", 1, r"bad header \(truncated header\)"),
    ("corrupt header of 000001.txt", 2, r"bad header \(bad checksum\)"),
    ("empty file", 0, "unexpected end of data"),
])
def test_a_damaged_shard_keeps_the_images_before_the_damage_and_says_so(damage, kept, reason, tmp_path):
    # tarfile alone would end quietly at a cut or corrupt header: the images after it would be lost unseen.
    data = bytearray(write_shard(tmp_path / "s.tar", _members()))
    at = _offsets(bytes(data))
    data = {"cut in the data of 000001.PNG": data[:at["000001.PNG"] + 512 + 1000],
            "cut between two samples": data[:at["000001.PNG"]],
            "cut in the header of 000001.PNG": data[:at["000001.PNG"] + 100],
            "corrupt header of 000001.txt": data[:at["000001.txt"]] + b"\xff" * 8 + data[at["000001.txt"] + 8:],
            "empty file": b""}[damage]
    (tmp_path / "s.tar").write_bytes(bytes(data))
    found = []
    with pytest.raises(UnreadableImage, match=rf"^truncated or corrupt tar after {kept} image\(s\): {reason}$"):
        for name, body in tar_images(str(tmp_path / "s.tar")):
            found.append((name, body))
    assert found == [(n, b) for n, b in _members() if not n.endswith((".txt", ".json"))][:kept]
