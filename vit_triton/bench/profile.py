"""Where a pass's GPU time goes, kernel by kernel: torch.profiler's CUDA kernels of a callable (kernels inside a
replayed CUDA graph included), each put in a class by its name, for bench's side-by-side of vit-triton and its
peers (--profile): which class of work a family loses its time in, before any change."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch

# First match wins. Ours are named _<op>_kernel; torch.compile's Triton kernels triton_{poi,red,per,tem}_fused_<ops>;
# cuBLAS's sm90_xmma_gemm_*, nvjet_*, cutlass*, splitKreduce_kernel; PyTorch's flash and memory-efficient attention
# pytorch_flash::flash_{fwd,bwd}_*, fmha_cutlass*; cuDNN's *sdpa*; fused AdamW multi_tensor_apply_kernel.
KERNEL_CLASSES = (
    ("attention", r"attention|attn|flash|fmha|sdpa|_delta_kernel"),
    ("GEMM", r"gemm|linear|matmul|xmma|cutlass|nvjet|splitk|triton_tem|_mm_|addmm|bmm|patch_embed|conv|fprop|dgrad|"
             r"wgrad"),
    ("norm", r"norm"),
    ("optimizer", r"adam|multi_tensor"),
)
_PATTERNS = [(name, re.compile(pattern, re.IGNORECASE)) for name, pattern in KERNEL_CLASSES]
CLASSES = tuple(name for name, _ in KERNEL_CLASSES) + ("other",)


def kernel_class(name: str) -> str:
    """The class of a CUDA kernel (or memcpy/memset) by its name: one of CLASSES."""
    return next((cls for cls, pattern in _PATTERNS if pattern.search(name)), "other")


def own_times(spans: Sequence[tuple[float, float]]) -> list[float]:
    """Each (start, end) span's own time: from the later of its start and the latest end of the spans that started
    before it, to its end (0 if they cover it). A kernel launched early (programmatic dependent launch) waits for
    the one before it to finish; that wait is the other kernel's time, not its own. The own times add up to the
    time the GPU was busy with any of them."""
    order = sorted(range(len(spans)), key=lambda i: spans[i][0])
    out = [0.0] * len(spans)
    busy_until = float("-inf")
    for i in order:
        start, end = spans[i]
        out[i] = max(0.0, end - max(start, busy_until))
        busy_until = max(busy_until, end)
    return out


def kernel_profile(fn: Callable[[], object], passes: int = 3, top: int = 12) -> dict:
    """fn's GPU work per call, from `passes` calls under torch.profiler after one unprofiled call: microseconds in
    each class (CLASSES), their total, the kernels launched, and the `top` costliest kernels as [name, us, launches]
    per call. Each kernel counts its own time (own_times), so the total is the GPU's busy time, not the wall
    clock."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(passes):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    own = own_times([(e.time_range.start, e.time_range.end) for e in events])
    per_name: dict[str, list[float]] = {}
    for event, us in zip(events, own):
        entry = per_name.setdefault(event.name, [0.0, 0])
        entry[0] += us / passes
        entry[1] += 1 / passes
    classes = dict.fromkeys(CLASSES, 0.0)
    for name, (us, _) in per_name.items():
        classes[kernel_class(name)] += us
    costliest = sorted(per_name.items(), key=lambda kv: -kv[1][0])[:top]
    return dict(total_us=sum(classes.values()), launches=round(sum(n for _, n in per_name.values())),
                classes=classes, top=[[name, us, round(n)] for name, (us, n) in costliest])


def format_kernel_classes(rows: Sequence[dict]) -> str:
    """The profiled rows (those with "kernels") side by side, one table per batch size (and precision): each class's
    microseconds per pass in each system, then the total and the launches."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        if "kernels" in row:
            groups.setdefault((row.get("precision", ""), row["batch"]), []).append(row)
    out = []
    for (precision, batch), group in groups.items():
        width = max(12, *(len(r["system"]) for r in group))
        out.append(f"GPU time per pass by kernel class, us ({precision + ', ' if precision else ''}batch {batch}):")
        out.append(f"  {'class':10s}" + "".join(f" {r['system']:>{width}s}" for r in group))
        for cls in CLASSES:
            out.append(f"  {cls:10s}" + "".join(f" {r['kernels']['classes'][cls]:{width}.1f}" for r in group))
        out.append(f"  {'total':10s}" + "".join(f" {r['kernels']['total_us']:{width}.1f}" for r in group))
        out.append(f"  {'launches':10s}" + "".join(f" {r['kernels']['launches']:{width}d}" for r in group))
    return "\n".join(out)
