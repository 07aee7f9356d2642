"""`vit-triton verify`: this machine's kernels against PyTorch, at the shapes of one model.

For each dtype, every kernel is run at the shapes one forward pass uses, then the whole model,
and compared with the same computation in PyTorch: in float64 (the reference) and in the dtype
itself (PyTorch's own error, which sets the 16-bit tolerance). Random weights and inputs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..kernels import fused_attention, layer_norm, linear, patch_embed
from ..model import ViT, ViTConfig
from ..model.reference import activation, reference_forward
from .numerics import rel_err, tolerance


@dataclass
class Check:
    name: str
    dtype: torch.dtype
    shape: str
    err: float
    torch_err: float
    tol: float

    @property
    def ok(self) -> bool:
        return self.err <= self.tol


def _compare(name: str, shape: str, ours: Callable, reference: Callable, *inputs: torch.Tensor | None) -> Check:
    """Run ours and reference on `inputs` and reference again on their float64 copies."""
    dtype = next(t.dtype for t in inputs if t is not None)
    out = ours(*inputs)
    ref = reference(*(None if t is None else t.double() for t in inputs))
    torch_err = rel_err(reference(*inputs), ref)
    return Check(name, dtype, shape, rel_err(out, ref), torch_err, tolerance(dtype, torch_err))


def _attention_ref(qkv: torch.Tensor) -> torch.Tensor:
    q, k, v = qkv.permute(2, 0, 3, 1, 4)
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)


def _patch_embed_ref(px, w, b, pos, pre):
    x = F.conv2d(px, w, b, stride=w.shape[-1]).flatten(2).transpose(1, 2)
    return torch.cat([pre.expand(x.shape[0], -1, -1), x], dim=1) + pos


def kernel_checks(cfg: ViTConfig, batch: int, dtype: torch.dtype, device: torch.device) -> list[Check]:
    """Each kernel at the shapes of one forward pass of `cfg` at `batch` images."""
    d, f, t, h = cfg.embed_dim, cfg.mlp_dim, cfg.num_tokens, cfg.num_heads
    m = batch * t

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=device) * scale).to(dtype)

    x, w_ln, b_ln = rand(m, d, scale=2.0), rand(d, scale=0.5) + 1, rand(d)
    s = cfg.patch_size
    px = torch.randn(batch, cfg.in_chans, cfg.image_size, cfg.image_size, device=device).to(dtype)
    return [
        _compare("patch_embed", f"{batch}x{cfg.in_chans}x{cfg.image_size}^2 -> {t}x{d}",
                 patch_embed, _patch_embed_ref,
                 px, rand(d, cfg.in_chans, s, s, scale=(cfg.in_chans * s * s) ** -0.5), rand(d),
                 rand(t, d), rand(cfg.num_prefix_tokens, d)),
        _compare("layer_norm", f"{m}x{d}",
                 lambda x, w, b: layer_norm(x, w, b, cfg.norm_eps),
                 lambda x, w, b: F.layer_norm(x, (d,), w, b, cfg.norm_eps), x, w_ln, b_ln),
        _compare("linear qkv +bias", f"{m}x{d} @ {d}x{3 * d}",
                 lambda x, w, b: linear(x, w, b), F.linear, x, rand(3 * d, d, scale=d ** -0.5), rand(3 * d)),
        _compare("fused_attention", f"{batch}x{h}x{t}x{cfg.head_dim}",
                 lambda qkv: fused_attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]), _attention_ref,
                 rand(batch, t, 3, h, cfg.head_dim)),
        _compare(f"linear fc1 +bias +{cfg.act}", f"{m}x{d} @ {d}x{f}",
                 lambda x, w, b: linear(x, w, b, activation=cfg.act),
                 lambda x, w, b: activation(F.linear(x, w, b), cfg.act), x, rand(f, d, scale=d ** -0.5), rand(f)),
        _compare("linear fc2 +bias +residual", f"{m}x{f} @ {f}x{d}",
                 lambda x, w, b, r: linear(x, w, b, residual=r),
                 lambda x, w, b, r: F.linear(x, w, b) + r,
                 rand(m, f), rand(d, f, scale=f ** -0.5), rand(d), x),
    ]


def random_model(cfg: ViTConfig, dtype: torch.dtype, device: torch.device, seed: int = 0) -> ViT:
    """A ViT with random weights, LayerNorms and biases included (none left at 1 or 0)."""
    torch.manual_seed(seed)
    model = ViT(cfg, device=device, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.to(dtype).eval()


def time_forward(model: ViT, pixels: torch.Tensor) -> float:
    """Milliseconds per forward: median of CUDA-event timings on a GPU, one run in the interpreter."""
    if pixels.is_cuda:
        import triton.testing

        return triton.testing.do_bench(lambda: model(pixels), warmup=100, rep=500, return_mode="median")
    start = time.perf_counter()
    model(pixels)
    return (time.perf_counter() - start) * 1e3


def model_check(cfg: ViTConfig, batch: int, dtype: torch.dtype, device: torch.device) -> tuple[Check, float]:
    """The whole forward (logits or pooled embedding) against the PyTorch reference; and its time."""
    model = random_model(cfg, dtype, device)
    pixels = torch.randn(batch, cfg.in_chans, cfg.image_size, cfg.image_size, device=device).to(dtype)
    params = dict(model.state_dict())
    check = _compare("model forward", f"{batch}x{cfg.num_tokens}x{cfg.embed_dim}, depth {cfg.depth}",
                     lambda px: model(px), lambda px: reference_forward(cfg, _cast(params, px.dtype), px), pixels)
    return check, time_forward(model, pixels)


def _cast(params: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {k: v.to(dtype) for k, v in params.items()}


def verify(cfg: ViTConfig, batch: int, dtypes: Sequence[torch.dtype], device: torch.device,
           log: Callable[[str], None] = print) -> tuple[list[Check], dict[torch.dtype, float]]:
    """All checks for each dtype, and the model's time per batch for each dtype."""
    checks, times = [], {}
    for dtype in dtypes:
        log(f"checking {str(dtype).removeprefix('torch.')} ...")
        checks += kernel_checks(cfg, batch, dtype, device)
        check, ms = model_check(cfg, batch, dtype, device)
        checks.append(check)
        times[dtype] = ms
    return checks, times


def format_table(checks: Sequence[Check], times: dict[torch.dtype, float], batch: int, timer: str) -> str:
    """Relative errors per kernel and dtype, then the time per batch."""
    rows = [("check", "dtype", "shape", "rel err", "torch rel err", "tolerance", "")]
    for c in checks:
        rows.append((c.name, str(c.dtype).removeprefix("torch."), c.shape, f"{c.err:.2e}", f"{c.torch_err:.2e}",
                     f"{c.tol:.2e}", "ok" if c.ok else "FAIL"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.append(f"time per batch of {batch} ({timer}):")
    for dtype, ms in times.items():
        lines.append(f"  {str(dtype).removeprefix('torch.'):9s} {ms:10.3f} ms  {batch / ms * 1e3:10.1f} images/s")
    return "\n".join(lines)
