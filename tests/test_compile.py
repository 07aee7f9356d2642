"""Every kernel, forward and backward, compiles for the H100 (sm_90); its matrix products use Hopper's wgmma,
linear's TMA kernels the TMA, the tiled kernels that read through pointers copy ahead asynchronously (the
software pipeline), each waits for the kernel before it (programmatic dependent launch), linear's forward TMA
kernel asks L2 for its weights before that wait, linear's activations on 16-bit outputs take one tanh an
element, and their derivatives the accurate exp2 and reciprocal forms."""

import subprocess
import sys
from pathlib import Path


def test_kernels_compile_for_sm90_with_wgmma():
    script = Path(__file__).with_name("sm90_compile.py")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            cwd=script.parent.parent)
    assert result.returncode == 0, result.stderr[-5000:]
    counts = {}
    for line in result.stdout.splitlines():
        name, dtype, *found = line.split(" ")
        counts.setdefault((name, dtype), []).append([[int(n) for n in f.split("=")[1].split(",")] for f in found])
    assert len(counts) == 77, sorted(counts)
    for (name, dtype), found in counts.items():
        # Tensor-core kernels in 16-bit and tf32 must use wgmma; exact fp32 and row kernels none.
        uses_tensor_cores = name.startswith(("linear", "fused_attention", "patch_embed")) and dtype != "fp32"
        early = name.endswith("-early")
        backward = "-backward" in name
        assert all(w > 0 for [w], *_ in found) if uses_tensor_cores else all(w == 0 for [w], *_ in found), (
            name, dtype, found)
        # linear's TMA kernels move their tiles with the TMA (bulk tensor copies); no other kernel does.
        assert all((t > 0) == name.startswith("linear-tma") for _, [t], *_ in found), (name, dtype, found)
        # The tiled kernels that read through pointers stage their next K (or key) tiles with cp.async;
        # without it every loop step would wait out a global-memory load.
        if name in ("linear", "linear-early", "linear-split-early", "fused_attention", "patch_embed",
                    "patch_embed-backward-dpixels") or name.startswith(("linear-backward", "fused_attention-backward")):
            assert all(c > 0 for _, _, [c], *_ in found), (name, dtype, found)
        # Programmatic dependent launch: every kernel waits for the one before it once, and lets the
        # next one launch: right after the wait (PDL_EARLY, before any load), or before its last
        # stores (linear's loop holds that twice).
        assert all(wait == 1 and launch >= 1 for _, _, _, [wait, launch], *_ in found), (name, dtype, found)
        # Nothing reads or writes global memory before the wait: the kernel before may still be writing
        # this one's inputs, or reading memory that this one's outputs reuse.
        assert all(before == 0 for _, _, _, _, [before], *_ in found), (name, dtype, found)
        assert all(first == early for *_, [first], _ in found), (name, dtype, found)
        # linear's forward TMA kernel prefetches its weights, every prefetch ahead of the wait; no other kernel
        # prefetches.
        if name.startswith("linear-tma") and not backward:
            assert all(total > 0 and before == total for *_, [total, before], _, _ in found), (name, dtype, found)
        else:
            assert all(total == 0 for *_, [total, _], _, _ in found), (name, dtype, found)
        # linear's activations: a bf16 or fp16 y takes one tanh an element and no exp2 or reciprocal; fp32 and tf32
        # (every case GELU) the erf form's exp2 and reciprocal, no tanh.
        if name.startswith("linear") and not backward and dtype in ("bf16", "fp16"):
            assert all(ex2 == rcp == 0 for *_, [ex2, rcp, _] in found), (name, dtype, found)
        elif name.startswith("linear") and not backward:
            assert all(ex2 > 0 and rcp > 0 and tanh == 0 for *_, [ex2, rcp, tanh] in found), (name, dtype, found)
        # The activations' derivatives (fc2's dX epilogue, at fc1's pre-activation): exp2 and reciprocal, as
        # accurate as fp32 in every dtype.
        if name.startswith("linear") and name.endswith(("backward-dx", "backward-dx-swiglu")):
            assert all(ex2 > 0 and rcp > 0 for *_, [ex2, rcp, _] in found), (name, dtype, found)
    for dtype in ("bf16", "fp16"):
        assert any(tanh > 0 for *_, [_, _, tanh] in counts["linear", dtype]), counts["linear", dtype]
