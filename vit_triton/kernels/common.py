"""Shared pieces of the kernels: interpreter detection, the caller's launch options, input checks, the tile
matmul."""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import triton
import triton.language as tl

# Triton reads TRITON_INTERPRET when a kernel is decorated, so this is fixed at import time too.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_INTERPRET = tl.constexpr(INTERPRET)

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclasses.dataclass(frozen=True)
class LaunchOptions:
    """What a caller may choose for the launches it makes. pdl: programmatic dependent launch on Hopper, and
    linear's L2 prefetch of its weights (pdl()); tf32_copies: tf32 GEMMs keep a rounded copy of each float32
    weight, as much memory again, instead of rounding it at every call (tf32.py)."""

    pdl: bool = True
    tf32_copies: bool = True


_thread = threading.local()
_DEFAULT_OPTIONS = LaunchOptions()   # frozen: one instance serves every launch outside a launch_options block


def current_launch_options() -> LaunchOptions:
    """This thread's options: those of the innermost `launch_options(...)` block it is in, else the defaults."""
    return getattr(_thread, "launch_options", _DEFAULT_OPTIONS)


@contextmanager
def launch_options(**choices: bool) -> Iterator[LaunchOptions]:
    """`with launch_options(pdl=False, tf32_copies=False):` the launches this thread makes in the block take these
    LaunchOptions (the others as they were); an unknown name raises TypeError. CUDA graphs keep the options they
    were captured with, and vit_triton.compile captures a graph for each set of options it is called with."""
    before = current_launch_options()
    _thread.launch_options = dataclasses.replace(before, **choices)
    try:
        yield _thread.launch_options
    finally:
        _thread.launch_options = before
LOG2E = 1.4426950408889634   # e^x = 2^(x log2(e)): kernels exponentiate with exp2

try:  # grid dependency control (Triton 3.4+); without it every kernel launches the ordinary way
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    gdc_launch_dependents = gdc_wait = None


PDL_OFF, PDL_LATE, PDL_EARLY = 0, 1, 2   # the PDL constexpr of every kernel: see pdl()
_LATE, _EARLY = tl.constexpr(PDL_LATE), tl.constexpr(PDL_EARLY)


@triton.jit
def wait_for_previous_kernel(PDL: tl.constexpr):
    """Every kernel's wait for its inputs. With programmatic dependent launch (PDL), a kernel's
    programs may be scheduled while the previous kernel in the stream is still running; each waits
    here until that kernel is done and its writes are visible. What comes before this call must not
    read what the previous kernel writes (linear asks L2 for its weights there).

    PDL_EARLY: the next kernel may launch as soon as every program has passed here. Its programs
    then take the SMs this launch leaves idle and fetch what they need that no kernel writes (their
    weights), so at one image the GPU streams the next GEMM's weights while this kernel runs."""
    if PDL:
        gdc_wait()
    if PDL == _EARLY:
        gdc_launch_dependents()


@triton.jit
def start_next_kernel(PDL: tl.constexpr):
    """PDL_LATE: lets the next kernel launch once every program has passed here, each before its last
    stores. A launch of more programs than SMs triggers here, not early: the next kernel's programs
    would otherwise sit on SMs, waiting, while this kernel's programs still run."""
    if PDL == _LATE:
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs, mask):
    """Asks L2 for the 128-byte lines at ptrs where mask holds; nothing is written to registers and
    nothing waits. A no-op under the interpreter."""
    if not _INTERPRET:
        tl.inline_asm_elementwise("{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
                                  "=r,l,r", [ptrs, mask.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def mma(a, b, acc, INPUT_PRECISION: tl.constexpr, A_TF32: tl.constexpr, B_TF32: tl.constexpr):
    """acc += a @ b on the tensor cores: fp32 accumulation, fp32 inputs as ieee or tf32.

    Triton's interpreter multiplies bf16 tiles as raw integers, and fp32 tiles through numpy's BLAS,
    whose order of summation (so the last bit) depends on the tiles' memory layout. There the tile
    product is taken in fp64 (exact products, sums exact to far below fp32's precision) and added to
    the fp32 accumulator: the tensor-core result, the same bits for any layout. tf32 operands are rounded first,
    but for one that already holds tf32 values (A_TF32, B_TF32: rounded by to_tf32 before), whose
    low bits the tensor cores' truncation drops losslessly. Rounding b costs the most: wgmma reads
    B from shared memory only, so a rounded b tile goes registers -> shared memory every K step.
    """
    if a.dtype == tl.float32:
        if INPUT_PRECISION == "tf32" and not A_TF32:
            a = to_tf32(a)
        if INPUT_PRECISION == "tf32" and not B_TF32:
            b = to_tf32(b)
    if _INTERPRET:
        return acc + tl.dot(a.to(tl.float64), b.to(tl.float64), input_precision="ieee").to(tl.float32)
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    return tl.dot(a, b, acc)


@triton.jit
def to_tf32(x):
    """x rounded to tf32's 10 mantissa bits, to nearest with ties away from zero (cvt.rna.tf32.f32,
    what cuBLAS does). The tensor cores would drop the 13 low bits instead: a biased error about
    2.6x cuBLAS's at K=768. Under the interpreter, whose dot is exact fp32, this makes it tf32.
    A NaN stays NaN: on its bits alone the GPU's NaN (all ones) would carry into the sign bit and become
    -0.0, and one whose payload lies only in the 13 low bits would become an infinity."""
    bits = x.to(tl.uint32, bitcast=True)
    return tl.where(x == x, ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True), x)


@triton.jit
def exp2(x):
    """2^x from one SFU instruction (ex2.approx.ftz: relative error below 2^-22, results under 2^-126
    flushed to zero). tl.exp2 adds a compare and two multiplies around it to keep denormals, which
    costs epilogues and softmaxes that evaluate it once an element. Exact under the interpreter."""
    if _INTERPRET:
        y = tl.exp2(x)
    else:
        y = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
    return y


@triton.jit
def tanh(x):
    """tanh(x) from one SFU instruction (tanh.approx.f32: measured on an H100 over [-12, 12], relative
    error below 1e-5, exactly +-1 from |x| = 8 on), for results rounded to 16 bits, where it replaces an
    exp2 and a reciprocal. Exact under the interpreter: (1 - e) / (1 + e) with e = e^-2|x| in fp64."""
    if _INTERPRET:
        e = tl.exp(-2.0 * tl.abs(x.to(tl.float64)))
        t = (1.0 - e) / (1.0 + e)
        y = tl.where(x < 0, -t, t).to(tl.float32)
    else:
        y = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
    return y


@triton.jit
def reciprocal(x):
    """1/x from one SFU instruction (rcp.approx.ftz: within 1 ulp; 0 for |x| above 2^126), where a
    division costs range checks and scalings around it. Exact under the interpreter."""
    if _INTERPRET:
        y = 1.0 / x
    else:
        y = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                      pack=1)
    return y


