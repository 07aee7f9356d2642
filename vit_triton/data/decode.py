"""Reading an image file into a PIL image, or a reason why it cannot be read; and, for embed --decode gpu,
which JPEGs the GPU may decode instead, the decoders that do it in batches on a CUDA device (nvImageCodec, else
torchvision's nvJPEG), and the CUDA setting they need.

Decoding is the only place where a file's content can fail us, so it is the only place where errors
are caught and turned into a reason (UnreadableImage): a run over a million files skips the bad ones
and lists them, while a bug in the code after decoding still stops the run. The EXIF orientation is
applied (as transformers' load_image does), so that a phone's photo is seen upright.
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import sys
import tempfile

import numpy as np
import torch
from PIL import Image, ImageOps, JpegImagePlugin, UnidentifiedImageError


class UnreadableImage(Exception):
    """A file that is not a decodable image; str() is the reason, written to the skipped-files list."""


def read_file(path: str | os.PathLike) -> bytes:
    """The bytes of the file at `path`. Raises UnreadableImage for a missing, unreadable or empty file."""
    try:
        with open(path, "rb") as file:
            data = file.read()
    except OSError as e:
        raise UnreadableImage(f"cannot read file: {e.strerror or e}") from None
    if not data:
        raise UnreadableImage("empty file")
    return data


def decode_image(data: bytes, mode: str = "RGB") -> Image.Image:
    """The fully decoded image in the encoded `data`, in PIL `mode` ("RGB", or "L" for one-channel models).

    Raises UnreadableImage for empty, non-image, truncated or corrupt data. Turned upright by its EXIF
    orientation tag, if any. Transparency is dropped (Pillow's convert), as timm's and torchvision's
    loaders do; only the first frame of an animation is used.
    """
    if not data:
        raise UnreadableImage("empty file")
    try:
        with Image.open(io.BytesIO(data)) as image:
            ImageOps.exif_transpose(image, in_place=True)  # decodes the whole image: truncation shows here
            return image.convert(mode)
    except UnidentifiedImageError:
        raise UnreadableImage("not an image (unrecognised format)") from None
    except Exception as e:  # noqa: BLE001 -- Pillow raises OSError, SyntaxError, ValueError, ... on bad data
        raise UnreadableImage(f"truncated or corrupt image: {e}") from None


def load_image(path: str | os.PathLike, mode: str = "RGB") -> Image.Image:
    """decode_image of the file at `path`; UnreadableImage also for a missing or unreadable file."""
    return decode_image(read_file(path), mode)


def upright(image: Image.Image, mode: str = "RGB") -> Image.Image:
    """A PIL image as decode_image makes a file's: turned upright by its EXIF orientation tag, if any, in PIL `mode`
    (Pillow's convert: RGBA, CMYK, grayscale or palette images become RGB). `image` itself where nothing changes."""
    if image.getexif().get(_EXIF_ORIENTATION, 1) != 1:
        image = ImageOps.exif_transpose(image)
    return image if image.mode == mode else image.convert(mode)


_EXIF_ORIENTATION = 0x0112
WIDE_QUEUES = 32   # CUDA_DEVICE_MAX_CONNECTIONS for GPU decoding: CUDA's most (widen_hardware_queues)


_BLOCKS = {0: (1, 1), 1: (1, 2), 2: (2, 2)}   # Pillow's subsampling codes: 4:4:4, 4:2:2, 4:2:0


def nvjpeg_block(data: bytes) -> tuple[int, int] | None:
    """Where nvJPEG should decode `data`, its chroma block (rows, columns: 1 x 1 for 4:4:4, 1 x 2 for 4:2:2, 2 x 2
    for 4:2:0), else None: a baseline colour (YCbCr) JPEG with one of those subsamplings and no EXIF turn, whole
    (it ends in the end-of-image marker), read from its header alone. Everything else (PNG, WebP, progressive,
    CMYK or grayscale JPEGs, whose RGB from nvJPEG was up to 237 levels off on an H100, other subsamplings, a
    subsampled image 1 or 2 pixels wide, a turned photo, a broken header, a truncated file, which nvJPEG would
    decode into grey without a word) is decode_image's, which also names what is wrong with a bad file."""
    if data[:3] != b"\xff\xd8\xff" or data.rstrip(b"\0")[-2:] != b"\xff\xd9":
        return None
    try:
        with Image.open(io.BytesIO(data)) as image:
            block = _BLOCKS.get(JpegImagePlugin.get_sampling(image)) if image.format == "JPEG" else None
            if (block is None or image.mode != "RGB" or "progression" in image.info
                    or image.getexif().get(_EXIF_ORIENTATION, 1) != 1 or (block != (1, 1) and image.width < 3)):
                return None
            return block
    except Exception:  # noqa: BLE001 -- any header Pillow cannot read is decode_image's to report
        return None


def widen_hardware_queues() -> bool:
    """Sets CUDA_DEVICE_MAX_CONNECTIONS to WIDE_QUEUES unless it is set or CUDA has started (it is read then);
    returns whether it is at least that. nvJPEG decodes on 14 streams of its own and waits for each image's colour
    conversion kernel before the next image. CUDA maps streams onto that many hardware queues (8 by default), so
    some of nvJPEG's share the forward's queue, and an image there waits out the whole forward queued before it: on
    an H100, nvJPEG beside a running ViT-B/16 decoded 1,400 images/s with 8 queues, and with 32 as many as alone
    (7,400)."""
    if "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ and not torch.cuda.is_initialized():
        os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] = str(WIDE_QUEUES)
    try:
        return int(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8")) >= WIDE_QUEUES
    except ValueError:
        return False


class JpegDecoder:
    """Decodes on a CUDA device the JPEGs nvjpeg_block admits into libjpeg-turbo's pixels (within `max_difference`
    levels), in two steps, which embed runs on two threads: decode(), which holds its thread until the batch is
    decoded, and finish(), the kernels after it. `name` says which decoder in the log."""

    name = ""
    max_difference = 0

    def __init__(self, device: torch.device) -> None:
        if device.type == "cuda" and device.index is None:   # the decoding threads take it as their current one
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device

    def decode(self, encoded: list[torch.Tensor]) -> list[torch.Tensor | str]:
        """JPEGs (uint8 [n] CPU tensors of their bytes): uint8 RGB [3, H, W] each on the device, ready for the
        current stream, or why not, for one the decoder failed on."""
        raise NotImplementedError

    def finish(self, decoded: list[torch.Tensor | str], blocks: list[tuple[int, int]]) -> list[torch.Tensor | str]:
        """decode()'s images (their chroma blocks from nvjpeg_block) as libjpeg-turbo's, on the current stream."""
        return decoded

    def pixels(self, encoded: list[torch.Tensor], blocks: list[tuple[int, int]]) -> list[torch.Tensor | str]:
        """finish() of decode(), in one call."""
        return self.finish(self.decode(encoded), blocks)


class TorchvisionJpeg(JpegDecoder):
    """torchvision's nvJPEG (nvjpeg_decode), each chroma sample repeated over its block, then upsample_chroma."""

    name = "torchvision's nvJPEG"

    def decode(self, encoded: list[torch.Tensor]) -> list[torch.Tensor | str]:
        return nvjpeg_decode(encoded, self.device)

    def finish(self, decoded: list[torch.Tensor | str], blocks: list[tuple[int, int]]) -> list[torch.Tensor | str]:
        return upsample_chroma(decoded, blocks)


class NvImageCodecJpeg(JpegDecoder):
    """NVIDIA's nvImageCodec: the GPU's hardware JPEG engines where it has them, its CUDA decoder for what they
    cannot take, chroma upsampled as libjpeg-turbo does (fancy upsampling), planar RGB out; its inverse DCT
    may round a level otherwise than libjpeg-turbo's. The images are nvImageCodec's allocations, handed over as
    tensors through DLPack on the current stream."""

    name = "nvImageCodec"
    max_difference = 1

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        from nvidia import nvimgcodec

        self._codestream = nvimgcodec.CodeStream
        backends = [nvimgcodec.Backend(kind) for kind in (nvimgcodec.BackendKind.HW_GPU_ONLY,
                                                          nvimgcodec.BackendKind.GPU_ONLY)]
        self._decoder = nvimgcodec.Decoder(device_id=self.device.index, backends=backends,
                                           options=":fancy_upsampling=1")
        self._params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB,
                                               allow_any_depth=False, sample_format=nvimgcodec.SampleFormat.P_RGB)

    def decode(self, encoded: list[torch.Tensor]) -> list[torch.Tensor | str]:
        stream = torch.cuda.current_stream(self.device)
        sources = [self._codestream(data.numpy()) for data in encoded]
        images = self._decoder.decode(sources, params=self._params, cuda_stream=stream.cuda_stream)
        return ["nvImageCodec could not decode it" if image is None else torch.from_dlpack(image)
                for image in images]


def nvimgcodec_cuda() -> int | None:
    """The CUDA major version of the installed nvImageCodec wheel (nvidia-nvimgcodec-cu12 or -cu13), None
    without one."""
    from importlib import metadata

    for major in (13, 12):
        try:
            metadata.version(f"nvidia-nvimgcodec-cu{major}")
        except metadata.PackageNotFoundError:
            continue
        return major
    return None


def jpeg_decoder(device: torch.device) -> tuple[JpegDecoder | None, list[str]]:
    """The JPEG decoder for `device` and why each one before it was passed over: nvImageCodec (embed's extra
    installs it for CUDA 13; torch built for CUDA 12 takes nvidia-nvimgcodec-cu12[nvjpeg]), else torchvision's
    nvJPEG; None where neither loads or gives libjpeg-turbo's pixels to within its max_difference on a probe
    (a small 4:2:0 JPEG)."""
    if device.type != "cuda":
        return None, [f"the GPU's JPEG decoders need a CUDA device, and this run is on {device}"]
    why = []
    for make in (_nvimgcodec, _torchvision):
        decoder, reason = make(device)
        reason = reason or _probe(decoder)
        if reason is None:
            return decoder, why
        why.append(reason)
    return None, why


def _nvimgcodec(device: torch.device) -> tuple[JpegDecoder | None, str | None]:
    cuda, built = nvimgcodec_cuda(), int((torch.version.cuda or "0").split(".")[0])
    if cuda is None:
        return None, "nvImageCodec is not installed (pip install 'vit-triton[embed]')"
    if cuda != built:
        return None, (f"nvImageCodec is built for CUDA {cuda} and torch for CUDA {built} "
                      f"(pip install 'nvidia-nvimgcodec-cu{built}[nvjpeg]')")
    # Its import prints a line for each codec library it lacks (JPEG 2000, TIFF: not embed's), which is kept to
    # name in the reason if it fails.
    with _output_captured() as printed:
        try:
            return NvImageCodecJpeg(device), None
        except Exception as e:  # noqa: BLE001 -- its import or decoder fails with RuntimeError, ImportError, OSError
            error, said = e, [line.strip() for line in printed().splitlines() if "nvjpeg " in line.lower()]
    return None, f"nvImageCodec does not load on {device}: {error}" + "".join(f" ({line})" for line in said)


@contextlib.contextmanager
def _output_captured():
    """Within it, this process's stdout and stderr (file descriptors 1 and 2, where C libraries print) go to a
    temporary file, whose text the yielded function returns."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with tempfile.TemporaryFile() as file:
        os.dup2(file.fileno(), 1)
        os.dup2(file.fileno(), 2)
        try:
            yield lambda: (file.seek(0), file.read().decode(errors="replace"))[1]
        finally:
            for fd, copy in zip((1, 2), saved):
                os.dup2(copy, fd)
                os.close(copy)


def _torchvision(device: torch.device) -> tuple[JpegDecoder | None, str | None]:
    try:
        import torchvision.io  # noqa: F401 -- only whether it is there
    except ImportError:
        return None, "torchvision is not installed (pip install 'vit-triton[embed]')"
    return TorchvisionJpeg(device), None


def _probe(decoder: JpegDecoder) -> str | None:
    """None where `decoder` gives a small 4:2:0 JPEG's libjpeg-turbo pixels to within its max_difference."""
    y, x = np.mgrid[0:37, 0:46]
    probe = io.BytesIO()
    Image.fromarray(np.stack([128 + 40 * np.sin(x / 5 + c) * np.cos(y / 7) for c in range(3)], -1).astype(np.uint8)
                    ).save(probe, "JPEG", quality=90, subsampling=2)
    try:
        [image] = decoder.pixels([torch.frombuffer(bytearray(probe.getvalue()), dtype=torch.uint8)], [(2, 2)])
    except RuntimeError as e:  # a torchvision built without nvJPEG, a device it cannot use
        return f"{decoder.name} cannot decode JPEGs on {decoder.device}: {e}"
    want = torch.from_numpy(np.array(decode_image(probe.getvalue()))).permute(2, 0, 1)
    if not isinstance(image, torch.Tensor) or image.shape != want.shape:
        got = image if isinstance(image, str) else tuple(image.shape)
        return f"{decoder.name} did not decode a probe JPEG on {decoder.device}: {got}"
    difference = (image.cpu().int() - want.int()).abs().max().item()
    if difference > decoder.max_difference:
        return (f"{decoder.name}'s pixels on {decoder.device} are up to {difference} levels from libjpeg-turbo's "
                f"(at most {decoder.max_difference} expected)")
    return None


def nvjpeg_decode(encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | str]:
    """JPEGs (uint8 [n] CPU tensors of their bytes) decoded by nvJPEG on `device`: uint8 RGB [3, H, W] each, each
    chroma sample repeated over its block (upsample_chroma makes them libjpeg-turbo's), ready for the current
    stream; or why not, for one nvJPEG failed on (the batch is decoded one by one when it fails as a whole). On the
    CPU, torchvision's libjpeg-turbo decodes them instead. The caller's thread waits until the batch is decoded."""
    if device.type != "cuda":
        return _decode_jpegs(encoded, device)
    # torchvision's nvJPEG decoder allocates its outputs on the current stream but writes them on a stream of its
    # own that waits for nothing there: memory freed on the current stream with reads still queued would be
    # overwritten. So they are allocated on a stream where nothing runs, and the current stream reads them.
    current = torch.cuda.current_stream(device)
    with torch.cuda.stream(_output_stream(device)):
        decoded = _decode_jpegs(encoded, device)
        current.wait_stream(torch.cuda.current_stream(device))   # which torchvision made wait for its decoding
    for image in decoded:
        if isinstance(image, torch.Tensor):
            image.record_stream(current)
    return decoded


def upsample_chroma(decoded: list[torch.Tensor | str], blocks: list[tuple[int, int]]) -> list[torch.Tensor | str]:
    """nvjpeg_decode's images with the chroma of the 4:2:0 and 4:2:2 ones (their blocks from nvjpeg_block)
    upsampled as libjpeg-turbo does (kernels/chroma.py, on the current stream; one copy into a buffer of them all);
    one whose chroma samples were not repeated over their blocks becomes the reason. Images on the CPU are
    libjpeg-turbo's already. Waits for the kernels' counts."""
    from ..kernels.chroma import fancy_upsample   # defining a kernel reads TRITON_INTERPRET: on first use

    subsampled = [i for i, (image, block) in enumerate(zip(decoded, blocks))
                  if isinstance(image, torch.Tensor) and image.is_cuda and block != (1, 1)]
    if not subsampled:
        return decoded
    rows, offset = [], 0
    for i in subsampled:
        _, height, width = decoded[i].shape
        rows.append([offset, height, width, *blocks[i]])
        offset += 3 * height * width
    pixels = torch.cat([decoded[i].view(-1) for i in subsampled])
    counts = fancy_upsample(pixels, torch.tensor(rows, dtype=torch.int64)).tolist()
    out = list(decoded)
    for i, (offset, height, width, *_), (_, inconsistent) in zip(subsampled, rows, counts):
        out[i] = (pixels[offset:offset + 3 * height * width].view(3, height, width) if not inconsistent else
                  f"nvJPEG's chroma was not one sample repeated over each block ({inconsistent} blocks)")
    return out


@functools.lru_cache(maxsize=None)
def _output_stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)


def _decode_jpegs(encoded: list[torch.Tensor], device: torch.device) -> list[torch.Tensor | str]:
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        return [image.contiguous() for image in decode_jpeg(encoded, mode=ImageReadMode.RGB, device=device)]
    except RuntimeError:
        pass
    decoded = []
    for data in encoded:
        try:
            decoded.append(decode_jpeg(data, mode=ImageReadMode.RGB, device=device).contiguous())
        except RuntimeError as e:
            decoded.append(str(e))
    return decoded
