"""Decoding on the GPU: which files the workers leave to nvJPEG, how a batch's pixels are put together from both
decoders in input order (nvJPEG failures decoded on the CPU, or named), and, on a CUDA device, how close
`embed --decode gpu` comes to `--decode cpu`. Without CUDA, torchvision's CPU JPEG decoder (libjpeg-turbo, as
Pillow's: the same pixels) stands in for nvJPEG, so the batch assembly and the resize kernel run as they do there."""

import io

import numpy as np
import pytest
import torch
from PIL import Image, JpegImagePlugin

from tests.checkpoints import image, save_timm, timm_model
from tests.numerics import DEVICE
from vit_triton.cli import main
from vit_triton.data import Preprocess
from vit_triton.data.decode import nvjpeg_decodable
from vit_triton.data.files import image_item, make_batch
from vit_triton.pipelines.embed import _decoding as decoding
from vit_triton.pipelines.store import UsageError

pytest.importorskip("torchvision")
PRE = Preprocess.from_timm(dict(input_size=(3, 32, 32), crop_pct=0.9))
# nvJPEG's IDCT and chroma upsampling are not libjpeg-turbo's: the largest pixel difference the GPU path may show
# against the CPU path, in uint8 levels (the resize kernel itself is exact; an H100 showed 17 on these noisy
# small images, 11 and 15 on photo-like ones of 0.1-2 megapixels), and the smallest cosine similarity of the two
# paths' embeddings.
MAX_LEVELS = 20
MIN_COSINE = 0.9999


def _jpeg(seed: int, height: int, width: int, **save) -> bytes:
    buffer = io.BytesIO()
    image(seed, height, width, save.pop("mode", "RGB")).save(buffer, "JPEG", **save)
    return buffer.getvalue()


def _turned(seed: int) -> bytes:
    photo = image(seed, 30, 40)
    exif = Image.Exif()
    exif[0x0112] = 6
    buffer = io.BytesIO()
    photo.save(buffer, "JPEG", exif=exif)
    return buffer.getvalue()


def _png(seed: int) -> bytes:
    buffer = io.BytesIO()
    image(seed, 35, 28).save(buffer, "PNG")
    return buffer.getvalue()


@pytest.mark.parametrize("data, nvjpeg", [
    (_jpeg(0, 30, 41), True),
    (_jpeg(1, 30, 41, mode="L"), True),
    (_jpeg(2, 30, 41, subsampling=0, quality=95), True),
    (_jpeg(3, 30, 41) + b"\0\0", True),                     # padding after the end marker
    (_jpeg(4, 30, 41, progressive=True), False),
    (_jpeg(5, 30, 41, mode="CMYK"), False),
    (_turned(6), False),
    (_jpeg(7, 30, 41)[:400], False),                        # truncated: no end marker
    (_png(8), False),
    (b"\xff\xd8\xff" + b"\0" * 40 + b"\xff\xd9", False),    # a JPEG's first and last bytes, no header
    (b"", False),
])
def test_the_files_left_to_nvjpeg(data, nvjpeg):
    assert nvjpeg_decodable(data) is nvjpeg


def test_a_mixed_batch_keeps_input_order(tmp_path):
    # JPEGs (left encoded), a PNG and a progressive JPEG (decoded in the worker), a file that is no image, and a
    # "JPEG" whose header and end marker pass but whose decoder (nvJPEG, here its stand-in) fails: decoded on the CPU
    # instead, which names it.
    broken = bytearray(_jpeg(9, 30, 41))
    dht = broken.index(b"\xff\xc4")   # a Huffman table's code counts (its header reader skips the table)
    broken[dht + 5:dht + 21] = b"\xff" * 16
    items = {"a.jpg": _jpeg(10, 45, 37), "b.png": _png(11), "c.jpg": _jpeg(12, 31, 64, mode="L"),
             "d.txt": b"not an image", "e.jpg": _jpeg(13, 29, 29, progressive=True), "f.jpg": bytes(broken),
             "g.jpg": _jpeg(14, 70, 50, subsampling=0)}
    batch = make_batch(0, [(name, *image_item(data, PRE, gpu_decode=True)) for name, data in items.items()], True, PRE)
    assert batch.gpu == [True, False, True, False, False, True, True]
    pixels = batch.device_pixels(PRE, DEVICE)
    cpu = {name: image_item(data, PRE) for name, data in items.items()}
    assert batch.reasons == [reason for _, reason in cpu.values()]
    assert batch.reasons[3].startswith("not an image") and batch.reasons[5].startswith("truncated or corrupt")
    assert batch.gpu == [True, False, True, False, False, False, True]   # f fell back to the CPU, and failed there
    want = torch.stack([p for p, _ in cpu.values() if p is not None])
    assert pixels.device.type == DEVICE.type and pixels.shape == want.shape == (5, 3, 32, 32)
    difference = (pixels.cpu().int() - want.int()).abs().max().item()
    assert difference <= (MAX_LEVELS if DEVICE.type == "cuda" else 0), difference


