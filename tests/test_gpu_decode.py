"""Decoding on the GPU: which files the workers leave to the GPU, which decoder decodes them there (nvImageCodec,
else torchvision's nvJPEG), how a batch's pixels are put together from the GPU and the CPU in input order (the GPU
decoder's failures decoded on the CPU, or named), and, on a CUDA device, how close `embed --decode gpu` comes to
`--decode cpu`. Without CUDA, torchvision's CPU JPEG decoder (libjpeg-turbo, as Pillow's: the same pixels) stands
in for the GPU's, so the batch assembly and the resize kernel run as they do there."""

import contextlib
import importlib
import io
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, JpegImagePlugin

from tests.checkpoints import image, save_timm, timm_model
from tests.numerics import DEVICE
from vit_triton.cli import main
from vit_triton.data import Preprocess
from vit_triton.data.decode import NvImageCodecJpeg, TorchvisionJpeg, jpeg_decoder, nvimgcodec_cuda, nvjpeg_block
from vit_triton.data.files import device_batches, image_item, make_batch
from vit_triton.pipelines.embed import _decoding as decoding
from vit_triton.pipelines.store import UsageError

pytest.importorskip("torchvision")
DECODE = importlib.import_module("vit_triton.data.decode")
PRE = Preprocess.from_timm(dict(input_size=(3, 32, 32), crop_pct=0.9))
# The GPU's decoder where there is one (the one embed picks), else its CPU stand-in.
DECODER = jpeg_decoder(DEVICE)[0] if DEVICE.type == "cuda" else TorchvisionJpeg(DEVICE)
# torchvision's nvJPEG: its samples and colour conversion are libjpeg-turbo's, and kernels/chroma.py upsamples its
# chroma as libjpeg-turbo does, but only from blocks with a pixel no channel of which is clamped at 0 or 255: next
# to blocks without one, pixels may differ. The largest difference its path may show against the CPU path, in uint8
# levels (the resize kernel itself is exact; an H100 showed 5 on these noisy small 4:2:0 images and 6 on 4:2:2
# ones, with 99.2% and 95.4% of values equal, and 5 on photo-like ones of 0.1-2 megapixels, 99.96% equal; 16 before
# the chroma was upsampled). nvImageCodec: its own bound (max_difference), once more for the resize's rounding.
# And the smallest cosine similarity of the two paths' embeddings.
MAX_LEVELS = 10
MIN_COSINE = 0.9999


def bound(decoder) -> int:
    """The largest difference, in uint8 levels after the resize, of `decoder`'s path from the CPU's."""
    if decoder.device.type != "cuda":
        return 0
    return decoder.max_difference + 1 if isinstance(decoder, NvImageCodecJpeg) else MAX_LEVELS


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


@pytest.mark.parametrize("data, block", [
    (_jpeg(0, 30, 41), (2, 2)),                             # Pillow's default: 4:2:0
    (_jpeg(1, 30, 41, mode="L"), None),                     # grayscale: nvJPEG's RGB of it is wrong
    (_jpeg(2, 30, 41, subsampling=0, quality=95), (1, 1)),
    (_jpeg(3, 30, 41, subsampling=1), (1, 2)),
    (_jpeg(4, 30, 2), None),                                # 4:2:0 two pixels wide
    (_jpeg(5, 30, 2, subsampling=0), (1, 1)),
    (_jpeg(6, 30, 41) + b"\0\0", (2, 2)),                    # padding after the end marker
    (_jpeg(7, 30, 41, progressive=True), None),
    (_jpeg(8, 30, 41, mode="CMYK"), None),
    (_turned(9), None),
    (_jpeg(10, 30, 41)[:400], None),                        # truncated: no end marker
    (_png(11), None),
    (b"\xff\xd8\xff" + b"\0" * 40 + b"\xff\xd9", None),    # a JPEG's first and last bytes, no header
    (b"", None),
])
def test_the_files_left_to_nvjpeg_and_their_chroma_blocks(data, block):
    assert nvjpeg_block(data) == block


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
    assert batch.gpu == [True, False, False, False, False, True, True]
    [(_, pixels)] = device_batches([batch], PRE, DEVICE, DECODER)
    cpu = {name: image_item(data, PRE) for name, data in items.items()}
    assert batch.reasons == [reason for _, reason in cpu.values()]
    assert batch.reasons[3].startswith("not an image") and batch.reasons[5].startswith("truncated or corrupt")
    assert batch.gpu == [True, False, False, False, False, False, True]   # f fell back to the CPU, and failed there
    want = torch.stack([p for p, _ in cpu.values() if p is not None])
    assert pixels.device.type == DEVICE.type and pixels.shape == want.shape == (5, 3, 32, 32)
    difference = (pixels.cpu().int() - want.int()).abs().max().item()
    assert difference <= bound(DECODER), difference


