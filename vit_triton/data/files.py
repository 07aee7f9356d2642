"""Images as a stream of pixel batches: Datasets of image files and of tar shards that decode and resize
them (in DataLoader workers) through one shared step, turning unreadable images into reasons instead of errors."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import os
import queue
import signal
import sys
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from .decode import JpegDecoder, UnreadableImage, decode_image, nvjpeg_block
from .preprocess import Preprocess
from .sources import read_bytes, tar_images

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


@dataclass
class Batch:
    """One batch of images: each one's name (a path, or SHARD#MEMBER) and None or the reason it cannot be read,
    in order; uint8 pixels [n, C, H, W] of the readable ones decoded on the CPU, in order; and, with GPU decoding,
    the bytes of the JPEGs left to the GPU (`jpeg` holds them end to end, `jpeg_ends` where each one ends,
    `jpeg_blocks` their chroma blocks; `gpu` says which items they are). For embed, all of them are of one chunk
    (its unit of work, which batches never span), and `last` says the batch ends it."""

    chunk: int
    names: list[str]
    reasons: list[str | None]
    pixels: torch.Tensor
    last: bool
    gpu: list[bool] = field(default_factory=list)
    jpeg: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.uint8))
    jpeg_ends: list[int] = field(default_factory=list)
    jpeg_blocks: list[tuple[int, int]] = field(default_factory=list)

    @property
    def readable(self) -> list[str]:
        return [name for name, reason in zip(self.names, self.reasons) if reason is None]

    @property
    def skipped(self) -> list[tuple[str, str]]:
        return [(name, reason) for name, reason in zip(self.names, self.reasons) if reason is not None]

    def pin_memory(self) -> Batch:  # called by DataLoader(pin_memory=True) in its pinning thread
        self.pixels = self.pixels.pin_memory()  # not the JPEG bytes: the decoder stages them through its own buffers
        return self

    @property
    def jpeg_spans(self) -> list[tuple[int, int]]:
        """Where each JPEG left to the GPU lies in `jpeg`: (start, end)."""
        return list(zip([0] + self.jpeg_ends[:-1], self.jpeg_ends))

    def decode_jpegs(self, decoder: JpegDecoder) -> list[torch.Tensor | str]:
        """decoder.decode of the JPEGs left to the GPU, in order: for each, its uint8 RGB [3, H, W] on the
        decoder's device (before decoder.finish), or the error the decoder gave."""
        if not self.jpeg_ends:
            return []
        return decoder.decode([self.jpeg[a:b] for a, b in self.jpeg_spans])

    def device_pixels(self, preprocess: Preprocess, decoder: JpegDecoder, decoded: list[torch.Tensor | str],
                      consumer: torch.cuda.Stream | None = None) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """uint8 pixels [n, C, H, W] on the decoder's device of the readable images, in order: those decoded on the
        CPU copied there, the JPEGs the decoder decoded (`decoded`, from decode_jpegs()) finished by it, resized
        and cropped by preprocess.resize_crop_batch. A JPEG the decoder failed on is decoded on the CPU instead, or,
        if it is no image there either, becomes unreadable (its reason set here). On a CUDA device the work runs on
        a stream of its own (_decode_stream): the pixels may be read on `consumer` (default: the current stream)
        once it waits for the event returned with them; elsewhere the event is None."""
        device = decoder.device
        if device.type != "cuda":
            return self._device_pixels(preprocess, decoder, decoded), None
        stream = _decode_stream(device)
        with torch.cuda.stream(stream):
            pixels = self._device_pixels(preprocess, decoder, decoded)
        pixels.record_stream(consumer or torch.cuda.current_stream(device))
        return pixels, stream.record_event()

    def _device_pixels(self, preprocess: Preprocess, decoder: JpegDecoder,
                       decoded: list[torch.Tensor | str]) -> torch.Tensor:
        device = decoder.device
        cpu = self.pixels.to(device, non_blocking=True)
        if not any(self.gpu):
            return cpu
        decoded, spans = iter(decoder.finish(decoded, self.jpeg_blocks)), iter(self.jpeg_spans)
        cpu_rows, gpu_rows, gpu_images, late_rows, late = [], [], [], [], []
        for i, on_gpu in enumerate(self.gpu):
            if self.reasons[i] is not None:
                continue
            row = len(cpu_rows) + len(gpu_rows) + len(late_rows)
            if not on_gpu:
                cpu_rows.append(row)
                continue
            image, (a, b) = next(decoded), next(spans)
            if isinstance(image, torch.Tensor):
                gpu_rows.append(row)
                gpu_images.append(image)
                continue
            self.gpu[i] = False  # the GPU's decoder could not: the CPU decodes it, or says why it is no image
            pixels, self.reasons[i] = image_item(self.jpeg[a:b].numpy().tobytes(), preprocess)
            if pixels is not None:
                late_rows.append(row)
                late.append(pixels)
        if gpu_rows and not cpu_rows and not late_rows:   # all the GPU's, in order
            return preprocess.resize_crop_batch(gpu_images)
        out = torch.empty((len(cpu_rows) + len(gpu_rows) + len(late_rows), preprocess.channels, *preprocess.size),
                          dtype=torch.uint8, device=device)
        if cpu_rows:
            out[torch.tensor(cpu_rows, device=device)] = cpu
        if gpu_rows:
            out[torch.tensor(gpu_rows, device=device)] = preprocess.resize_crop_batch(gpu_images)
        if late_rows:
            out[torch.tensor(late_rows, device=device)] = torch.stack(late).to(device)
        return out