@triton.jit
def cast(x, dtype: tl.constexpr):
    """x.to(dtype), rounding to nearest even as the GPU does.

    Triton's interpreter truncates fp32 -> bf16; there the rounding is done on the bits first.
    """
    if _INTERPRET and dtype == tl.bfloat16 and x.dtype == tl.float32:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        x = bits.to(tl.float32, bitcast=True)
    return x.to(dtype)


def cdiv(a: int, b: int) -> int:
    """triton.cdiv for host code: Triton's (3.8's at least) is a constexpr_function, about 3 us a call, and the
    launchers of a ViT-B/16 training step make some 1300 calls."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 for host code (cdiv's reason); 0 for n <= 0, as Triton's."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def input_precision(dtype: torch.dtype, allow_tf32: bool | None) -> str:
    """'tf32' or 'ieee' for fp32 matmuls; default follows torch.get_float32_matmul_precision()."""
    if allow_tf32 is None:
        allow_tf32 = torch.get_float32_matmul_precision() != "highest"
    return "tf32" if dtype == torch.float32 and allow_tf32 else "ieee"


def check_device(*tensors: torch.Tensor | None) -> torch.device:
    """All tensors on one device that can run Triton: CUDA, or the CPU under TRITON_INTERPRET=1."""
    present = [t for t in tensors if t is not None]
    device = present[0].device
    for t in present:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device: expected {device}, got {t.device}")
    if device.type == "cpu" and not INTERPRET:
        raise ValueError(
            "CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before importing "
            "vit_triton, or move the tensors to a CUDA device"
        )
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"expected a CUDA (or, with TRITON_INTERPRET=1, CPU) tensor, got {device}")
    return device


def check_image_batch(pixels: torch.Tensor, table: torch.Tensor, columns: tuple[str, ...]) -> torch.device:
    """The device of a batch of images of any sizes as the image kernels take it: uint8 pixels, one flat contiguous
    buffer, and an int64 CPU table of a row per image with these columns."""
    device = check_device(pixels)
    if pixels.dtype != torch.uint8 or pixels.dim() != 1 or not pixels.is_contiguous():
        raise ValueError(f"pixels must be a contiguous 1-D torch.uint8 tensor, got {pixels.dtype} of shape "
                         f"{tuple(pixels.shape)}")
    if (table.dtype != torch.int64 or table.device.type != "cpu" or table.dim() != 2
            or table.shape[1] != len(columns)):
        raise ValueError(f"table must be an int64 CPU tensor [B, {len(columns)}] of ({', '.join(columns)}), got "
                         f"{table.dtype} of shape {tuple(table.shape)} on {table.device}")
    return device


def check_dtype(name: str, t: torch.Tensor, expected: torch.dtype) -> None:
    if t.dtype != expected:
        raise ValueError(f"{name} must be {expected}, got {t.dtype}")


def check_shape(name: str, t: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {tuple(expected)}, got {tuple(t.shape)}")


def check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in DTYPES:
        raise ValueError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")


def tma_ready(*tensors: torch.Tensor | None) -> bool:
    """Whether every 2-D matrix can be read through a TMA descriptor: 16-byte aligned base address
    and row stride, unit stride along the row."""
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0 and t.stride(1) == 1
               for t in tensors if t is not None)


@functools.cache
def _pdl_supported(index: int | None) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def pdl(device: torch.device, programs: int) -> dict:
    """Launch arguments for programmatic dependent launch: the kernel's PDL and Triton's launch_pdl,
    on for CUDA devices of compute capability 9.0 and newer (Hopper) unless launch_options(pdl=False) is in force;
    off under the interpreter. `programs`: how many programs (or tiles) the launch runs at most; when they
    all fit on the SMs at once the next kernel may launch early (PDL_EARLY), else late (PDL_LATE)."""
    on = (not INTERPRET and gdc_wait is not None and device.type == "cuda"
          and current_launch_options().pdl and _pdl_supported(device.index))
    if not on:
        return {"PDL": PDL_OFF}
    return {"PDL": PDL_EARLY if programs <= _sm_count(device.index) else PDL_LATE, "launch_pdl": True}


@functools.cache
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """The device's SM count, 4 under the interpreter: a persistent kernel launches a program on each."""
    return 4 if device.type == "cpu" else _sm_count(device.index)


def tune(cuda_configs: list[triton.Config], interpret_config: triton.Config) -> list[triton.Config]:
    """The autotune list: Hopper-sized tiles on a GPU, one small tile under the interpreter."""
    return [interpret_config] if INTERPRET else cuda_configs
