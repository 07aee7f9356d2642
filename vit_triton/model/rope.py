"""Rotary position embeddings: the (cos, sin) tables that linear(rope=...) rotates q and k with, for any
patch grid, equal bit for bit to the tables timm and transformers build for the same model.

Each kind (ViTConfig.rope) repeats its library's operations in their order, dtype and device, since any other
order, or sin and cos taken on another device, changes last bits. Tables are float32 and contiguous: [T, Dh] for
all heads, or for "mixed" [depth, H, T, Dh], whose [H, T, Dh] slice of a block is contiguous too; T is rows * cols,
the patches in row-major order. `RopeTables` computes them once per grid and keeps them.
"""

from __future__ import annotations

import math

import torch

from .config import ViTConfig
from .pos_embed import tensor_state


def _layout(x: torch.Tensor, half: bool) -> torch.Tensor:
    """Values per rotated pair [..., Dh / 2] spread over the head's channels [..., Dh]: each value twice in a row
    for pairs (2i, 2i + 1), or the whole row twice for pairs a half apart."""
    return torch.cat([x, x], -1) if half else x.repeat_interleave(2, -1)


def _coords(rows: torch.Tensor, cols: torch.Tensor, xy: bool) -> torch.Tensor:
    """The coordinates [rows * cols, 2] of the patches in row-major order: (row, column), or (column, row) if xy."""
    r, c = torch.meshgrid(rows, cols, indexing="ij")
    return torch.stack((c, r) if xy else (r, c), -1).reshape(-1, 2)


def _index_axis(size: int, offset: float, device: torch.device) -> torch.Tensor:
    """The patches' indices along an axis of `size`, plus offset."""
    return torch.arange(size, device=device).to(torch.float32) + offset


def _centered_axis(size: int, offset: float, device: torch.device) -> torch.Tensor:
    """The patches' centres along an axis of `size`, plus offset, over the axis' length: in [0, 1]."""
    return (torch.arange(0.5, size, dtype=torch.float32, device=device) + offset) / size