def test_a_batch_of_jpegs_no_decoder_can_read_is_empty():
    broken = bytearray(_jpeg(16, 30, 41))
    dht = broken.index(b"\xff\xc4")
    broken[dht + 5:dht + 21] = b"\xff" * 16
    batch = make_batch(0, [("f.jpg", *image_item(bytes(broken), PRE, gpu_decode=True))], True, PRE)
    [(_, pixels)] = device_batches([batch], PRE, DEVICE, DECODER)
    assert pixels.shape == (0, 3, 32, 32) and batch.readable == [] and batch.gpu == [False]
    assert batch.reasons[0].startswith("truncated or corrupt")


def test_a_batch_decoded_on_the_cpu_alone_is_copied():
    batch = make_batch(0, [("p.png", *image_item(_png(15), PRE, gpu_decode=True))], True, PRE)
    assert batch.gpu == [False]
    [(_, pixels)] = device_batches([batch], PRE, DEVICE, DECODER)
    assert torch.equal(pixels.cpu(), image_item(_png(15), PRE)[0][None])


def test_batches_decoded_ahead_come_in_order_and_an_error_follows_them():
    def batches():
        for i in range(5):
            yield make_batch(i, [(f"{i}.jpg", *image_item(_jpeg(20 + i, 30 + i, 41, quality=80), PRE, gpu_decode=True)),
                                 (f"{i}.png", *image_item(_png(30 + i), PRE, gpu_decode=True))], True, PRE)
        raise OSError("the disk went away")

    seen = []
    with pytest.raises(OSError, match="the disk went away"):
        for batch, pixels in device_batches(batches(), PRE, DEVICE, DECODER, ahead=2):
            want = torch.stack([image_item(_jpeg(20 + batch.chunk, 30 + batch.chunk, 41, quality=80), PRE)[0],
                                image_item(_png(30 + batch.chunk), PRE)[0]])
            assert (pixels.cpu().int() - want.int()).abs().max() <= bound(DECODER)
            seen.append(batch.chunk)
    assert seen == [0, 1, 2, 3, 4]


def test_a_consumer_that_stops_early_stops_the_decoding_thread():
    made = []

    def batches():
        for i in range(100):
            made.append(i)
            yield make_batch(i, [(f"{i}.jpg", *image_item(_jpeg(i, 20, 20), PRE, gpu_decode=True))], True, PRE)

    stream = device_batches(batches(), PRE, DEVICE, DECODER, ahead=2)
    next(stream)
    stream.close()
    assert not [t for t in threading.enumerate() if t.name.startswith("vit-triton-")]
    assert len(made) <= 7   # the one taken, and for each of the two threads `ahead` waiting and one it holds


