"""tf32 operands rounded once, outside the GEMM loops that read them.

A matmul on tf32 tensor cores rounds each fp32 operand to 10 mantissa bits (to nearest, as cuBLAS
does: _common.to_tf32). Rounded inside a GEMM's K loop, the weight tile round-trips through
registers to shared memory (wgmma reads B from there only) and the x tile is fed from registers,
every K step of every program: ViT-B/16's GEMMs ran 1.3-2.1x slower for it on an H100
(benchmarks/NOTES.md 26). So the operands come rounded:

- weights: a product of at least TF32_WEIGHT_ROWS rows reads a copy rounded by round_to_tf32, one
  pass over W a call (smaller ones round W in the kernel: the copy would cost more than it saves);
- activations: a kernel whose output is read only as a matmul operand (in a ViT the LayerNorms before
  qkv and fc1, qkv itself, attention, fc1) stores it rounded (its tf32_output flag), and the kernel
  that reads it is told so (tf32_input) and does not round it again.

Both flags act only where the float32 matmuls run on tf32 (allow_tf32, or
torch.get_float32_matmul_precision()), so a producer and its consumer agree. The tensor cores get
the very values they would have rounded themselves: results are bitwise the same either way.

round_to_tf32: any float32 tensor, read as contiguous; the copy is contiguous. No FLOPs; 2 * numel
elements moved (8 bytes each), so memory-bound.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import INTERPRET, check_dtype, pdl, start_next_kernel, to_tf32, wait_for_previous_kernel

BLOCK = 4096   # elements a program: 16 KB read, 16 KB written
# A GEMM of at least this many rows reads its weight rounded beforehand (benchmarks/NOTES.md 26); 64
# under the interpreter, so that tests reach both paths at small sizes.
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


def round_to_tf32(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of float32 t with every element rounded to tf32 (10 mantissa bits, to nearest,
    ties away from zero); infinities stay infinite and NaNs NaN, values that round past the largest
    float32 become infinite."""
    check_dtype("t", t, torch.float32)
    t = t.contiguous()
    out = torch.empty_like(t)
    programs = triton.cdiv(t.numel(), BLOCK)
    if programs:
        launch = pdl(t.device, programs)
        _round_to_tf32_kernel[(programs,)](t, out, t.numel(), BLOCK=BLOCK, num_warps=8, **launch)
    return out


def tf32_weight(weight: torch.Tensor, rows: int, precision: str) -> tuple[torch.Tensor, bool]:
    """(weight as a GEMM of `rows` rows should read it, whether it holds tf32 values): a rounded copy
    for a tf32 product of at least TF32_WEIGHT_ROWS rows, else the weight as it is (the GEMM rounds)."""
    if precision == "tf32" and rows >= TF32_WEIGHT_ROWS:
        return round_to_tf32(weight), True
    return weight, False

