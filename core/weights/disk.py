"""Policy weights on disk: the snapshot format, written by the trainer and read by the torch
engine (`trainer.weightTransfer: disk`, and the fallback of the distributed transfer).

A snapshot is a Hugging Face model directory, so SGLang's /update_weights_from_disk, the torch
engine and `from_pretrained` load it unchanged:

    <directory>/{config.json, model.safetensors}

`config.json` says the snapshot's dtype; tied weights are stored once, under the first name
(lm_head.weight is the embedding's alias), as `save_pretrained` does. The trainer writes its
published versions and the model of its checkpoints this way (`write_snapshot`; where they go
in the run folder is asyncrl.trainer.checkpoints'). A reader takes more than that: any layout
Hugging Face writes (`read_snapshot`), checked against the model before anything is applied
(`check_snapshot`).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from asyncrl.model.policy import tied_aliases

#: The one weights file of a snapshot the trainer writes.
SNAPSHOT_FILE = "model.safetensors"
#: A sharded checkpoint's index: its `weight_map` names each tensor's shard.
SHARD_INDEX = "model.safetensors.index.json"


class SnapshotError(ValueError):
    """A snapshot that cannot be read or does not fit the model; the message names the path
    and what is wrong with it."""


def write_snapshot(directory: Path, model: torch.nn.Module, state: dict[str, Tensor],
                   dtype: torch.dtype) -> None:
    """config.json (saying `dtype`) and model.safetensors: a Hugging Face model directory."""
    config = copy.deepcopy(model.config)
    config.dtype = dtype
    config.save_pretrained(directory)
    aliases = tied_aliases(model)
    tensors = {name: tensor.detach().to(device="cpu", dtype=dtype).contiguous()
               for name, tensor in state.items() if name not in aliases}
    save_file(tensors, str(directory / SNAPSHOT_FILE), metadata={"format": "pt"})


def read_state_dict(directory: Path, model: torch.nn.Module) -> dict[str, Tensor]:
    """model.safetensors with every alias of a tied weight filled in (files written by
    safetensors' save_model may hold either name)."""
    state = load_file(str(directory / SNAPSHOT_FILE))
    for alias, name in tied_aliases(model).items():
        if alias in state and name not in state:
            state[name] = state[alias]
        elif name in state:
            state[alias] = state[name]
    return state


def read_snapshot(path: Path, device: torch.device | str = "cpu") -> dict[str, Tensor]:
    """Reads a snapshot in any layout Hugging Face writes: one safetensors file; a
    directory with a sharded checkpoint (`model.safetensors.index.json` and the shards its
    weight_map names); a directory with `model.safetensors`; or a directory of
    `*.safetensors` files. Raises SnapshotError unless the whole snapshot reads."""
    where = f"model_path {str(path)!r}"
    if path.is_dir():
        index = path / SHARD_INDEX
        if index.is_file():
            return _read_sharded(path, index, where, device)
        if (path / SNAPSHOT_FILE).is_file():
            return _read_files([path / SNAPSHOT_FILE], where, device)
        if files := sorted(path.glob("*.safetensors")):
            return _read_files(files, where, device)
        raise SnapshotError(f"{where}: no safetensors snapshot there")
    if path.is_file():
        return _read_files([path], where, device)
    raise SnapshotError(f"{where}: no safetensors snapshot there")


def check_snapshot(state: dict[str, Tensor], expected: dict[str, Tensor],
                   what: str) -> dict[str, Tensor]:
    """`state` (`what`: a snapshot or a state dict, as named in errors) against the model's
    own state dict `expected`: every parameter must be present (tied weights may appear once)
    with its shape. Returns `state`; raises SnapshotError."""
    unknown = sorted(set(state) - set(expected))
    if unknown:
        raise SnapshotError(f"{what} has tensors this model does not: {unknown[:3]}")
    by_storage: dict[int, list[str]] = {}
    for name, tensor in expected.items():
        by_storage.setdefault(tensor.data_ptr(), []).append(name)
    for names in by_storage.values():
        if not any(n in state for n in names):
            raise SnapshotError(f"{what} is missing tensor {names[0]!r}")
    for name, tensor in state.items():
        if tensor.shape != expected[name].shape:
            raise SnapshotError(
                f"{what}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(expected[name].shape)}"
            )
    return state


def _read_sharded(directory: Path, index: Path, where: str,
                  device: torch.device | str) -> dict[str, Tensor]:
    """The shards a Hugging Face index names; every tensor of its weight_map must be in
    the shard the map says."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
        ):
            raise ValueError("weight_map must map tensor names to shard file names")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SnapshotError(f"{where}: unreadable {index.name} ({exc!r})") from exc
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        shards.setdefault(shard, []).append(name)
    root = directory.resolve()
    files = []
    for shard in shards:
        file = (directory / shard).resolve()
        if file.parent != root:
            raise SnapshotError(f"{where}: {index.name} names {shard!r}, outside the directory")
        if not file.is_file():
            raise SnapshotError(f"{where}: shard {shard!r} named by {index.name} is missing")
        files.append(file)
    state = _read_files(files, where, device)
    for shard, names in shards.items():
        absent = [n for n in names if n not in state]
        if absent:
            raise SnapshotError(
                f"{where}: shard {shard!r} lacks tensor {absent[0]!r} that {index.name} "
                "puts there"
            )
    return state


def _read_files(files: list[Path], where: str, device: torch.device | str) -> dict[str, Tensor]:
    state: dict[str, Tensor] = {}
    for file in files:
        try:
            part = load_file(file, device=str(device))
        except (SafetensorError, OSError, ValueError) as exc:
            raise SnapshotError(f"{where}: unreadable snapshot {file.name!r} ({exc})") from exc
        repeated = sorted(set(part) & set(state))
        if repeated:
            raise SnapshotError(
                f"{where}: tensor {repeated[0]!r} appears in more than one file "
                f"(again in {file.name!r})"
            )
        state.update(part)
    return state
