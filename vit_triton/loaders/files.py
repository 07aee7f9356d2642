"""Finding a checkpoint's files (a local directory or file, or a HuggingFace hub id through
huggingface_hub and its cache) and reading its weights: safetensors or a pickled state dict,
sharded (an *.index.json naming the shards) or not. Nothing here knows what the keys mean.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

# In the order they are looked for: safetensors first (no pickle, memory-mapped).
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
# OpenCLIP's layout, tried where transformers' or timm's is absent.
OPEN_CLIP_CONFIG, OPEN_CLIP_WEIGHT_FILES = "open_clip_config.json", ("open_clip_model.safetensors",
                                                                     "open_clip_pytorch_model.bin")
LAYOUTS = (("config.json", WEIGHT_FILES), (OPEN_CLIP_CONFIG, OPEN_CLIP_WEIGHT_FILES))
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt")


class CheckpointNotFound(FileNotFoundError):
    """No checkpoint at that path or hub id (the message says where it was looked for)."""


@dataclass(frozen=True)
class CheckpointFiles:
    source: str                      # what the user named
    config: Path                     # config.json, or open_clip_config.json
    weights: tuple[Path, ...]        # one file, or the shards of an index
    preprocessor: Path | None        # preprocessor_config.json (transformers), if there is one


def find_checkpoint(name_or_path: str | os.PathLike) -> CheckpointFiles:
    """A local directory (config.json + weights, or OpenCLIP's open_clip_config.json + its weights), a local
    weights file (its config beside it), or a hub id ("google/vit-base-patch16-224",
    "timm/vit_base_patch16_224.augreg_in1k", optionally
    prefixed "hf-hub:"), downloaded into the HuggingFace cache or read from it."""
    source = str(name_or_path)
    path = Path(source).expanduser()
    if path.is_dir():
        return _local(source, path, *_first_present(path, source))
    if path.is_file():
        if not path.name.endswith(WEIGHT_SUFFIXES + (".index.json",)):
            raise CheckpointNotFound(f"{source} is a file but not a weights file (expected one ending in "
                                     f"{', '.join(WEIGHT_SUFFIXES)} or .index.json)")
        config = OPEN_CLIP_CONFIG if path.name.startswith("open_clip_") else "config.json"
        return _local(source, path.parent, config, path)
    if source.startswith((".", "/", "~")) or source.count("/") > 1:
        raise CheckpointNotFound(f"no such file or directory: {source}")
    return _hub(source.removeprefix("hf-hub:"))


def _first_present(directory: Path, source: str) -> tuple[str, Path]:
    """(the config's name, the weights) of the first layout whose weights the directory holds."""
    for config, weights in LAYOUTS:
        for name in weights:
            if (directory / name).is_file():
                return config, directory / name
    names = [name for _, weights in LAYOUTS for name in weights]
    raise CheckpointNotFound(f"{source}: no weights in the directory; expected one of {', '.join(names)}")


def _local(source: str, directory: Path, config_name: str, weights: Path) -> CheckpointFiles:
    config = directory / config_name
    if not config.is_file():
        raise CheckpointNotFound(f"{source}: no {config_name} in {directory}")
    shards = tuple(directory / name for name in _shard_names(weights)) if weights.name.endswith(".index.json") \
        else (weights,)
    missing = [str(s) for s in shards if not s.is_file()]
    if missing:
        raise CheckpointNotFound(f"{source}: shards named in {weights.name} are missing: {', '.join(missing)}")
    preprocessor = directory / "preprocessor_config.json"
    return CheckpointFiles(source, config, shards, preprocessor if preprocessor.is_file() else None)


def _shard_names(index: Path) -> list[str]:
    weight_map = json.loads(index.read_text())["weight_map"]
    return sorted(set(weight_map.values()))


def _hub(repo_id: str) -> CheckpointFiles:
    try:
        from huggingface_hub import hf_hub_download
        from huggingface_hub.errors import EntryNotFoundError, HFValidationError, LocalEntryNotFoundError, \
            RepositoryNotFoundError
    except ImportError:
        raise CheckpointNotFound(f"{repo_id} is not a local directory or file, and reading hub ids needs "
                                 f"huggingface_hub (pip install huggingface_hub)") from None

    unreachable = _hub_unreachable()

    def download(filename: str) -> Path | None:
        """The cached file, or None if the repository has no such file."""
        try:
            return Path(hf_hub_download(repo_id, filename, local_files_only=unreachable is not None))
        except RepositoryNotFoundError:
            raise CheckpointNotFound(f"{repo_id}: not a local directory or file, and no such model on the "
                                     f"HuggingFace hub (or it is private or gated: log in with `hf auth login`)"
                                     ) from None
        except HFValidationError:
            raise CheckpointNotFound(f"{repo_id}: not a local directory or file, and not a valid hub id") from None
        except LocalEntryNotFoundError:
            # Offline (HF_HUB_OFFLINE=1 or no network) and not in the cache: the file may or may not exist.
            if filename == "config.json":
                raise CheckpointNotFound(
                    f"{repo_id}: no such local directory or file, not in the HuggingFace cache "
                    f"({_cache_dir()}), and the hub cannot be reached to look it up as a hub id"
                    + (f" ({unreachable})" if unreachable else "")) from None
            return None
        except EntryNotFoundError:
            return None

    for config_name, weight_files in LAYOUTS:
        config = download(config_name)
        weights = next((w for w in map(download, weight_files) if w is not None), None) if config else None
        if weights is not None:
            break
    else:
        raise CheckpointNotFound(f"{repo_id}: the repository (or the cache, offline) has no config.json with one of "
                                 f"{', '.join(WEIGHT_FILES)}, nor {OPEN_CLIP_CONFIG} with one of "
                                 f"{', '.join(OPEN_CLIP_WEIGHT_FILES)}")
    if weights.name.endswith(".index.json"):
        shards = tuple(download(name) for name in _shard_names(weights))
        if None in shards:
            raise CheckpointNotFound(f"{repo_id}: shards named in {weights.name} could not be downloaded")
    else:
        shards = (weights,)
    return CheckpointFiles(repo_id, config, shards, download("preprocessor_config.json"))


def _hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the hub's host cannot be reached, or None if it can (or through a proxy, which is not tried):
    huggingface_hub retries an unreachable host for about 25 s before it gives up."""
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlsplit(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)), timeout).close()
    except OSError as e:
        return f"{url.hostname}: {e.strerror or e}"
    return None


def _cache_dir() -> str:
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {path}: {e}") from None


def read_weights(files: tuple[Path, ...]) -> dict[str, torch.Tensor]:
    """All tensors of the weight file(s), on the CPU, in the checkpoint's dtype. A file that cannot be read
    raises ValueError naming it and what is wrong, in one line."""
    state_dict: dict[str, torch.Tensor] = {}
    for path in files:
        part = _read_safetensors(path) if path.suffix == ".safetensors" else _read_pickled(path)
        if not isinstance(part, dict):
            raise ValueError(f"{path} does not hold a state dict (found {type(part).__name__})")
        state_dict.update(part)
    return state_dict


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(path, device="cpu")
    except SafetensorError as e:
        raise ValueError(f"{path} is not a readable safetensors file, truncated or corrupt? ({_first_line(e)})") from None


def _read_pickled(path: Path):
    # torch.save has written zip archives since PyTorch 1.6, and only those load memory-mapped; torch.load's own
    # message for anything else is about a serialization flag, which says nothing of a damaged file.
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{path} is not a PyTorch checkpoint: not the zip archive torch.save writes "
                         f"(truncated or corrupt?)")
    try:
        part = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (RuntimeError, pickle.UnpicklingError, zipfile.BadZipFile, EOFError, ValueError) as e:
        raise ValueError(f"{path} is not a readable PyTorch checkpoint ({_first_line(e)})") from None
    for wrapper in ("state_dict", "model"):  # training checkpoints nest the weights
        if isinstance(part, dict) and isinstance(part.get(wrapper), dict):
            part = part[wrapper]
    return part


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