# A fresh process on GPU 1 decodes a batch there, then asks the driver whether GPU 0's primary context is open.
_ON_GPU_1 = """
import ctypes, sys, torch
from vit_triton.data import Preprocess
from vit_triton.data.decode import jpeg_decoder
from vit_triton.data.files import device_batches, image_item, make_batch
pre, gpu = Preprocess.from_timm(dict(input_size=(3, 32, 32))), torch.device("cuda", 1)
torch.cuda.set_device(gpu)
data = open(sys.argv[1], "rb").read()
batch = make_batch(0, [("a.jpg", *image_item(data, pre, gpu_decode=True))], True, pre)
[(done, pixels)] = device_batches([batch], pre, gpu, jpeg_decoder(gpu)[0])
assert done.gpu == [True] and pixels.device == gpu, (done.gpu, pixels.device)
driver, device, flags, active = ctypes.CDLL("libcuda.so.1"), ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
assert driver.cuDeviceGet(ctypes.byref(device), 0) == 0
assert driver.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)) == 0
print(active.value)
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_decoding_for_another_gpu_opens_no_context_on_gpu_0(tmp_path):
    # Under torchrun every rank but the first decodes on a GPU other than 0; its decoding threads, which start on
    # GPU 0 as every new thread does, must not open a context there (half a GB a rank, on another rank's GPU).
    (tmp_path / "a.jpg").write_bytes(_jpeg(40, 30, 41))
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, "-c", _ON_GPU_1, str(tmp_path / "a.jpg")], capture_output=True, text=True,
                         cwd=root, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-1] == "0", "the decoding threads opened a context on GPU 0"


def test_where_decoding_runs():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert decoding("cpu", cpu, PRE) == decoding("cpu", cuda, PRE) == (None, [])
    assert decoding(None, cpu, PRE) == (None, ["the GPU's JPEG decoders need a CUDA device, and this run is on cpu"])
    with pytest.raises(UsageError, match=r"--decode gpu: the GPU's JPEG decoders need a CUDA device, and this run is "
                                         r"on cpu; use --decode cpu"):
        decoding("gpu", cpu, PRE)
    gray = Preprocess.from_timm(dict(input_size=(1, 32, 32), mean=(0.5,), std=(0.5,)))
    nearest = Preprocess.from_timm(dict(input_size=(3, 32, 32), interpolation="nearest"))
    with pytest.raises(UsageError, match=r"--decode gpu: the GPU decodes JPEGs to RGB, and the model takes 1 "
                                         r"channel\(s\)"):
        decoding("gpu", cuda, gray)
    assert decoding(None, cuda, gray)[0] is None and decoding(None, cuda, nearest)[0] is None
    with pytest.raises(UsageError, match=r"--decode gpu: the resize kernel has no 'nearest' filter"):
        decoding("gpu", cuda, nearest)
    # By default the GPU wherever a decoder loads there and gives libjpeg-turbo's pixels (a small JPEG is decoded
    # there first): nvImageCodec where it is installed for torch's CUDA, else torchvision's nvJPEG, saying why.
    decoder, why = decoding(None, cuda, PRE)
    if torch.cuda.is_available():
        assert decoder is not None and decoder.device == cuda and decoding("gpu", cuda, PRE)[0] is not None
        assert isinstance(decoder, NvImageCodecJpeg) == (nvimgcodec_cuda() is not None), why
    else:
        assert decoder is None and why[-1].startswith("torchvision's nvJPEG cannot decode JPEGs on cuda:0: ")
        with pytest.raises(UsageError, match=r"--decode gpu: .*torchvision's nvJPEG cannot decode JPEGs on cuda:0: "):
            decoding("gpu", cuda, PRE)


def test_why_nvimgcodec_is_passed_over(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(DECODE, "nvimgcodec_cuda", lambda: None)
    assert jpeg_decoder(cuda)[1][0] == "nvImageCodec is not installed (pip install 'vit-triton[embed]')"
    built = int(torch.version.cuda.split(".")[0]) if torch.version.cuda else 0
    monkeypatch.setattr(DECODE, "nvimgcodec_cuda", lambda: built + 1)
    assert jpeg_decoder(cuda)[1][0] == (f"nvImageCodec is built for CUDA {built + 1} and torch for CUDA {built} "
                                        f"(pip install 'nvidia-nvimgcodec-cu{built}[nvjpeg]')")
    if not torch.cuda.is_available() and nvimgcodec_cuda() is not None:
        monkeypatch.undo()
        assert jpeg_decoder(cuda)[1][0].startswith("nvImageCodec does not load on cuda:0: ")


def _photos(folder, count: int) -> None:
    """Photo-like JPEGs of assorted sizes, qualities and chroma subsamplings, a few grayscale ones."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(count):
        height, width = (int(v) for v in rng.integers(40, 400, 2))
        mode = "L" if i % 7 == 3 else "RGB"
        (folder / f"{i:03d}.jpg").write_bytes(_jpeg(i, height, width, mode=mode, quality=int(rng.integers(60, 98)),
                                                    subsampling=[0, 1, 2][i % 3]))


