"""`vit-triton bench --train`: a training step of vit-triton beside timm eager and torch.compile(timm), in one
process, and the attention backward beside PyTorch's flash SDPA backward.

A training step is a forward, cross-entropy against random labels, the backward and one step of fused AdamW
(torch.optim.AdamW(fused=True)) over every parameter, in one of two precisions: "bf16-mixed" (torch.autocast to
bfloat16 over float32 weights: fp32 master weights and optimizer state) or "bf16" (weights, gradients and
optimizer state in bfloat16). Every system starts from the same weights: timm's model with random weights, and
vit-triton's converted from it (from_timm). Before any timing, the first step's loss and the classifier's weight
gradient of vit-triton are checked against timm eager's in the same precision, both against a float32 step of timm
(tf32 off): a wrong answer ends the run. Each system is warmed up (compiling, tuning), then its steps are timed
with triton.testing.do_bench (median of CUDA-event timings); peak memory is the most allocated over a warmed step.

MFU is the step's matrix-product FLOPs (3x the forward's: the backward's dX and dW products are two of the same
size each) over the measured bf16 matmul ceiling (an 8192^3 product, harness.measure_ceilings).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from .costs import model_flops
from .harness import Timer, do_bench_median, environment, measure_ceilings, write_result
from .numerics import rel_err
from .profile import kernel_profile

PRECISIONS = ("bf16-mixed", "bf16")
TRAIN_SYSTEMS = ("vit-triton", "vit-triton+cudagraph", "timm", "timm+compile")
# (batch, heads, tokens, head dim) of the attention backward timed beside flash SDPA: ViT-B/16 @ 224 and @ 256,
# ViT-L/14 @ 336, ViT-L/16 @ 512.
ATTENTION_SHAPES = ((128, 12, 197, 64), (128, 12, 257, 64), (64, 16, 577, 64), (32, 16, 1025, 64))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, pixels: torch.Tensor, labels: torch.Tensor,
               mixed: bool) -> torch.Tensor:
    """One step: forward (under autocast to bf16 if mixed), cross-entropy in fp32, backward, optimizer step."""
    with torch.autocast(pixels.device.type, torch.bfloat16, enabled=mixed):
        logits = model(pixels)
    loss = F.cross_entropy(logits.float(), labels)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _optimizer(model: torch.nn.Module, capturable: bool = False) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.05, fused=True, capturable=capturable)


def graphed_step(model: torch.nn.Module, pixels: torch.Tensor, labels: torch.Tensor, mixed: bool,
                 warmup: int = 3) -> Callable[[], torch.Tensor]:
    """A replay of train_step as one CUDA graph (PyTorch's whole-network capture: capturable AdamW, static inputs,
    the gradients living in the graph's memory), after `warmup` eager steps on a side stream that tune every
    kernel: what torch.compile's reduce-overhead mode does to a step, without the Python that issues ~300 kernels
    (each op's dispatch, autograd and launcher: 0.1-0.3 ms of host time a call)."""
    optimizer = _optimizer(model, capturable=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            train_step(model, optimizer, pixels, labels, mixed)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        with torch.autocast(pixels.device.type, torch.bfloat16, enabled=mixed, cache_enabled=False):
            logits = model(pixels)
        loss = F.cross_entropy(logits.float(), labels)
        loss.backward()
        optimizer.step()
    return _Replay(graph, loss, optimizer)


class _Replay:
    """A captured step: replays its graph and returns the loss it wrote. Holds the optimizer, whose state tensors
    the graph updates in place (freed with it, the graph would write to freed memory)."""

    def __init__(self, graph: torch.cuda.CUDAGraph, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        self.graph, self.loss, self.optimizer = graph, loss, optimizer

    def __call__(self) -> torch.Tensor:
        self.graph.replay()
        return self.loss


def with_classifier(timm_module: torch.nn.Module, classes: int = 1000) -> torch.nn.Module:
    """timm_module itself, given timm's new classifier of `classes` where it has none (an encoder: SigLIP's,
    DINOv2's), as a fine-tuning run adds one: the step's loss and the checks need logits."""
    if not timm_module.num_classes:
        timm_module.reset_classifier(classes)
    return timm_module


def build_train_systems(timm_module: torch.nn.Module, precision: str, device: torch.device,
                        names: Sequence[str] = TRAIN_SYSTEMS) -> tuple[torch.nn.Module, dict[str, torch.nn.Module]]:
    """(timm's model, the reference of the checks, and {system: model}), in train mode, all with timm_module's
    weights, in the precision's weight dtype."""
    from .. import from_timm

    dtype = torch.float32 if precision == "bf16-mixed" else torch.bfloat16
    timm_ref = timm_module.to(device=device, dtype=dtype).train()
    out = {}
    for name in ("vit-triton", "vit-triton+cudagraph"):
        if name in names:
            out[name] = from_timm(timm_ref).to(device=device, dtype=dtype).train()
    if "timm" in names:
        out["timm"] = timm_ref
    if "timm+compile" in names:
        out["timm+compile"] = torch.compile(copy.deepcopy(timm_ref))
    return timm_ref, out


def check_step(ours: torch.nn.Module, timm_ref: torch.nn.Module, pixels: torch.Tensor, labels: torch.Tensor,
               mixed: bool) -> dict:
    """vit-triton's first loss, head-weight gradient and pixels' gradient (the whole backward, down to the patch
    embedding) against timm eager's, both against timm in float32 with exact matmuls."""

    def step(model, fp32: bool = False):
        model = copy.deepcopy(model)
        model = model.float() if fp32 else model
        x = (pixels.float() if fp32 else pixels).detach().requires_grad_()
        with torch.autocast(pixels.device.type, torch.bfloat16, enabled=mixed and not fp32):
            loss = F.cross_entropy(model(x).float(), labels)
        loss.backward()
        # timm's and vit-triton's classifier are both `head`
        return loss.detach().double(), model.head.weight.grad.double(), x.grad.double()

    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        want = step(timm_ref, fp32=True)
    finally:
        torch.set_float32_matmul_precision(before)
    theirs, mine = step(timm_ref), step(ours)
    row = {}
    for i, name in enumerate(("loss", "head_grad", "pixels_grad")):
        row[f"{name}_err"], row[f"timm_{name}_err"] = rel_err(mine[i], want[i]), rel_err(theirs[i], want[i])
    # one scalar's 16-bit error may be near zero by chance: the loss is held to bf16's resolution at least
    row["ok"] = (row["loss_err"] <= max(1.5 * row["timm_loss_err"], 2 ** -8)
                 and all(row[f"{n}_err"] <= 1.5 * row[f"timm_{n}_err"] for n in ("head_grad", "pixels_grad")))
    return row


def run_train_bench(model_name: str, timm_module: torch.nn.Module, batch_sizes: Sequence[int],
                    precisions: Sequence[str], device: torch.device, out_dir: Path | None = None,
                    systems: Sequence[str] = TRAIN_SYSTEMS, timer: Timer = do_bench_median,
                    log: Callable[[str], None] = print, attention_shapes=ATTENTION_SHAPES,
                    profile: bool = False) -> dict:
    """Time a training step of every system at every batch size and precision (a model without a classifier given
    one, with_classifier; with profile, at the largest batch size each step's kernels by class: kernel_profile);
    then the attention backward. Writes bench.json (after each row) and a plot."""
    from ..loaders import timm_config_to_vit

    cfg = timm_config_to_vit(with_classifier(timm_module))
    classes = cfg.num_classes
    result = dict(model=model_name, config=cfg.to_dict(), mode="train", environment=environment(device), rows=[],
                  train_flops_per_image=3 * model_flops(cfg), attention=[])
    result["ceilings"] = measure_ceilings(torch.bfloat16, device, timer)
    log(f"ceilings: {result['ceilings']['matmul_tflops']:.0f} TFLOP/s bf16 matmul, "
        f"{result['ceilings']['copy_gbps']:.0f} GB/s copy")
    for precision in precisions:
        mixed = precision == "bf16-mixed"
        reference, built = build_train_systems(copy.deepcopy(timm_module), precision, device, systems)
        for batch in batch_sizes:
            pixels = torch.randn(batch, cfg.in_chans, cfg.image_size, cfg.image_size, device=device)
            pixels = pixels if mixed else pixels.to(torch.bfloat16)
            labels = torch.randint(0, classes, (batch,), device=device)
            ours = built.get("vit-triton", built.get("vit-triton+cudagraph"))
            if ours is not None:
                check = check_step(ours, reference, pixels[:8], labels[:8], mixed)
                log(f"{precision} check against timm in float32, relative errors: " + ", ".join(
                    f"{n} {check[n + '_err']:.2e} (timm {check['timm_' + n + '_err']:.2e})"
                    for n in ("loss", "head_grad", "pixels_grad")))
                result.setdefault("checks", []).append(dict(precision=precision, batch=batch, **check))
                if not check["ok"]:
                    write_result(result, out_dir)
                    raise RuntimeError(f"vit-triton's training step is wrong, no speed reported: {check}")
            for name, model in built.items():
                row = dict(system=name, precision=precision, batch=batch)
                try:
                    row.update(_time_step(model, pixels, labels, mixed, timer, graphed=name.endswith("+cudagraph"),
                                          profile=profile and batch == max(batch_sizes)))
                except Exception as e:   # a peer that fails (out of memory) is recorded, not fatal
                    row["error"] = f"{type(e).__name__}: {e}"[:300]
                    log(f"  {name} {precision} batch {batch}: {row['error']}")
                else:
                    row.update(images_per_s=batch / row["ms"] * 1e3,
                               tflops=result["train_flops_per_image"] * batch / row["ms"] / 1e9)
                    row["mfu"] = row["tflops"] / result["ceilings"]["matmul_tflops"]
                    log(f"  {precision:10s} batch {batch:4d}  {name:20s} {row['ms']:9.3f} ms  "
                        f"{row['images_per_s']:7.0f} img/s  {row['tflops']:6.1f} TFLOP/s  MFU {row['mfu']:.1%}  "
                        f"peak {row['peak_mem_gib']:.2f} GiB")
                result["rows"].append(row)
                torch.cuda.empty_cache()
                write_result(result, out_dir)
        del reference, built
        torch.cuda.empty_cache()
    for shape in attention_shapes:
        row = attention_backward_times(*shape, device=device, timer=timer)
        log(f"  attention backward {shape}: vit-triton {row['ms']:.3f} ms ({row['tflops']:.0f} TFLOP/s), flash SDPA "
            f"{row['sdpa_ms']:.3f} ms ({row['sdpa_tflops']:.0f} TFLOP/s): {row['speedup']:.2f}x")
        result["attention"].append(row)
    result["speedup"] = train_speedups(result["rows"])
    write_result(result, out_dir)
    return result


def _time_step(model, pixels, labels, mixed: bool, timer: Timer, graphed: bool = False, profile: bool = False) -> dict:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    if graphed:
        step = graphed_step(model, pixels, labels, mixed)
    else:
        optimizer = _optimizer(model)
        for _ in range(3):   # compile, tune, optimizer state
            train_step(model, optimizer, pixels, labels, mixed)

        def step():
            return train_step(model, optimizer, pixels, labels, mixed)
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 2 ** 30
    row = dict(ms=timer(step), peak_mem_gib=peak)
    if profile:
        row["kernels"] = kernel_profile(step)
    return row


def attention_backward_times(batch: int, heads: int, tokens: int, head_dim: int, device: torch.device,
                             timer: Timer = do_bench_median, dtype: torch.dtype = torch.bfloat16) -> dict:
    """The attention backward alone, bf16: vit-triton's kernels (from the packed QKV, as the model calls them)
    against F.scaled_dot_product_attention's flash backward on [B, H, T, Dh] tensors. FLOPs: 10 B H T^2 Dh (five
    T x T x Dh products, recomputing the scores)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from .. import kernels

    qkv = torch.randn(batch, tokens, 3, heads, head_dim, device=device, dtype=dtype)
    q, k, v = qkv.unbind(2)
    lse = torch.empty(batch, heads, tokens, device=device, dtype=torch.float32)
    o = kernels.fused_attention(q, k, v, lse=lse)
    do = torch.randn_like(o)
    dqkv = torch.empty_like(qkv)
    ours = timer(lambda: kernels.attention_backward(q, k, v, o, lse, do, dq=dqkv[:, :, 0], dk=dqkv[:, :, 1],
                                                    dv=dqkv[:, :, 2]))
    qt, kt, vt = (t.transpose(1, 2).detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out = F.scaled_dot_product_attention(qt, kt, vt)
    dout = do.transpose(1, 2)
    theirs = timer(lambda: torch.autograd.grad(out, (qt, kt, vt), dout, retain_graph=True))
    flops = 10 * batch * heads * tokens * tokens * head_dim
    return dict(batch=batch, heads=heads, tokens=tokens, head_dim=head_dim, ms=ours, sdpa_ms=theirs,
                tflops=flops / ours / 1e9, sdpa_tflops=flops / theirs / 1e9, speedup=theirs / ours)


def train_speedups(rows: Sequence[dict]) -> dict[str, dict]:
    """Per precision and batch: the best peer's step time over vit-triton's, and the peak memories."""
    out = {}
    for key in sorted({(r["precision"], r["batch"]) for r in rows}):
        timed = [r for r in rows if (r["precision"], r["batch"]) == key and "ms" in r]
        ours = [r for r in timed if r["system"].startswith("vit-triton")]
        peers = [r for r in timed if not r["system"].startswith("vit-triton")]
        if ours and peers:
            best, fastest = min(peers, key=lambda r: r["ms"]), min(ours, key=lambda r: r["ms"])
            out[f"{key[0]}/{key[1]}"] = dict(best_peer=best["system"], ours=fastest["system"],
                                             speedup=best["ms"] / fastest["ms"], peak_mem_gib=fastest["peak_mem_gib"],
                                             peer_peak_mem_gib=best["peak_mem_gib"])
    return out


def format_train_table(result: dict) -> str:
    """One line per system, precision and batch; the speed-ups; the attention backward."""
    lines = [f"{'precision':10s}  {'batch':>5s}  {'system':20s}  {'ms':>9s}  {'img/s':>7s}  {'TFLOP/s':>7s}  "
             f"{'MFU':>6s}  {'peak GiB':>8s}"]
    for r in result["rows"]:
        if "ms" in r:
            lines.append(f"{r['precision']:10s}  {r['batch']:5d}  {r['system']:20s}  {r['ms']:9.3f}  "
                         f"{r['images_per_s']:7.0f}  {r['tflops']:7.1f}  {r['mfu']:6.1%}  {r['peak_mem_gib']:8.2f}")
        else:
            lines.append(f"{r['precision']:10s}  {r['batch']:5d}  {r['system']:20s}  error: {r['error'][:60]}")
    for key, s in result.get("speedup", {}).items():
        lines.append(f"{key}: {s['ours']} is {s['speedup']:.2f}x {s['best_peer']} ({s['peak_mem_gib']:.2f} GiB peak "
                     f"against {s['peer_peak_mem_gib']:.2f})")
    for a in result["attention"]:
        lines.append(f"attention backward {a['batch']}x{a['heads']}x{a['tokens']}x{a['head_dim']}: {a['ms']:.3f} ms "
                     f"against flash SDPA's {a['sdpa_ms']:.3f} ms: {a['speedup']:.2f}x")
    env, ceil = result["environment"], result["ceilings"]
    lines.append(f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}; ceiling "
                 f"{ceil['matmul_tflops']:.0f} TFLOP/s bf16 matmul")
    return "\n".join(lines)
