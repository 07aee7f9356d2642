"""Every kernel, forward and backward, compiles for the H100 (sm_90); its matrix products use Hopper's wgmma,
linear's TMA kernels the TMA, the tiled kernels that read through pointers copy ahead asynchronously (the
software pipeline), each waits for the kernel before it (programmatic dependent launch), linear's forward TMA
kernel asks L2 for its weights before that wait, linear's activations on 16-bit outputs take one tanh an
element, and their derivatives the accurate exp2 and reciprocal forms; each first launch config fits in shared
memory."""

import subprocess
import sys
from pathlib import Path


# The most shared memory a program may take on an H100 or H200 (227 KB). The kernels compiled here are each list's
# first launch config, which a tuner takes unseen inside a CUDA-graph capture (nothing can be timed there): it must
# fit every epilogue.
SM90_SHARED = 232448


def test_kernels_compile_for_sm90_with_wgmma():
    script = Path(__file__).with_name("sm90_compile.py")
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            cwd=script.parent.parent)
    assert result.returncode == 0, result.stderr[-5000:]
    counts = {}   # (name, dtype) -> each compiled case's {field: [numbers]}
    for line in result.stdout.splitlines():
        name, dtype, *found = line.split(" ")
        counts.setdefault((name, dtype), []).append(
            {field: [int(n) for n in value.split(",")] for field, value in (f.split("=") for f in found)})
    assert len(counts) == 84, sorted(counts)
    for (name, dtype), found in counts.items():
        def each(field):
            return [case[field] for case in found]

        # Tensor-core kernels in 16-bit and tf32 must use wgmma; exact fp32 and row kernels none.
        uses_tensor_cores = name.startswith(("linear", "fused_attention", "patch_embed")) and dtype != "fp32"
        early = name.endswith("-early")
        backward = "-backward" in name
        assert all(w > 0 if uses_tensor_cores else w == 0 for [w] in each("wgmma")), (name, dtype, found)
        # linear's TMA kernels move their tiles with the TMA (bulk tensor copies); no other kernel does.
        assert all((t > 0) == name.startswith("linear-tma") for [t] in each("tma")), (name, dtype, found)
        # The tiled kernels that read through pointers stage their next K (or key) tiles with cp.async;
        # without it every loop step would wait out a global-memory load.
        if name in ("linear", "linear-early", "linear-split-early", "fused_attention", "patch_embed",
                    "patch_embed-backward-dpixels") or name.startswith(("linear-backward", "fused_attention-backward")):
            assert all(c > 0 for [c] in each("cpasync")), (name, dtype, found)
        # Programmatic dependent launch: every kernel waits for the one before it once, and lets the
        # next one launch: right after the wait (PDL_EARLY, before any load), or before its last
        # stores (linear's loop holds that twice).
        assert all(wait == 1 and launch >= 1 for wait, launch in each("gdc")), (name, dtype, found)
        # Nothing reads or writes global memory before the wait: the kernel before may still be writing
        # this one's inputs, or reading memory that this one's outputs reuse.
        assert all(before == 0 for [before] in each("memory_before_wait")), (name, dtype, found)
        assert all(first == early for [first] in each("trigger_before_loads")), (name, dtype, found)
        # linear's forward TMA kernel prefetches its weights, every prefetch ahead of the wait; no other kernel
        # prefetches.
        if name.startswith("linear-tma") and not backward:
            assert all(total > 0 and before == total for total, before in each("prefetch")), (name, dtype, found)
        else:
            assert all(total == 0 for total, _ in each("prefetch")), (name, dtype, found)
        # linear's activations: a bf16 or fp16 y takes one tanh an element and no exp2 or reciprocal; fp32 and tf32
        # (every case GELU) the erf form's exp2 and reciprocal, no tanh.
        if name.startswith("linear") and not backward and dtype in ("bf16", "fp16"):
            assert all(ex2 == rcp == 0 for ex2, rcp, _ in each("sfu")), (name, dtype, found)
        elif name.startswith("linear") and not backward:
            assert all(ex2 > 0 and rcp > 0 and tanh == 0 for ex2, rcp, tanh in each("sfu")), (name, dtype, found)
        # The activations' derivatives (fc2's dX epilogue, at fc1's pre-activation): exp2 and reciprocal, as
        # accurate as fp32 in every dtype.
        if name.startswith("linear") and name.endswith(("backward-dx", "backward-dx-swiglu")):
            assert all(ex2 > 0 and rcp > 0 for ex2, rcp, _ in each("sfu")), (name, dtype, found)
        assert all(shared <= SM90_SHARED for [shared] in each("shared")), (name, dtype, found)
    for dtype in ("bf16", "fp16"):
        linear = counts["linear", dtype]
        assert any(tanh > 0 for _, _, tanh in (case["sfu"] for case in linear)), linear
