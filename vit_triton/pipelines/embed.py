"""`vit-triton embed`: one embedding per image for a folder, list or glob of any size, or for tar shards
(webdataset's layout), local or at URLs.

Per process: DataLoader workers read, decode, resize and crop (uint8) while the GPU runs the previous
batches; pinned batches are copied without blocking, normalized on the device (on a GPU, a full
batch's normalizing, forward and pooling replay one CUDA graph), and each batch's results come back
through pinned memory one batch later, so that copying and writing overlap the next forward. With --decode
gpu the workers only read JPEGs, and two threads of this process decode them (nvImageCodec, or torchvision's
nvJPEG) and resize them ahead of the forwards (data/files.py, device_batches). Batches never straddle a chunk
(store.py: chunk_size files, or one tar shard, which one worker reads whole), so a batch holds the same images
however the work is split, and a resumed or a torchrun run writes what one uninterrupted process would.

Under torchrun (WORLD_SIZE > 1) rank 0 locks the output for the whole run, lists the inputs and
chooses the chunks still to do; rank r takes every world-th of them; rank 0 merges them into the output as
they are done, in order, on a thread (store.py), and the last ones when all are.
The process group (gloo) carries only these small messages, never tensors.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Sampler

from ..data import Preprocess, UnreadableImage, load_image
from ..data.decode import WIDE_QUEUES, JpegDecoder, jpeg_decoder, widen_hardware_queues
from ..data.files import Batch, ImageFiles, TarShards, device_batches, worker_init
from ..data.sources import is_shard, list_inputs
from ..loaders import from_pretrained
from ..runtime import CUDAGraphRunner
from ..utils import MissingExtra
from .store import ChunkStore, Summary, UsageError, check_image_size

OUTPUT_DTYPES = {"float32": torch.float32, "float16": torch.float16}
# Why an image that decoded has no row: what the model made of it is not a number.
NON_FINITE = ("NaN or infinite output (the checkpoint's weights or preprocessing make one, or a value overflows the "
              "dtype)")
GPU_BATCH_SIZE = 256   # the default --batch-size on a GPU (4 in the interpreter)
CHUNK_SIZE = 4096      # the default --chunk-size (512 with --tokens)


@dataclass(frozen=True)
class EmbedOptions:
    model: str
    input: str
    output: str
    batch_size: int | None = None        # default: GPU_BATCH_SIZE on a GPU, 4 in the interpreter
    num_workers: int | None = None       # default: this process's share of the CPUs, less one
    chunk_size: int | None = None        # default: CHUNK_SIZE images, 512 with tokens
    normalize: bool = False
    tokens: bool = False
    dtype: torch.dtype | None = None     # default: bfloat16 on a GPU, float32 in the interpreter
    output_dtype: str = "float32"
    device: str | None = None
    image_size: tuple[int, int] | None = None   # default: the checkpoint's
    overwrite: bool = False
    progress: bool | None = None         # default: when stderr is a terminal
    decode: str | None = None            # "gpu" or "cpu"; default: gpu where it can run


class ChunkBatches(Sampler[list[int]]):
    """Batches of input indices, chunk after chunk, none spanning two chunks."""

    def __init__(self, ranges: list[range], batch_size: int) -> None:
        self.ranges, self.batch_size = ranges, batch_size

    def __iter__(self):
        for r in self.ranges:
            for start in range(r.start, r.stop, self.batch_size):
                yield list(range(start, min(start + self.batch_size, r.stop)))

    def __len__(self) -> int:
        return sum(-(-len(r) // self.batch_size) for r in self.ranges)


@dataclass
class _Chunk:
    """A chunk in flight: its rows not yet written, and what it has written."""

    names: list[str] = field(default_factory=list)
    arrays: list[list[np.ndarray]] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    parts: int = 0
    rows: int = 0


class ChunkWriter:
    """Collects the rows of the chunks in flight: writes a chunk's rows in parts, each once it holds part_rows
    rows or the chunk ends (so that a shard of any size holds little memory), then its done marker."""

    def __init__(self, store: ChunkStore, part_rows: int) -> None:
        self.store, self.part_rows = store, part_rows
        self.chunks: dict[int, _Chunk] = {}

    def add(self, batch: Batch, arrays: list[np.ndarray]) -> None:
        """A batch's results: its outputs' arrays, one row per readable image, and last whether each row is finite
        (those that are not become skipped images, with the reason NON_FINITE)."""
        *arrays, finite = arrays
        if not finite.all():
            readable = [i for i, reason in enumerate(batch.reasons) if reason is None]
            for row in np.flatnonzero(~finite):
                batch.reasons[readable[row]] = NON_FINITE
            arrays = [a[finite] for a in arrays]
        chunk = self.chunks.setdefault(batch.chunk, _Chunk())
        chunk.names += batch.readable
        chunk.arrays.append(arrays)
        chunk.skipped += batch.skipped
        if len(chunk.names) >= self.part_rows or batch.last:
            embedding, *tokens = (np.concatenate(a) for a in zip(*chunk.arrays))
            self.store.write_part(batch.chunk, chunk.parts, chunk.names, embedding, tokens[0] if tokens else None)
            chunk.parts, chunk.rows = chunk.parts + 1, chunk.rows + len(chunk.names)
            chunk.names, chunk.arrays = [], []
        if batch.last:
            del self.chunks[batch.chunk]
            self.store.finish_chunk(batch.chunk, chunk.parts, chunk.rows, chunk.skipped)


class _InFlight:
    """One batch whose results are on their way to pinned host memory."""

    def __init__(self, batch: Batch, host: list[torch.Tensor], event) -> None:
        self.batch, self.host, self.event = batch, host, event

    def wait(self) -> list[np.ndarray]:
        if self.event is not None:
            self.event.synchronize()
        return [h.numpy().copy() for h in self.host]  # out of pinned memory, which stays for reuse


def embed_images(model, images: Sequence, *, batch_size: int = 32, normalize: bool = False,
                 preprocess: Preprocess | None = None, image_size: int | tuple[int, int] | None = None) -> torch.Tensor:
    """The pooled embeddings [N, D] that `vit-triton embed` writes, float32 on the CPU, of `images` in order:
    a list of paths (decoded as embed decodes them) or PIL images (turned upright by their EXIF orientation and
    converted to RGB the same way). A file that cannot be read raises UnreadableImage naming it, and an image whose
    embedding is not finite ValueError: a tensor has no row to skip. Without `preprocess`, the checkpoint's own, for
    images of image_size (an int or (height, width); default the checkpoint's size) as Preprocess.for_model makes
    it. TypeError for anything but such a list."""
    check_images(images, pil=True)
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    pre = preprocess or Preprocess.for_model(model, image_size)
    outputs = embedding_fn(model, pre, normalize, False, torch.float32)
    rows = [torch.empty(0, model.config.embedding_dim)]
    with torch.inference_mode():
        for start in range(0, len(images), batch_size):
            batch = images[start:start + batch_size]
            pixels = torch.stack([pre.resize_crop(_decoded(x, pre.mode)) for x in batch])
            rows.append(outputs(pixels.to(model.patch_embed.weight.device))[0].cpu())
            bad = (~rows[-1].isfinite().all(-1)).nonzero().flatten().tolist()
            if bad:
                what = batch[bad[0]] if isinstance(batch[bad[0]], (str, os.PathLike)) else "a PIL image"
                raise ValueError(f"images[{start + bad[0]}] ({what}): {NON_FINITE}")
    return torch.cat(rows)


def check_images(images, pil: bool) -> None:
    """TypeError unless `images` is a list (any sequence but a string) of paths, or of PIL images too with `pil`,
    naming what it got instead."""
    kinds = (str, os.PathLike, Image.Image) if pil else (str, os.PathLike)
    expected, one = ("paths or PIL images", "a path or a PIL image") if pil else ("paths", "a path")

    def hint(x) -> str:
        if isinstance(x, torch.Tensor):
            return "; a tensor of pixels goes to the model itself (model(pixels), model.forward_features(pixels))"
        return "; for one image, pass [image]" if isinstance(x, kinds) else ""

    if isinstance(images, (str, bytes)) or not isinstance(images, Sequence):
        raise TypeError(f"images must be a list of {expected}, got {type(images).__name__}{hint(images)}")
    for i, image in enumerate(images):
        if not isinstance(image, kinds):
            raise TypeError(f"images[{i}] must be {one}, got {type(image).__name__}{hint(image)}")


def _decoded(image, mode: str):
    """A PIL image as it is (resize_crop turns it upright and converts it), or the image file at a path."""
    if not isinstance(image, (str, os.PathLike)):
        return image
    try:
        return load_image(image, mode)
    except UnreadableImage as e:
        raise UnreadableImage(f"{image}: {e}") from None


def embedding_fn(model, pre: Preprocess, normalize: bool, tokens: bool, output_dtype: torch.dtype):
    """The GPU's share of a batch: uint8 pixels [B, C, H, W] on the model's device -> (pooled embeddings [B, D],
    and with tokens every token's features [B, T, D]) in output_dtype, L2-normalized with normalize."""

    def outputs(pixels: torch.Tensor) -> tuple[torch.Tensor, ...]:
        features = model.forward_features(pre.normalize(pixels))
        pooled = model.embedding(features).float()
        if normalize:
            pooled = F.normalize(pooled, dim=-1)
        return (pooled.to(output_dtype),) + ((features.to(output_dtype),) if tokens else ())

    return outputs


def _launch(compute, graphed, batch: Batch, pixels: torch.Tensor, device: torch.device, batch_size: int,
            empty: list[torch.Tensor]) -> _InFlight:
    """Starts a batch whose pixels are on the device: computed (a full batch from its CUDA graph, when there is
    one), and its results, then whether each image's are finite, on their way to pinned host memory."""
    if not len(pixels):
        return _InFlight(batch, empty, None)
    outputs = graphed(pixels) if graphed is not None and len(pixels) == batch_size else compute(pixels)
    outputs = (*outputs, torch.stack([o.flatten(1).isfinite().all(1) for o in outputs]).all(0))
    cuda = device.type == "cuda"
    host = [torch.empty(o.shape, dtype=o.dtype, pin_memory=cuda).copy_(o, non_blocking=cuda) for o in outputs]
    event = None
    if cuda:
        event = torch.cuda.Event()
        event.record()
    return _InFlight(batch, host, event)


def _distributed() -> tuple[int, int, int]:
    """(rank, world size, local rank); joins the process group under torchrun."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, 0
    import torch.distributed as dist

    if not dist.is_initialized():
        # Only control messages: gloo on any device, and patience for ranks that finish early.
        dist.init_process_group("gloo", timeout=timedelta(hours=12))
    return dist.get_rank(), world, int(os.environ.get("LOCAL_RANK", "0"))


def _broadcast(obj, world: int):
    if world == 1:
        return obj
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def from_rank0(decide, rank: int, world: int):
    """decide() on rank 0, and its result on every rank; its UsageError or OSError raised on every rank."""
    answer = error = None
    if rank == 0:
        try:
            answer = ("ok", decide())
        except (UsageError, OSError) as e:
            answer, error = ("error", isinstance(e, UsageError), str(e)), e
    answer = _broadcast(answer, world)
    if error is not None:
        raise error
    if answer[0] == "error":
        raise (UsageError if answer[1] else OSError)(answer[2])
    return answer[1]


def _sum(value: int, world: int) -> int:
    if world == 1:
        return value
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t.item())


def embed(opts: EmbedOptions, log=lambda msg: print(msg, file=sys.stderr, flush=True)) -> Summary | None:
    """Run (or resume, or add INPUT's new files and those replaced in place to a finished output, or recognise as
    done) one embed command; the Summary on rank 0, None elsewhere. An image whose output is NaN or infinite is
    skipped and listed, as an unreadable one is.

    Raises UsageError for bad options (a --device this machine lacks, an --output that cannot be a file), an output
    from other settings, started in another directory, or one another run is writing, CheckpointNotFound for a
    model that is not there, ValueError for a checkpoint that cannot be used.
    """
    rank, world, local_rank = _distributed()
    try:
        return _embed(opts, rank, world, local_rank, log if rank == 0 else lambda msg: None)
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()


def resolve_device(option: str | None, local_rank: int) -> torch.device:
    """--device, else cuda:LOCAL_RANK (one GPU a process), else the CPU. UsageError for a --device this machine
    does not have, naming those it has: the CPU and its CUDA devices, the kinds the kernels run on."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if option:
        try:
            device = torch.device(option)
        except RuntimeError:   # not a device type torch knows
            device = None
        if device is not None and (device.type == "cpu" or device.type == "cuda" and (device.index or 0) < count):
            # torch.cuda.set_device and the kernels' per-device queries take an index: "cuda" is the current one
            return torch.device("cuda", torch.cuda.current_device()) if device == torch.device("cuda") else device
        has = ", ".join(["cpu", *(["cuda"] if count else []), *(f"cuda:{i}" for i in range(count))])
        raise UsageError(f"--device {option}: expected a device of this machine: {has}"
                         + ("" if count else " (it has no CUDA device)"))
    if not count:
        return torch.device("cpu")
    if local_rank >= count:
        raise UsageError(f"LOCAL_RANK {local_rank} needs cuda:{local_rank}, but this machine has "
                         f"{count} CUDA device(s): run at most that many processes a node "
                         f"(torchrun --nproc-per-node) or pass --device")
    return torch.device("cuda", local_rank)


class _Clock:
    """Wall-clock seconds of a run's phases, in order: mark(name) ends the phase `name` begun at the last mark."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = self.phases.get(name, 0.0) + now - self._last
        self._last = now


def _embed(opts: EmbedOptions, rank: int, world: int, local_rank: int, log) -> Summary | None:
    clock = _Clock()
    wide = widen_hardware_queues()   # the CLI's call came before anything started CUDA; the API's comes here
    device = resolve_device(opts.device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)   # starts CUDA on it
    clock.mark("device")
    on_gpu = device.type == "cuda"
    dtype = opts.dtype or (torch.bfloat16 if on_gpu else torch.float32)
    chunk_size = opts.chunk_size if opts.chunk_size is not None else 512 if opts.tokens else CHUNK_SIZE
    batch_size = opts.batch_size if opts.batch_size is not None else GPU_BATCH_SIZE if on_gpu else 4
    for name, value, least in (("--batch-size", batch_size, 1), ("--chunk-size", chunk_size, 1),
                               ("--num-workers", opts.num_workers or 0, 0)):
        if value < least:
            raise UsageError(f"{name} must be at least {least}, got {value}")
    settings = {"model": opts.model, "input": opts.input, "chunk_size": chunk_size, "normalize": opts.normalize,
                "tokens": opts.tokens, "dtype": str(dtype).removeprefix("torch."), "output_dtype": opts.output_dtype,
                "image_size": list(opts.image_size) if opts.image_size else None}
    store = ChunkStore(opts.output, settings)
    with ExitStack() as held:
        # One run at a time into an output (two would take each other's chunks and temporary files): rank 0
        # holds the lock for every rank of this run until it ends, and a second run is refused before loading.
        from_rank0(lambda: held.enter_context(store.lock()), rank, world)
        model = from_pretrained(opts.model, device=device, dtype=dtype)
        check_image_size(model, opts.image_size)
        pre = Preprocess.for_model(model, opts.image_size)
        clock.mark("checkpoint")
        decoder, passed_over = _decoding(opts.decode, device, pre)
        clock.mark("decoder")
        if decoder is not None:
            log(f"vit-triton embed: JPEGs decoded on the GPU by {decoder.name}"
                + "".join(f" ({reason})" for reason in passed_over))
            if not wide:
                queues = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8, CUDA's default,")
                log(f"vit-triton embed: note: with {queues} hardware queues (CUDA_DEVICE_MAX_CONNECTIONS), the JPEG "
                    f"decoder may wait behind the forwards (5x slower with 8 on an H100): set {WIDE_QUEUES} before "
                    f"CUDA starts")
        # the CPU's and the GPU's pixels differ slightly: one output keeps to one
        store.settings["decode"] = "cpu" if decoder is None else "gpu"

        # Rank 0 decides; everyone gets its decision (or its error, to exit the same way).
        inputs = None

        def plan():
            nonlocal inputs
            inputs, state = store.prepare(lambda: _list(opts.input), log, overwrite=opts.overwrite)
            return state, None if inputs is None else store.pending(inputs)

        state, pending = from_rank0(plan, rank, world)
        if state == "complete":
            log(f"vit-triton embed: {opts.output} is already complete; nothing to do")
            return store.finished_summary() if rank == 0 else None
        if inputs is None:
            inputs = store.read_inputs()
        if state == "resumed":
            total = store.num_chunks(inputs)
            log(f"vit-triton embed: resuming {opts.output}: {total - len(pending)} of {total} chunks already done")

        mine = {k: store.chunk_range(k, inputs) for k in pending[rank::world]}
        # Rank 0 merges the chunks as they come; stopped, its partial output removed, if the run ends without finishing.
        merge = held.enter_context(store.merging(inputs)) if rank == 0 else None
        clock.mark("listing")
        start = time.perf_counter()
        counts = _run(model, pre, inputs, mine, store, opts, device, batch_size, rank, world, decoder, clock)
        processed, gpu_decoded, cpu_decoded = (_sum(c, world) for c in counts)
        if world > 1:
            import torch.distributed as dist

            dist.barrier()
        if rank != 0:
            return None
        summary = merge.finish()
        clock.mark("merge")
        return Summary(summary.output, summary.done, summary.skipped, summary.skipped_file, processed,
                       time.perf_counter() - start, gpu_decoded, cpu_decoded, clock.phases)


def _list(spec: str) -> list[str]:
    try:
        return list_inputs(spec)
    except (FileNotFoundError, ValueError, MissingExtra) as e:  # every rank must hear of it: a UsageError
        raise UsageError(str(e)) from None


def _decoding(option: str | None, device: torch.device, pre: Preprocess) -> tuple[JpegDecoder | None, list[str]]:
    """--decode: the GPU's JPEG decoder (jpeg_decoder) for gpu, None for cpu; by default gpu where one runs, else
    cpu; with why the decoders passed over were. UsageError for gpu where none can run, naming why: not on a CUDA
    device, no decoder that loads and gives libjpeg-turbo's pixels there, a one-channel model, or a preprocessing
    filter the resize kernel lacks."""
    if option not in (None, "cpu", "gpu"):
        raise UsageError(f"--decode must be cpu or gpu, got {option!r}")
    if option == "cpu":
        return None, []
    if pre.channels != 3:
        decoder, why = None, [f"the GPU decodes JPEGs to RGB, and the model takes {pre.channels} channel(s)"]
    elif not pre.gpu_supported:
        decoder, why = None, [f"the resize kernel has no {pre.resample!r} filter (the checkpoint's preprocessing)"]
    else:
        decoder, why = jpeg_decoder(device)
    if decoder is not None or option is None:
        return decoder, why
    raise UsageError(f"--decode gpu: {'; '.join(why)}; use --decode cpu")


def _run(model, pre: Preprocess, inputs: list[str], chunks: dict[int, range], store: ChunkStore,
         opts: EmbedOptions, device: torch.device, batch_size: int, rank: int, world: int,
         decoder: JpegDecoder | None, clock: _Clock) -> tuple[int, int, int]:
    """Embed this rank's chunks; returns how many inputs it handled, and how many images the GPU and the CPU
    decoded. Marks the clock's "first batch" (the workers' start, the first reads and decodes, the kernels'
    compilation and tuning, the CUDA graph's capture) and "embedding" (the rest)."""
    from tqdm import tqdm

    workers = opts.num_workers
    if workers is None:
        # Decoding is the bottleneck (about 100-200 JPEGs/s per core): every core but the main process's.
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        workers = max(1, (os.cpu_count() or 1) // local_world - 1)
    shards = is_shard(inputs[0])
    if shards:  # batches made as each shard is read, by the worker reading it
        dataset = TarShards([(k, inputs[r.start]) for k, r in chunks.items()], pre, batch_size, decoder is not None)
        batching = {"batch_size": None}
    else:
        dataset = ImageFiles(inputs, pre, store.chunk_size, decoder is not None)
        batching = {"batch_sampler": ChunkBatches(list(chunks.values()), batch_size), "collate_fn": dataset.collate}
    loader = DataLoader(dataset, **batching, num_workers=workers, pin_memory=device.type == "cuda",
                        worker_init_fn=functools.partial(worker_init, os.getpid()) if workers else None,
                        persistent_workers=False)
    writer = ChunkWriter(store, store.chunk_size)
    out_dtype = OUTPUT_DTYPES[opts.output_dtype]
    cfg = model.config
    empty = [torch.empty(0, cfg.embedding_dim, dtype=out_dtype)]
    if opts.tokens:
        rows, cols = model.grid(*pre.size)
        empty.append(torch.empty(0, cfg.num_prefix_tokens + rows * cols, cfg.embed_dim, dtype=out_dtype))
    empty.append(torch.empty(0, dtype=torch.bool))   # which rows are finite (_launch)
    total = None if shards else sum(len(r) for r in chunks.values())  # a shard's count is known once it is read
    show = opts.progress if opts.progress is not None else sys.stderr.isatty()
    desc = "embed" if world == 1 else f"embed (rank 0 of {world})"
    bar = tqdm(total=total, unit="img", desc=desc, disable=not show or rank != 0, dynamic_ncols=True)
    handled = decoded_on_gpu = decoded_on_cpu = 0

    def finish(flight: _InFlight) -> None:
        nonlocal handled
        writer.add(flight.batch, flight.wait())
        bar.update(len(flight.batch.names))
        if not handled:
            clock.mark("first batch")
        handled += len(flight.batch.names)

    compute = embedding_fn(model, pre, opts.normalize, opts.tokens, out_dtype)
    # On a GPU, full batches replay one CUDA graph (an eager forward waits on Python's
    # launches); a batch made short by the end of a chunk or by unreadable files runs eagerly, the same computation.
    graphed = CUDAGraphRunner(model, forward=compute) if device.type == "cuda" else None
    in_flight = None
    with torch.inference_mode():
        for batch, pixels in device_batches(loader, pre, device, decoder):
            on_gpu = sum(batch.gpu)
            decoded_on_gpu, decoded_on_cpu = decoded_on_gpu + on_gpu, decoded_on_cpu + len(pixels) - on_gpu
            launched = _launch(compute, graphed, batch, pixels, device, batch_size, empty)
            if in_flight is not None:
                finish(in_flight)  # the previous batch, while the GPU runs this one
            in_flight = launched
        if in_flight is not None:
            finish(in_flight)
    bar.close()
    clock.mark("embedding")
    assert not writer.chunks, f"chunks left unfinished: {sorted(writer.chunks)}"
    return handled, decoded_on_gpu, decoded_on_cpu