@pytest.fixture(scope="module")
def both_paths(tmp_path_factory):
    """96 photos embedded with --decode cpu and --decode gpu: (the photos, those nvJPEG took, the embeddings of
    each run, each run's final line)."""
    if not torch.cuda.is_available():
        pytest.skip("nvJPEG needs a CUDA device")
    pq = pytest.importorskip("pyarrow.parquet")
    tmp_path = tmp_path_factory.mktemp("both_paths")
    save_timm(timm_model("vit_base_patch16_224", img_size=64, patch_size=16, embed_dim=96, depth=2, num_heads=3,
                         num_classes=0), tmp_path / "model")
    _photos(tmp_path / "photos", 96)
    photos = sorted((tmp_path / "photos").iterdir())
    tables, lines = {}, {}
    for decode in ("cpu", "gpu"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["embed", str(tmp_path / "photos"), "--model", str(tmp_path / "model"), "--output",
                         str(tmp_path / f"{decode}.parquet"), "--decode", decode, "--dtype", "fp32", "--no-progress",
                         "--batch-size", "32", "--num-workers", "2", "--image-size", "64"]) == 0
        lines[decode] = out.getvalue()
        tables[decode] = np.stack(pq.read_table(tmp_path / f"{decode}.parquet").column("embedding").to_pylist())
    return photos, [p for p in photos if nvjpeg_block(p.read_bytes())], tables, lines


def _sampling(path) -> str:
    with Image.open(path) as image:
        return {0: "4:4:4", 1: "4:2:2", 2: "4:2:0"}.get(JpegImagePlugin.get_sampling(image), image.mode)


def test_gpu_pixels_stay_within_the_bound_and_every_decoder_is_counted(both_paths):
    photos, paths, _, lines = both_paths
    assert [p for p in photos if p not in paths] == [p for p in photos if Image.open(p).mode == "L"]
    cpu = torch.stack([image_item(p.read_bytes(), PRE)[0] for p in paths]).cuda()
    encoded = [torch.frombuffer(bytearray(p.read_bytes()), dtype=torch.uint8) for p in paths]
    blocks = [nvjpeg_block(p.read_bytes()) for p in paths]
    difference = (PRE.resize_crop_batch(DECODER.pixels(encoded, blocks)).int() - cpu.int()).abs()
    worst = difference.flatten(1).max(1).values
    for kind in sorted({_sampling(p) for p in paths}):
        rows = [i for i, p in enumerate(paths) if _sampling(p) == kind]
        print(f"{kind}: largest {worst[rows].max().item()} levels, mean {difference[rows].float().mean():.4f}, "
              f"equal {(difference[rows] == 0).float().mean():.4f}")
    over = [(p.name, Image.open(p).size, _sampling(p), worst[i].item()) for i, p in enumerate(paths)
            if worst[i] > bound(DECODER)]
    assert not over, f"images over {bound(DECODER)} levels (name, size, subsampling, levels): {over}"
    assert f"decoded {len(paths)} on the GPU and {len(photos) - len(paths)} on the CPU" in lines["gpu"]
    assert f"decoded 0 on the GPU and {len(photos)} on the CPU" in lines["cpu"]


def test_embeddings_decoded_on_the_gpu_match_the_cpu_path(both_paths):
    photos, _, tables, _ = both_paths
    a, b = tables["cpu"], tables["gpu"]
    cosine = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    for kind in sorted({_sampling(p) for p in photos}):
        print(f"{kind}: least cosine similarity {min(c for c, p in zip(cosine, photos) if _sampling(p) == kind):.6f}")
    assert cosine.min() >= MIN_COSINE
