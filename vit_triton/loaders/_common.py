"""What every loader shares: checking a mapped state dict against the model it must fill."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from ..model import ViT, ViTConfig


def rename(keys: Iterable[str], rules: list[tuple[str, str]]) -> dict[str, str]:
    """{source key: our key} for each key that a (regex, replacement) rule matches in full."""
    mapping = {}
    for key in keys:
        for pattern, repl in rules:
            new, hits = re.subn(f"^{pattern}$", repl, key)
            if hits:
                mapping[key] = new
                break
    return mapping


def check_state_dict(cfg: ViTConfig, state_dict: dict[str, torch.Tensor], source: str,
                     unmapped: Iterable[str] = ()) -> None:
    """Raise ValueError listing every missing, unexpected and mis-shaped key at once."""
    expected = {k: tuple(v.shape) for k, v in ViT(cfg, device="meta").state_dict().items()}
    problems = [f"missing: {k} {list(s)}" for k, s in expected.items() if k not in state_dict]
    problems += [f"unexpected: {k}" for k in sorted(unmapped)]
    problems += [f"unexpected: {k}" for k in state_dict if k not in expected]
    problems += [f"wrong shape: {k} is {list(state_dict[k].shape)}, expected {list(expected[k])}"
                 for k in expected if k in state_dict and tuple(state_dict[k].shape) != expected[k]]
    if problems:
        raise ValueError(f"{source} checkpoint does not fit {cfg}:\n  " + "\n  ".join(problems))


def build(cfg: ViTConfig, state_dict: dict[str, torch.Tensor], like: torch.Tensor) -> ViT:
    """A ViT holding copies of `state_dict`'s tensors (never sharing the source's storage), on the
    device and in the dtype of tensor `like`, in eval mode."""
    model = ViT(cfg, device=like.device, dtype=like.dtype)
    model.load_state_dict(state_dict, strict=True)
    return model.eval()
