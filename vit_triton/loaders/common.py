"""What every loader shares: renaming a checkpoint's keys to ours, remembering where each tensor came from,
and checking the result against the model it must fill, in the checkpoint's own names."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from ..model import ViT, ViTConfig


def square(size: int | list | tuple, name: str) -> int:
    """A config's image or patch size as one side: an int, or a [height, width] pair of equal sides."""
    if isinstance(size, int):
        return size
    if len(size) == 2 and size[0] == size[1]:
        return size[0]
    raise ValueError(f"unsupported {name} {size!r}; supported: square (an int or two equal sides)")


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


class Mapped:
    """A checkpoint's tensors under our names (`tensors`), with the checkpoint keys each came from (`origin`),
    so that every problem can be reported by the names the user's checkpoint has."""

    def __init__(self, state_dict: dict[str, torch.Tensor], rules: list[tuple[str, str]],
                 unused: list[tuple[str, str]] = ()) -> None:
        mapping = rename(state_dict, rules)
        self.checkpoint_keys = set(state_dict)
        self.tensors = {mapping[k]: v for k, v in state_dict.items() if k in mapping}
        self.origin = {ours: [theirs] for theirs, ours in mapping.items()}
        self.unexpected = set(state_dict) - set(mapping) - set(rename(state_dict, unused))
        self.problems: list[str] = []
        self.reported: set[str] = set()   # our keys whose problem is already in `problems`
        self.missing_parts: dict[str, list[str]] = {}   # our key -> the parts of it (concat) the checkpoint lacks

    def concat(self, key: str, parts: list[str], shape: tuple[int, ...] | None = None) -> None:
        """tensors[key] = the present `parts` concatenated along dim 0. shape: each part's expected shape, and
        every part required (q, k, v into qkv); else each part is reshaped to rows of the last dim (tokens)."""
        present = [p for p in parts if p in self.tensors]
        origin = [name for p in present for name in self.origin[p]]
        if shape is None:
            if present:
                width = self.tensors[present[0]].shape[-1]
                self.tensors[key] = torch.cat([self.tensors.pop(p).reshape(-1, width) for p in present])
                self.origin[key] = origin
            return
        missing = [p for p in parts if p not in self.tensors]
        wrong = [p for p in present if tuple(self.tensors[p].shape) != shape]
        tensors = [self.tensors.pop(p) for p in present]
        if wrong:
            self.problems += [f"wrong shape: {self.origin[p][0]} is {list(t.shape)}, expected {list(shape)}"
                              for p, t in zip(present, tensors) if p in wrong]
            self.reported.add(key)
        elif missing:   # check() names them after the same parts of another block
            self.missing_parts[key] = missing
        else:
            self.tensors[key] = torch.cat(tensors)
            self.origin[key] = origin

    def fold_layer_scale(self, depth: int) -> None:
        """LayerScale (blocks.i.ls1 after proj, ls2 after fc2: a per-channel gamma multiplying the branch's
        output) folded into that layer's weight rows and bias, in float32, so the model runs without it:
        gamma * (h W^T + b) = h (gamma W)^T + gamma b. Blocks must all have it or none."""
        pairs = [(f"blocks.{i}.{ls}", f"blocks.{i}.{layer}") for i in range(depth)
                 for ls, layer in (("ls1", "proj"), ("ls2", "fc2"))]
        if not any(ls in self.tensors for ls, _ in pairs):
            return
        for ls, layer in pairs:
            if ls not in self.tensors:
                theirs = self._their_names(ls)
                self.problems.append(f"missing: {', '.join(theirs) if theirs else ls} (the layer scale of {layer})")
                continue
            gamma, origin = self.tensors.pop(ls), self.origin.pop(ls)
            for key in (f"{layer}.weight", f"{layer}.bias"):
                t = self.tensors.get(key)
                if t is None:
                    continue
                if tuple(gamma.shape) != t.shape[:1]:
                    self.problems.append(f"wrong shape: {origin[0]} is {list(gamma.shape)}, expected [{t.shape[0]}]")
                    continue
                dtype = torch.promote_types(t.dtype, torch.float32)
                scale = gamma.to(dtype)
                self.tensors[key] = t.to(dtype) * (scale[:, None] if t.dim() == 2 else scale)
                self.origin[key] = self.origin[key] + origin

    def add_first_row(self, key: str, table: str) -> None:
        """tensors[key] += tensors[table][0] (in float32), which then loses that row: a position embedding's row
        for a token that is never resampled, folded into the token."""
        if key in self.tensors and table in self.tensors:
            token, rows = self.tensors[key], self.tensors[table]
            dtype = torch.promote_types(token.dtype, torch.float32)
            self.tensors[key] = token.to(dtype) + rows[0].to(dtype)
            self.tensors[table] = rows[1:]
            self.origin[key] = self.origin[key] + self.origin[table]

    def move(self, layer: str, new_layer: str) -> None:
        """layer's weight and bias renamed to new_layer's (a checkpoint layer that plays another of our roles)."""
        for name in ("weight", "bias"):
            key = f"{layer}.{name}"
            if key in self.tensors:
                self.tensors[f"{new_layer}.{name}"] = self.tensors.pop(key)
                self.origin[f"{new_layer}.{name}"] = self.origin.pop(key)

    def interleave(self, key: str, gate: str, value: str) -> None:
        """tensors[key] = the rows of `gate` and `value` interleaved (gate row j at 2j, value row j at 2j + 1): a
        gated MLP's two input projections as the one fc1 whose epilogue gates (act "swiglu")."""
        if gate in self.tensors and value in self.tensors:
            g, v = self.tensors.pop(gate), self.tensors.pop(value)
            if g.shape != v.shape:
                self.problems.append(f"wrong shape: {self.origin[value][0]} is {list(v.shape)}, expected "
                                     f"{list(g.shape)} as {self.origin[gate][0]}")
                return
            self.tensors[key] = torch.stack([g, v], 1).reshape(-1, *g.shape[1:])
            self.origin[key] = self.origin.pop(gate) + self.origin.pop(value)

    def zeros_like(self, key: str, like: str) -> None:
        """tensors[key] = zeros shaped as tensors[like], where the checkpoint has no key: a bias a checkpoint
        leaves out of one of the parts it joins (EVA's and DINOv3's k of q, k, v)."""
        if key not in self.tensors and like in self.tensors:
            self.tensors[key] = torch.zeros_like(self.tensors[like])
            self.origin[key] = []

    def split(self, key: str, parts: list[str], rows: int) -> None:
        """tensors[key] cut along dim 0 into parts of `rows` rows each (the last takes the rest): one matrix that
        our model holds as several layers (SigLIP's in_proj as the pool's q and kv)."""
        if key in self.tensors:
            t, origin = self.tensors.pop(key), self.origin.pop(key)
            for i, part in enumerate(parts):
                self.tensors[part] = t[i * rows:(i + 1) * rows] if i < len(parts) - 1 else t[i * rows:]
                self.origin[part] = origin

    def transpose(self, key: str) -> None:
        """tensors[key] as its transpose (a matrix stored as x @ W rather than nn.Linear's x @ W^T)."""
        if key in self.tensors:
            self.tensors[key] = self.tensors[key].t()

    def reshape(self, key: str, *shape: int) -> None:
        if key in self.tensors:
            self.tensors[key] = self.tensors[key].reshape(*shape)

    def check(self, cfg: ViTConfig, source: str) -> dict[str, torch.Tensor]:
        """The tensors, or ValueError listing every missing, unexpected and mis-shaped key at once."""
        expected = {k: tuple(v.shape) for k, v in ViT(cfg, device="meta").state_dict().items()}
        problems = list(self.problems)
        problems += [self._missing(k, s) for k, s in expected.items() if k not in self.tensors and k not in self.reported]
        problems += [f"unexpected: {k}" for k in sorted(self.unexpected)]
        problems += [f"unexpected: {' + '.join(self.origin.get(k, [k]))}" for k in self.tensors if k not in expected]
        problems += [f"wrong shape: {' + '.join(self.origin[k])} is {list(self.tensors[k].shape)}, expected "
                     f"{list(expected[k])}" for k in expected
                     if k in self.tensors and tuple(self.tensors[k].shape) != expected[k]]
        if problems:
            raise ValueError(f"{source} checkpoint does not fit {cfg}:\n  " + "\n  ".join(problems))
        return self.tensors

    def _missing(self, key: str, shape: tuple[int, ...]) -> str:
        """The checkpoint keys that our `key` needs and the checkpoint lacks, named as the same key of another
        block is, with the block's number changed; our own name where no other block has it."""
        theirs = [self._their_names(part) for part in self.missing_parts.get(key, [key])]
        if None in theirs:
            return f"missing: {key} {list(shape)}"
        return f"missing: {', '.join(name for names in theirs for name in names)} (for {key} {list(shape)})"

    def _their_names(self, key: str) -> list[str] | None:
        match = re.fullmatch(r"(.*?\.)(\d+)(\..*)", key)
        if match:
            head, number, tail = match.groups()
            for other, names in self.origin.items():
                sibling = re.fullmatch(re.escape(head) + r"(\d+)" + re.escape(tail), other)
                if sibling and sibling.group(1) != number:
                    renamed = [name.replace(f".{sibling.group(1)}.", f".{number}.", 1) for name in names]
                    missing = [name for name in renamed if name not in self.checkpoint_keys]
                    if missing:
                        return missing
        return None


def build(cfg: ViTConfig, state_dict: dict[str, torch.Tensor], like: torch.Tensor) -> ViT:
    """A ViT holding copies of `state_dict`'s tensors (never sharing the source's storage), on the
    device and in the dtype of tensor `like`, in eval mode."""
    model = ViT(cfg, device=like.device, dtype=like.dtype)
    model.load_state_dict(state_dict, strict=True)
    return model.eval()
