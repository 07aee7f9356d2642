"""tf32 operands rounded once, outside the GEMM loops that read them.

A matmul on tf32 tensor cores rounds each fp32 operand to 10 mantissa bits (to nearest, as cuBLAS
does: common.to_tf32). Rounded inside a GEMM's K loop, the weight tile round-trips through
registers to shared memory (wgmma reads B from there only) and the x tile is fed from registers,
every K step of every program: ViT-B/16's GEMMs ran 1.3-2.1x slower for it on an H100. So the operands come rounded:

- weights: a GEMM reads a copy of W rounded once by round_to_tf32 and kept while W lives (tf32_weight).
  The copy follows in-place changes to W (optimizer steps, load_state_dict, copy_): W's version counter
  tells, and the copy is rounded again, in place, so a CUDA graph that reads it stays right as long as
  refresh_copies() runs before each replay (runtime.CUDAGraphRunner does). Writes that bypass the
  counter (through `.data` or the storage) are not seen: clear_copies() drops every copy. The kept
  copies take as much memory again as the float32 weights; common.launch_options(tf32_copies=False) keeps
  none. Where no copy is kept (that setting; an inference tensor has no version counter; nothing is allocated
  during a CUDA-graph capture), a product of at least TF32_WEIGHT_ROWS rows reads a copy rounded for
  the call and a smaller one rounds W in its K loop;
- activations: a kernel whose output is read only as a matmul operand (in a ViT the LayerNorms before
  qkv and fc1, qkv itself, attention, fc1) stores it rounded (its tf32_output flag), and the kernel
  that reads it is told so (tf32_input) and does not round it again.

Both flags act only where the float32 matmuls run on tf32 (allow_tf32, or
torch.get_float32_matmul_precision()), so a producer and its consumer agree. The tensor cores get
the very values they would have rounded themselves: results are bitwise the same either way.

round_to_tf32: any float32 tensor, read as contiguous; the copy is contiguous. No FLOPs; numel elements
read and numel written, 4 bytes each (8 bytes an element in all), so memory-bound.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import (
    INTERPRET, cdiv, check_dtype, current_launch_options, pdl, start_next_kernel, to_tf32, wait_for_previous_kernel,
)

BLOCK = 4096   # elements a program: 16 KB read, 16 KB written
# Without a kept copy, a GEMM of at least this many rows reads its weight rounded for the call
#; 64 under the interpreter, so that tests reach both paths at small sizes.
TF32_WEIGHT_ROWS = 64 if INTERPRET else 1024


@triton.jit
def _round_to_tf32_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, PDL: tl.constexpr):
    # The copy may reuse memory the previous kernel still reads: nothing is stored before the wait.
    wait_for_previous_kernel(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    start_next_kernel(PDL)
    tl.store(y_ptr + offs, to_tf32(x), mask=mask)


def round_to_tf32(t: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """A contiguous copy of float32 t with every element rounded to tf32 (10 mantissa bits, to nearest,
    ties away from zero); infinities stay infinite and NaNs NaN, values that round past the largest
    float32 become infinite. out: a contiguous tensor of t's shape to write it to."""
    check_dtype("t", t, torch.float32)
    t = t.contiguous()
    if out is None:
        out = torch.empty_like(t)
    elif out.shape != t.shape or out.dtype != t.dtype or out.device != t.device or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}, "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    programs = cdiv(t.numel(), BLOCK)
    if programs:
        launch = pdl(t.device, programs)
        _round_to_tf32_kernel[(programs,)](t, out, t.numel(), BLOCK=BLOCK, num_warps=8, **launch)
    return out


@dataclass
class _Copy:
    """A weight's rounded copy and what the weight was when it was rounded."""

    weight: weakref.ref
    rounded: torch.Tensor
    data_ptr: int = -1
    version: int = -1

    def fresh(self, weight: torch.Tensor) -> bool:
        return weight.data_ptr() == self.data_ptr and weight._version == self.version

    def fits(self, weight: torch.Tensor) -> bool:
        return self.rounded.shape == weight.shape and self.rounded.device == weight.device

    def refresh(self, weight: torch.Tensor) -> None:
        """Rounds the weight again, into the same memory (the address a CUDA graph holds)."""
        round_to_tf32(weight, out=self.rounded)
        self.data_ptr, self.version = weight.data_ptr(), weight._version


# id(weight) -> its copy. Not a WeakKeyDictionary: that compares keys with ==, elementwise for tensors.
# An entry leaves when its weight is freed (the weakref's callback, which takes no lock: it may run
# inside any allocation, lock held or not).
_copies: dict[int, _Copy] = {}
_lock = threading.Lock()


def _forget(ref: weakref.ref, key: int) -> None:
    copy = _copies.get(key)
    if copy is not None and copy.weight is ref:
        _copies.pop(key, None)


def _kept_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight's kept rounded copy, made or brought up to date; None where none may be kept."""
    # Copies kept before launch_options(tf32_copies=False) stay until clear_copies().
    if weight.is_inference() or not current_launch_options().tf32_copies:
        return None
    key = id(weight)
    copy = _copies.get(key)
    if copy is not None and copy.weight() is weight and copy.fresh(weight):
        return copy.rounded
    if weight.is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    with _lock:
        copy = _copies.get(key)
        if copy is None or copy.weight() is not weight or not copy.fits(weight):
            ref = weakref.ref(weight, lambda ref, key=key: _forget(ref, key))
            with torch.inference_mode(False):   # a normal tensor even when made inside inference mode
                rounded = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
            copy = _copies[key] = _Copy(ref, rounded)
        if not copy.fresh(weight):
            copy.refresh(weight)
        return copy.rounded


def refresh_copies() -> None:
    """Rounds again, in place, every kept copy whose weight changed since it was rounded. A CUDA graph
    reads the copies at the addresses it was captured with: call this before each replay."""
    with _lock:
        for copy in list(_copies.values()):
            weight = copy.weight()
            if weight is not None and not copy.fresh(weight) and copy.fits(weight):
                copy.refresh(weight)


def clear_copies() -> None:
    """Drops every kept copy (after writes a version counter does not see, or to free their memory)."""
    with _lock:
        _copies.clear()


def tf32_weight(weight: torch.Tensor, rows: int, precision: str) -> tuple[torch.Tensor, bool]:
    """(weight as a GEMM of `rows` rows should read it, whether it holds tf32 values): for a tf32 product,
    the kept rounded copy or, where none may be kept, a copy rounded now for a product of at least
    TF32_WEIGHT_ROWS rows; else the weight as it is (the GEMM rounds it, or it is not tf32)."""
    if precision != "tf32":
        return weight, False
    kept = _kept_copy(weight)
    if kept is not None:
        return kept, True
    if rows >= TF32_WEIGHT_ROWS:
        return round_to_tf32(weight), True
    return weight, False