@functools.lru_cache(maxsize=None)
def _decode_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream a device's decoding and resizing run on, beside the forwards on the current stream."""
    return torch.cuda.Stream(device)


def device_batches(batches: Iterable[Batch], preprocess: Preprocess, device: torch.device,
                   decoder: JpegDecoder | None = None, ahead: int = 2) -> Iterator[tuple[Batch, torch.Tensor]]:
    """Each batch with its uint8 pixels [n, C, H, W] on `device`, in order, ready for the stream current where
    this generator runs. Without a decoder the pixels decoded on the CPU are copied. With one (on `device`), two
    threads work up to `ahead` batches before they are asked for: one keeps it decoding (decode() holds its caller
    until a batch is decoded) and does nothing else, the other finishes what it decoded and resizes it
    (Batch.device_pixels), while the caller launches and collects forwards. An error in either thread is raised
    here."""
    batches = iter(batches)  # here: a DataLoader's iterator is made on the thread that owns its signal handlers
    if decoder is None:
        for batch in batches:
            yield batch, batch.pixels.to(device, non_blocking=True)
        return
    device = decoder.device
    cuda = device.type == "cuda"
    consumer = torch.cuda.current_stream(device) if cuda else None

    def decode(batch: Batch) -> tuple[Batch, list[torch.Tensor | str]]:
        with torch.cuda.stream(_decode_stream(device)) if cuda else contextlib.nullcontext():
            return batch, batch.decode_jpegs(decoder)   # ready for the stream the resizing runs on

    decoded = _in_thread(decode, batches, ahead, "vit-triton-decode", device)
    resized = _in_thread(lambda d: (d[0], *d[0].device_pixels(preprocess, decoder, d[1], consumer)), decoded, ahead,
                         "vit-triton-resize", device)
    try:
        for batch, pixels, ready in resized:
            if ready is not None:
                torch.cuda.current_stream(device).wait_event(ready)
            yield batch, pixels
    finally:
        resized.close()   # now, not whenever it is collected: its thread closes `decoded`, and each stops its thread


