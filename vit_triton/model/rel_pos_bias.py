"""BEiT's relative position bias (ViTConfig.rel_pos_bias): a learned table [R + 3, H], one value per head for each
of the R = (2 rows - 1)(2 cols - 1) offsets between two patches of a rows x cols grid and three for the class token
(its row, its column, itself), gathered into the bias [H, T, T] that the attention adds to each head's scores.

The index [T, T] that picks a table row for every (query, key) pair is timm's gen_relative_position_index (and
transformers' BeitRelativePositionBias' own): a buffer of the model, computed once. The gather is PyTorch's, so
autograd scatters the bias' gradient back into the table.
"""

from __future__ import annotations

import torch


def table_rows(grid: tuple[int, int]) -> int:
    """R + 3: the rows of the table of a rows x cols patch grid."""
    return (2 * grid[0] - 1) * (2 * grid[1] - 1) + 3


def relative_position_index(grid: tuple[int, int], device: torch.device | str | None = None) -> torch.Tensor:
    """The table row [T, T] (int64) of each (query, key) pair, T = 1 + rows * cols with the class token first: for
    two patches, their offset (row and column, each shifted to start at 0) numbered row-major; R for the class token's
    queries, R + 1 for its key, R + 2 for the class token to itself."""
    rows, cols = grid
    coords = torch.stack(torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")).flatten(1)
    offset = coords[:, :, None] - coords[:, None, :]   # [2, P, P]
    patches = (offset[0] + rows - 1) * (2 * cols - 1) + offset[1] + cols - 1
    r = table_rows(grid) - 3
    index = torch.full((rows * cols + 1,) * 2, r, dtype=torch.int64)
    index[1:, 1:] = patches
    index[:, 0] = r + 1
    index[0, 0] = r + 2
    return index.to(device)


def relative_position_bias(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The bias [H, T, T] (contiguous, in the table's dtype) of a table [R + 3, H] at the pairs of `index` [T, T]:
    timm's table[index].permute(2, 0, 1), gathered as one [H, T, T] tensor."""
    return table.t()[:, index].contiguous()