def rope_tables(cfg: ViTConfig, grid: tuple[int, int], device: torch.device | str | None = None,
                freqs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of `cfg`'s rotary embedding (ViTConfig.rope, not "none") for patch grid (rows, cols), on
    `device` (default the CPU), or for "mixed" from the learned `freqs` [2, depth, H, Dh / 2] on their device;
    computed there, or on the CPU and moved if cfg.rope_cpu."""
    if (cfg.rope == "mixed") != (freqs is not None):
        raise ValueError(f"rope {cfg.rope!r} " + ("takes no freqs" if freqs is not None else "needs the freqs"))
    if cfg.rope == "none":
        raise ValueError("the config has no rotary embedding (rope 'none')")
    device = freqs.device if freqs is not None else torch.device(device or "cpu")
    if cfg.rope_cpu:
        cpu = torch.device("cpu")
        return tuple(t.to(device) for t in _tables(cfg, grid, cpu, None if freqs is None else freqs.to(cpu)))
    return _tables(cfg, grid, device, freqs)


def _tables(cfg: ViTConfig, grid: tuple[int, int], device: torch.device,
            freqs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """rope_tables' (cos, sin), each step on `device` but those its library takes on the CPU."""
    dh, half, xy, offset = cfg.head_dim, cfg.rope_half, cfg.rope_xy, cfg.rope_offset
    if cfg.rope == "axial":   # timm's RotaryEmbeddingCat, in_pixels=False; its bands on the CPU
        bands = 1.0 / (cfg.rope_theta ** (torch.arange(dh // 4).to(torch.float32) / (dh // 4)))
        axes = [_index_axis(size, offset, device) for size in grid]
        if cfg.rope_ref_grid:   # EVA's positions stretched onto the pretraining grid
            axes = [t / size * ref for t, size, ref in zip(axes, grid, cfg.rope_ref_grid)]
        angles = (_coords(*axes, xy)[:, :, None] * bands.to(device)).flatten(1)
    elif cfg.rope == "mixed":   # timm's RotaryEmbeddingMixed: a learned 2D frequency per pair, layer and head
        x, y = _coords(*(_index_axis(size, offset, device) for size in grid), xy).unbind(1)
        freqs = freqs.float()
        angles = x[:, None] * freqs[0, ..., None, :] + y[:, None] * freqs[1, ..., None, :]
    elif cfg.rope == "centered":   # timm's RotaryEmbeddingDinoV3: coordinates and periods on the CPU
        periods = cfg.rope_theta ** (2.0 * torch.arange(dh // 4, dtype=torch.float32) / (dh // 2))
        coords = 2.0 * _coords(*(_centered_axis(size, offset, "cpu") for size in grid), xy) - 1.0
        angles = (2 * math.pi * coords[:, :, None].to(device) / periods.to(device)).flatten(1)
    else:   # transformers' DINOv3ViTRopePositionEmbedding: its inverse frequencies on the CPU, laid out before cos
        inv_freq = 1 / cfg.rope_theta ** torch.arange(0, 1, 4 / dh, dtype=torch.float32)
        coords = 2.0 * _coords(*(_centered_axis(size, offset, device) for size in grid), xy) - 1.0
        angles = _layout((2 * math.pi * coords[:, :, None] * inv_freq.to(device)).flatten(1), half)
        return angles.cos(), angles.sin()
    return _layout(angles.cos(), half), _layout(angles.sin(), half)


class RopeTables:
    """A model's rotary tables at every (patch grid, device) it ran at, each computed once and kept; "mixed" ones
    also until the learned freqs change (in place or for another tensor), then computed again into the same
    memory, where a CUDA graph captured with them reads them."""

    def __init__(self, cfg: ViTConfig) -> None:
        if cfg.rope == "none":
            raise ValueError("the config has no rotary embedding (rope 'none')")
        self.cfg = cfg
        # The learned parameter of "mixed" (the model's rope_freqs), shaped as timm's rope.freqs.
        self.freqs_shape = (2, cfg.depth, cfg.num_heads, cfg.head_dim // 2) if cfg.rope == "mixed" else None
        self.tables: dict[tuple, tuple[tuple[torch.Tensor, torch.Tensor], tuple | None]] = {}

    def __call__(self, grid: tuple[int, int], device: torch.device | str | None = None,
                 freqs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for patch grid `grid` (rope_tables' arguments): the kept ones, brought up to date."""
        if torch.compiler.is_compiling() or freqs is not None and torch.is_grad_enabled() and freqs.requires_grad:
            # part of the compiled graph, or of the graph autograd records (training): no Python state to keep
            return rope_tables(self.cfg, grid, device, freqs)
        key = self._key(grid, device, freqs)
        kept = self.tables.get(key)
        if kept is None or kept[1] != self._state(freqs):
            return self._compute(key, freqs)
        return kept[0]

    def refresh(self, freqs: torch.Tensor | None = None) -> None:
        """Computes again every kept table that `freqs` changed since (CUDAGraphRunner does it before a replay)."""
        for key, (_, state) in list(self.tables.items()):
            if state != self._state(freqs):
                self._compute(key, freqs)

    def _key(self, grid, device, freqs) -> tuple:
        return tuple(grid), freqs.device if freqs is not None else torch.device(device or "cpu")

    @staticmethod
    def _state(freqs: torch.Tensor | None) -> tuple | None:
        return None if freqs is None else tensor_state(freqs)

    def _compute(self, key: tuple, freqs: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # Normal tensors, without autograd history, even when called in inference mode or on a parameter.
        with torch.inference_mode(False), torch.no_grad():
            new = rope_tables(self.cfg, *key, freqs)
            kept = self.tables.get(key)
            if kept is not None and kept[0][0].shape == new[0].shape:
                new = tuple(old.copy_(t) for old, t in zip(kept[0], new))
        self.tables[key] = (new, self._state(freqs))
        return new