def test_a_batch_decoded_on_the_cpu_alone_is_copied():
    batch = make_batch(0, [("p.png", *image_item(_png(15), PRE, gpu_decode=True))], True, PRE)
    assert batch.gpu == [False]
    assert torch.equal(batch.device_pixels(PRE, DEVICE).cpu(), image_item(_png(15), PRE)[0][None])


def test_where_decoding_runs():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert decoding(None, cpu, PRE) == decoding("cpu", cpu, PRE) == decoding(None, cuda, PRE) == "cpu"
    with pytest.raises(UsageError, match=r"--decode gpu: nvJPEG decodes on a CUDA device, and this run is on cpu; "
                                         r"use --decode cpu"):
        decoding("gpu", cpu, PRE)
    gray = Preprocess.from_timm(dict(input_size=(1, 32, 32), mean=(0.5,), std=(0.5,)))
    nearest = Preprocess.from_timm(dict(input_size=(3, 32, 32), interpolation="nearest"))
    with pytest.raises(UsageError, match=r"--decode gpu: nvJPEG decodes to RGB, and the model takes 1 channel\(s\)"):
        decoding("gpu", cuda, gray)
    with pytest.raises(UsageError, match=r"--decode gpu: the resize kernel has no 'nearest' filter"):
        decoding("gpu", cuda, nearest)
    if torch.cuda.is_available():   # a small JPEG is decoded there first
        assert decoding("gpu", cuda, PRE) == "gpu"
    else:
        with pytest.raises(UsageError, match=r"--decode gpu: torchvision cannot decode JPEGs on cuda:0: "):
            decoding("gpu", cuda, PRE)


def _photos(folder, count: int) -> None:
    """Photo-like JPEGs of assorted sizes, qualities and chroma subsamplings, a few grayscale ones."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(count):
        height, width = (int(v) for v in rng.integers(40, 400, 2))
        mode = "L" if i % 7 == 3 else "RGB"
        (folder / f"{i:03d}.jpg").write_bytes(_jpeg(i, height, width, mode=mode, quality=int(rng.integers(60, 98)),
                                                    subsampling=[0, 1, 2][i % 3]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="nvJPEG needs a CUDA device")
def test_embeddings_decoded_on_the_gpu_match_the_cpu_path(tmp_path, capsys):
    pq = pytest.importorskip("pyarrow.parquet")
    from vit_triton.data.decode import decode_jpegs

    save_timm(timm_model("vit_base_patch16_224", img_size=64, patch_size=16, embed_dim=96, depth=2, num_heads=3,
                         num_classes=0), tmp_path / "model")
    _photos(tmp_path / "photos", 96)
    paths = sorted((tmp_path / "photos").iterdir())
    cpu = torch.stack([image_item(p.read_bytes(), PRE)[0] for p in paths]).cuda()
    encoded = [torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8) for p in paths]
    difference = (PRE.resize_crop_batch(decode_jpegs(encoded, torch.device("cuda"))).int() - cpu.int()).abs()
    worst = difference.flatten(1).max(1).values
    over = [(p.name, Image.open(p).size, Image.open(p).mode, JpegImagePlugin.get_sampling(Image.open(p)),
             worst[i].item()) for i, p in enumerate(paths) if worst[i] > MAX_LEVELS]
    print(f"GPU path against CPU path: largest {difference.max().item()} levels, mean {difference.float().mean():.4f}")
    assert not over, f"images over {MAX_LEVELS} levels (name, size, mode, subsampling, levels): {over}"
    tables = {}
    for decode in ("cpu", "gpu"):
        assert main(["embed", str(tmp_path / "photos"), "--model", str(tmp_path / "model"), "--output",
                     str(tmp_path / f"{decode}.parquet"), "--decode", decode, "--dtype", "fp32", "--no-progress",
                     "--batch-size", "32", "--num-workers", "2", "--image-size", "64"]) == 0
        tables[decode] = np.stack(pq.read_table(tmp_path / f"{decode}.parquet").column("embedding").to_pylist())
    assert "decoded 96 on the GPU and 0 on the CPU" in capsys.readouterr().out
    a, b = tables["cpu"], tables["gpu"]
    cosine = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    print(f"cosine similarity: least {cosine.min():.6f}")
    assert cosine.min() >= MIN_COSINE
