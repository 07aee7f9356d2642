"""Position embeddings at any patch grid: the table stored for the checkpoint's grid, resampled to another one
the way the checkpoint's library resamples it, so that the model gives the library's output at any image size.

This is PyTorch code that runs once per grid: `ResampledTables` keeps each resampled table until pos_embed
changes, and the forward passes it to the patch_embed kernel, which adds it in its epilogue (or, where the patch
embeddings are normalised first, to that norm's kernel). AIMv2's native-resolution models have a fixed sin-cos
table instead, built for each grid (`SincosTables`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bucket_rows(old_grid: tuple[int, int], new_grid: tuple[int, int], device: torch.device) -> torch.Tensor:
    """The table row of each patch of new_grid, in row-major order, as transformers' Idefics3 and SmolVLM pick it
    for an image without a patch mask: along each axis, patch i of n sits at i * (1 / n) (float32, below 1), and
    takes the cell of the table's own side (old_grid, square) that this fraction falls in (torch.bucketize on the
    cells' lower edges, on `device`). At some sides this is not the identity even at the table's own grid."""
    side = old_grid[0]
    edges = torch.arange(1 / side, 1.0, 1 / side, device=device)
    cells = []
    for n in new_grid:
        fraction = torch.arange(n, device=device, dtype=torch.float32) * (1.0 / torch.tensor(n, device=device))
        cells.append(torch.bucketize(fraction.clamp(max=1.0 - 1e-6), edges, right=True))
    return (cells[0][:, None] * side + cells[1][None, :]).flatten()


def resample(table: torch.Tensor, prefix: int, old_grid: tuple[int, int], new_grid: tuple[int, int],
             style: str) -> torch.Tensor:
    """The position table [prefix + rows * cols, D] of patch grid old_grid (rows, cols) for new_grid: the first
    `prefix` rows (the prefix tokens') as they are, then the patch rows, seen as a [D, rows, cols] image, resized
    by F.interpolate(mode="bicubic", align_corners=False) as `style` (ViTConfig.pos_resample) says: in float32
    and antialiased, in float32, or in the table's dtype, the result in the table's dtype; or "bucket": the rows
    bucket_rows picks. At its own grid, the table itself, but for "bucket"."""
    if style == "bucket":
        return torch.cat([table[:prefix], table[prefix:][bucket_rows(old_grid, new_grid, table.device)]])
    if tuple(new_grid) == tuple(old_grid):
        return table
    dim = table.shape[-1]
    patches = table[prefix:].reshape(1, *old_grid, dim).permute(0, 3, 1, 2)
    if style != "bicubic":
        patches = patches.float()
    patches = F.interpolate(patches, size=tuple(new_grid), mode="bicubic", align_corners=False,
                            antialias=style == "bicubic_float32_antialias")
    patches = patches.to(table.dtype).permute(0, 2, 3, 1).reshape(-1, dim)
    return torch.cat([table[:prefix], patches])


def sincos_table(grid: tuple[int, int], dim: int, device: torch.device | str | None = None,
                 dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The fixed 2-D sin-cos position table [rows * cols, dim] of patch grid (rows, cols) (ViTConfig.pos_sincos), as
    transformers' AIMv2 builds it (build_2d_sinusoidal_position_embedding, then its column-first layout): for
    the patch at row r and column c, in row-major order, [sin(c w) | cos(c w) | sin(r w) | cos(r w)] with
    w_k = 1 / 10000^(k / (dim / 4)), computed in float64 on `device`, then rounded to dtype."""
    quarter = dim // 4
    omega = 1.0 / 10000.0 ** (torch.arange(quarter, dtype=torch.float64, device=device) / quarter)
    rows, cols = torch.meshgrid(*(torch.arange(n, dtype=torch.float64, device=device) for n in grid), indexing="ij")
    by_row, by_col = (t.flatten().outer(omega) for t in (rows, cols))
    return torch.cat([by_col.sin(), by_col.cos(), by_row.sin(), by_row.cos()], dim=1).to(dtype)


class SincosTables:
    """A model's sin-cos position tables (sincos_table) at every (patch grid, device, dtype) it ran at, each built
    once and kept, where a CUDA graph captured with it reads it."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.tables: dict[tuple, torch.Tensor] = {}

    def __call__(self, grid: tuple[int, int], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        if torch.compiler.is_compiling():   # part of the compiled graph: no Python state to keep
            return sincos_table(grid, self.dim, device, dtype)
        key = (tuple(grid), torch.device(device), dtype)
        if key not in self.tables:
            with torch.inference_mode(False):   # a normal tensor, even when first built in inference mode
                self.tables[key] = sincos_table(grid, self.dim, device, dtype)
        return self.tables[key]


def tensor_state(table: torch.Tensor) -> tuple:
    """What tells that a table changed: its memory, dtype and device, and its version counter (an inference
    tensor has none: only a new tensor is seen)."""
    return table.data_ptr(), table.dtype, table.device, None if table.is_inference() else table._version


class ResampledTables:
    """A model's position table at every patch grid the model was run at, each resampled once and kept until the
    table changes (in place or for another tensor), then resampled again into the same memory, where a CUDA
    graph captured with it reads it."""

    def __init__(self, prefix: int, grid: tuple[int, int], style: str) -> None:
        """prefix: the rows of the prefix tokens; grid: the table's own patch grid; style: ViTConfig.pos_resample."""
        self.prefix, self.grid, self.style = prefix, tuple(grid), style
        self.tables: dict[tuple[int, int], tuple[torch.Tensor, tuple]] = {}

    def __call__(self, table: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """`table` for patch grid `grid`: itself at its own grid (but for "bucket"), else its kept resampling, brought
        up to date."""
        grid = tuple(grid)
        if grid == self.grid and self.style != "bucket":
            return table
        if torch.compiler.is_compiling() or torch.is_grad_enabled() and table.requires_grad:
            # part of the compiled graph, or of the graph autograd records (training): no Python state to keep
            return resample(table, self.prefix, self.grid, grid, self.style)
        kept = self.tables.get(grid)
        if kept is None or kept[1] != tensor_state(table):
            return self._resample(table, grid)
        return kept[0]

    def refresh(self, table: torch.Tensor) -> None:
        """Resamples again every kept table that `table` changed since (CUDAGraphRunner does it before a replay)."""
        for grid, (_, state) in list(self.tables.items()):
            if state != tensor_state(table):
                self._resample(table, grid)

    def _resample(self, table: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        # A normal tensor, without autograd history, even when called in inference mode or on a parameter.
        with torch.inference_mode(False), torch.no_grad():
            new = resample(table, self.prefix, self.grid, grid, self.style)
            kept = self.tables.get(grid)
            if kept is not None and (kept[0].shape, kept[0].dtype, kept[0].device) == (new.shape, new.dtype,
                                                                                           new.device):
                new = kept[0].copy_(new)
        self.tables[grid] = (new, tensor_state(table))
        return new
