"""Checkpoints and published weight snapshots of the trainer, in the run folder.

    <run>/checkpoints/step-000010/{config.json, model.safetensors, optimizer.pt, state.json}
    <run>/weights/v000010/{config.json, model.safetensors}     (what rollout workers load)

Both are Hugging Face model directories, so SGLang's /update_weights_from_disk, the torch
engine and `from_pretrained` load them unchanged. A snapshot is in the model's dtype
(`model.dtype`: bf16 tensors for bfloat16); a checkpoint keeps the float32 master weights and
the optimizer state keyed by parameter name. Tied weights are stored once, under the first
name (lm_head.weight is the embedding's alias), as `save_pretrained` does.

Functions take whole state dicts (under FSDP gathered by every rank, written by rank 0 only).
Both kinds are written into a hidden staging directory and renamed into place, so a reader (or
a restart after a crash) sees a complete snapshot or none.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from asyncrl.model.policy import tied_aliases


@dataclass(frozen=True)
class TrainerState:
    step: int
    version: int


@dataclass(frozen=True)
class Checkpoint:
    model: dict[str, torch.Tensor]
    optimizer: dict
    state: TrainerState


def _atomic_dir(target: Path, write) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        write(staging)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _write_model(directory: Path, model: torch.nn.Module, state: dict[str, torch.Tensor],
                 dtype: torch.dtype) -> None:
    """config.json (saying `dtype`) and model.safetensors: a Hugging Face model directory."""
    config = copy.deepcopy(model.config)
    config.dtype = dtype
    config.save_pretrained(directory)
    aliases = tied_aliases(model)
    tensors = {name: tensor.detach().to(device="cpu", dtype=dtype).contiguous()
               for name, tensor in state.items() if name not in aliases}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _read_model(directory: Path, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """model.safetensors with every alias of a tied weight filled in (files written by
    safetensors' save_model may hold either name)."""
    state = load_file(str(directory / "model.safetensors"))
    for alias, name in tied_aliases(model).items():
        if alias in state and name not in state:
            state[name] = state[alias]
        elif name in state:
            state[alias] = state[name]
    return state


def publish_weights(
    model: torch.nn.Module, state: dict[str, torch.Tensor], run_dir: Path, version: int,
    dtype: torch.dtype, keep: int = 3,
) -> Path:
    """Writes the policy of `version` (the whole `state` of `model`, cast to `dtype`) for
    rollout workers; returns its directory. Keeps the newest `keep` snapshots (a worker may
    still be loading the previous one)."""
    root = run_dir / "weights"
    target = _atomic_dir(root / f"v{version:06d}",
                         lambda d: _write_model(d, model, state, dtype))
    for old in sorted(root.glob("v*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def save_checkpoint(
    model: torch.nn.Module, model_state: dict[str, torch.Tensor], optimizer_state: dict,
    run_dir: Path, state: TrainerState, keep: int = 2,
) -> Path:
    """Writes a checkpoint of the float32 master weights, the optimizer state (keyed by
    parameter name) and the step/version; keeps the newest `keep`."""
    def write(directory: Path) -> None:
        _write_model(directory, model, model_state, torch.float32)
        torch.save(optimizer_state, directory / "optimizer.pt")
        (directory / "state.json").write_text(json.dumps(asdict(state)))

    root = run_dir / "checkpoints"
    target = _atomic_dir(root / f"step-{state.step:06d}", write)
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint's directory, if there is one."""
    candidates = sorted((run_dir / "checkpoints").glob("step-*"))
    return candidates[-1] if candidates else None


def read_checkpoint(directory: Path, model: torch.nn.Module) -> Checkpoint:
    """A checkpoint's whole state dicts (for asyncrl.trainer.distributed.load_full_state)."""
    return Checkpoint(
        model=_read_model(directory, model),
        optimizer=torch.load(directory / "optimizer.pt", weights_only=True),
        state=TrainerState(**json.loads((directory / "state.json").read_text())),
    )
