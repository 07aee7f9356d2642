"""What every loader shares: renaming a checkpoint's keys to ours, remembering where each tensor came from,
and checking the result against the model it must fill, in the checkpoint's own names; and the way back, our
state dict into a checkpoint's layout by the same renaming rules."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable

import torch

from ..model import ViT, ViTConfig

# Settings of training, which no checkpoint layout records.
TRAINING_FIELDS = ("drop_path_rate", "drop_rate", "pos_drop_rate")


def square(size: int | list | tuple, name: str) -> int:
    """A config's image or patch size as one side: an int, or a [height, width] pair of equal sides."""
    if isinstance(size, int):
        return size
    if len(size) == 2 and size[0] == size[1]:
        return size[0]
    raise ValueError(f"unsupported {name} {size!r}; supported: square (an int or two equal sides)")


def refuse(features: dict[str, bool], what: str) -> None:
    """ValueError naming each present feature of `features` ({description: present}): what a `what` model (e.g.
    "timm Beit") has that vit-triton does not compute."""
    found = [feature for feature, present in features.items() if present]
    if found:
        raise ValueError(f"unsupported {what} feature: {'; '.join(found)}")


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


def expand(template: str, depth: int) -> list[str]:
    """The checkpoint keys a layout template spells: {i} is each of `depth` blocks' number and each (a|b|...) group
    one of its alternatives (groups nest)."""
    start = template.find("(")
    if start < 0:
        return [template.replace("{i}", str(i)) for i in range(depth)] if "{i}" in template else [template]
    level, cuts = 0, [start]
    for end in range(start, len(template)):
        level += {"(": 1, ")": -1}.get(template[end], 0)
        if level == 1 and template[end] == "|":
            cuts.append(end)
        if level == 0:
            break
    options = [template[a + 1:b] for a, b in zip(cuts, cuts[1:] + [end])]
    return [key for option in options for key in expand(template[:start] + option + template[end + 1:], depth)]


def mlp_ratio(features: int, dim: int) -> float:
    """A ratio r with int(dim * r) == features, as the libraries size a hidden layer from it."""
    ratio = features / dim
    return ratio if int(dim * ratio) == features else (features + 0.5) / dim


def check_written(cfg: ViTConfig, read_back: ViTConfig, what: str) -> None:
    """ValueError naming every field of cfg that a layout, read back as read_back, does not keep (training
    settings aside): the model cannot be written as `what`."""
    lost = [f"{f.name} {getattr(cfg, f.name)!r} (it would read back as {getattr(read_back, f.name)!r})"
            for f in dataclasses.fields(cfg)
            if f.name not in TRAINING_FIELDS and getattr(cfg, f.name) != getattr(read_back, f.name)]
    if lost:
        raise ValueError(f"cannot write the model as {what}, which does not hold its {'; '.join(lost)}")


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


class Unmapped:
    """Our state dict on its way back into a checkpoint's layout: the inverses of Mapped's steps (split what it
    joined, join what it split), then `unmap`, the inverse of its renaming by the loader's own rules."""

    # A key bias that a layout has no place for may be left out (Mapped.zeros_like reads it back as zeros) where it is
    # zero, or where it adds q . b_k to every score of a query alike, which the softmax cancels: without rotary
    # embeddings, which rotate b_k by each key's position.
    KEY_BIAS = r"blocks\.\d+\.k\.bias"

    def __init__(self, state_dict: dict[str, torch.Tensor]) -> None:
        self.tensors = {k: v.detach() for k, v in state_dict.items()}

    def split(self, key: str, parts: dict[str, int]) -> None:
        """tensors[key] cut along dim 0 into parts of so many rows each (Mapped.concat's inverse)."""
        if key in self.tensors:
            self.tensors.update(zip(parts, self.tensors.pop(key).split(list(parts.values()))))

    def join(self, key: str, parts: list[str]) -> None:
        """tensors[key] = the parts concatenated along dim 0 (Mapped.split's inverse)."""
        if all(p in self.tensors for p in parts):
            self.tensors[key] = torch.cat([self.tensors.pop(p) for p in parts])

    def deinterleave(self, key: str, gate: str, value: str) -> None:
        """Rows 2j of tensors[key] to gate, rows 2j + 1 to value (Mapped.interleave's inverse)."""
        if key in self.tensors:
            t = self.tensors.pop(key)
            self.tensors[gate], self.tensors[value] = t[0::2], t[1::2]

    def move(self, layer: str, new_layer: str) -> None:
        for name in ("weight", "bias"):
            if f"{layer}.{name}" in self.tensors:
                self.tensors[f"{new_layer}.{name}"] = self.tensors.pop(f"{layer}.{name}")

    def reshape(self, key: str, *shape: int) -> None:
        if key in self.tensors:
            self.tensors[key] = self.tensors[key].reshape(*shape)

    def unmap(self, keys: Iterable[str], rules: list[tuple[str, str]], what: str,
              rotary: bool = False) -> dict[str, torch.Tensor]:
        """{checkpoint key: tensor} for each of `keys` (the layout's) that `rules` rename to one of ours;
        ValueError naming those of ours that no key of the layout takes (`what` names the layout; rotary: the
        model rotates q and k)."""
        mapping = rename(keys, rules)
        taken = set(mapping.values())
        left = [k for k, t in self.tensors.items() if k not in taken
                and not (re.fullmatch(self.KEY_BIAS, k) and not (rotary and t.any()))]
        if left:
            key_bias = " (the key third of qkv.bias, which must stay zero: with rotary embeddings it changes the " \
                       "scores)" if any(re.fullmatch(self.KEY_BIAS, k) for k in left) else ""
            raise ValueError(f"cannot write the model as {what}, which has no place for {', '.join(left)}{key_bias}")
        return {theirs: self.tensors[ours] for theirs, ours in mapping.items() if ours in self.tensors}


def build(cfg: ViTConfig, state_dict: dict[str, torch.Tensor], like: torch.Tensor) -> ViT:
    """A ViT holding copies of `state_dict`'s tensors (never sharing the source's storage), on the
    device and in the dtype of tensor `like`, in eval mode."""
    model = ViT(cfg, device=like.device, dtype=like.dtype)
    model.load_state_dict(state_dict, strict=True)
    return model.eval()