def _in_thread(fn, items: Iterator, ahead: int, name: str, device: torch.device) -> Iterator:
    """fn(item) of each item, in order, computed on a thread of its own at most `ahead` items before they are
    asked for (under torch.inference_mode, a CUDA `device`, with its index, the thread's current one); the thread's
    error is raised here. Closing this generator stops the thread, which closes `items` if it is a generator."""
    done: queue.Queue = queue.Queue(maxsize=ahead)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                done.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def work() -> None:
        try:
            if device.type == "cuda":   # a new thread starts on GPU 0, another rank's: no context opened there
                torch.cuda.set_device(device)
            with torch.inference_mode():
                for item in items:
                    if not put((fn(item),)):
                        return
        except BaseException as e:  # noqa: BLE001 -- handed to the caller, who raises it
            put(e)
        else:
            put(None)
        finally:
            if hasattr(items, "close"):
                items.close()

    thread = threading.Thread(target=work, name=name, daemon=True)
    thread.start()
    try:
        while (item := done.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            yield item[0]
    finally:
        stop.set()
        thread.join()


class Jpeg(NamedTuple):
    """A JPEG left to the GPU: its bytes and its chroma block (nvjpeg_block)."""

    data: bytes
    block: tuple[int, int]


def image_item(data: bytes, preprocess: Preprocess,
               gpu_decode: bool = False) -> tuple[torch.Tensor | Jpeg | None, str | None]:
    """The one step from an image's bytes to what a batch holds, for files and shards alike: (uint8 pixels
    [C, H, W] resized and cropped by `preprocess`, None), or (None, the reason the bytes are no image); with
    gpu_decode, a JPEG the GPU's decoders take is left encoded: (Jpeg, None)."""
    if gpu_decode and (block := nvjpeg_block(data)) is not None:
        return Jpeg(data, block), None
    try:
        image = decode_image(data, preprocess.mode)
    except UnreadableImage as e:
        return None, str(e)
    return preprocess.resize_crop(image), None


def make_batch(chunk: int, items: list[tuple[str, torch.Tensor | Jpeg | None, str | None]], last: bool,
               preprocess: Preprocess) -> Batch:
    """The Batch of (name, pixels or Jpeg or None, reason or None) items, from image_item."""
    pixels = [p for _, p, _ in items if isinstance(p, torch.Tensor)]
    jpegs = [p for _, p, _ in items if isinstance(p, Jpeg)]
    c, (h, w) = preprocess.channels, preprocess.size
    stacked = torch.stack(pixels) if pixels else torch.empty(0, c, h, w, dtype=torch.uint8)
    return Batch(chunk, [name for name, _, _ in items], [reason for _, _, reason in items], stacked, last,
                 gpu=[isinstance(p, Jpeg) for _, p, _ in items],
                 jpeg=torch.frombuffer(bytearray(b"".join(j.data for j in jpegs)), dtype=torch.uint8) if jpegs
                 else torch.empty(0, dtype=torch.uint8),
                 jpeg_ends=list(itertools.accumulate(len(j.data) for j in jpegs)),
                 jpeg_blocks=[j.block for j in jpegs])


class ImageFiles(Dataset):
    """Item i: (i, uint8 pixels [C, H, W] resized and cropped by `preprocess`, or None, reason or None) of path i,
    a local path or a URL. Paths k*chunk_size onwards are chunk k, as embed cuts them (a batch must not span two),
    the chunk collate gives its batch; without chunk_size, the paths are one chunk."""

    def __init__(self, paths: list[str], preprocess: Preprocess, chunk_size: int | None = None,
                 gpu_decode: bool = False) -> None:
        self.paths = paths
        self.preprocess = preprocess
        self.gpu_decode = gpu_decode
        self.chunk_size = chunk_size or max(len(paths), 1)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[int, torch.Tensor | None, str | None]:
        try:
            data = read_bytes(self.paths[index])
        except UnreadableImage as e:
            return index, None, str(e)
        return (index, *image_item(data, self.preprocess, self.gpu_decode))

    def collate(self, items: list[tuple[int, torch.Tensor | None, str | None]]) -> Batch:
        chunk = items[0][0] // self.chunk_size
        end = min((chunk + 1) * self.chunk_size, len(self.paths))
        return make_batch(chunk, [(self.paths[i], p, reason) for i, p, reason in items], items[-1][0] + 1 == end,
                          self.preprocess)


class TarShards(IterableDataset):
    """Batches of at most batch_size images of tar shards, one chunk each: `shards` is [(chunk, path or URL)].
    A DataLoader worker reads whole shards (worker w of n every n-th); a batch never spans two, and the last of
    a shard is marked, since how many images a shard holds is known only once it is read. An image member is
    named SHARD#MEMBER; a damaged shard keeps the images before the damage, which is reported under its name."""

    def __init__(self, shards: list[tuple[int, str]], preprocess: Preprocess, batch_size: int,
                 gpu_decode: bool = False) -> None:
        self.shards, self.preprocess, self.batch_size = shards, preprocess, batch_size
        self.gpu_decode = gpu_decode

    def __iter__(self) -> Iterator[Batch]:
        worker = get_worker_info()
        for chunk, shard in self.shards[worker.id::worker.num_workers] if worker else self.shards:
            items = []
            try:
                for member, data in tar_images(shard):
                    items.append((f"{shard}#{member}", *image_item(data, self.preprocess, self.gpu_decode)))
                    if len(items) == self.batch_size:
                        yield make_batch(chunk, items, False, self.preprocess)
                        items = []
            except UnreadableImage as e:
                items.append((shard, None, str(e)))
            yield make_batch(chunk, items, True, self.preprocess)


def worker_init(main_pid: int, _: int) -> None:
    """worker_init_fn, with the DataLoader's process bound as main_pid (functools.partial): one thread per
    worker, the parallelism being across workers; on Linux the worker dies with its parent, which it would
    otherwise outlive after a kill -9 (blocked on a slow file, say)."""
    torch.set_num_threads(1)
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        try:
            os.kill(main_pid, 0)  # still there? If it died before prctl, no signal will come
        except ProcessLookupError:
            os._exit(1)
