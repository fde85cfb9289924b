"""Checkpoints and published weight snapshots of the trainer, in the run folder.

    <run>/checkpoints/step-000010/{config.json, model.safetensors, optimizer.pt, state.json,
                                   generation_config.json, tokenizer files, README.md}
    <run>/weights/v000010/{config.json, model.safetensors}     (what rollout workers load)

With model.lora both hold the adapter instead, as a peft adapter directory
(adapter_config.json, adapter_model.safetensors: asyncrl.model.lora's format), which
`peft.PeftModel.from_pretrained(base, directory)` loads:

    <run>/checkpoints/step-000010/{adapter_config.json, adapter_model.safetensors,
                                   optimizer.pt, state.json, tokenizer files, README.md}
    <run>/weights/v000010/{adapter_config.json, adapter_model.safetensors}

Without it both hold the model as a snapshot in asyncrl.weights.disk's format (a Hugging Face model
directory, tied weights once; that module owns it, for the engines that read it too): this
module owns where they go in the run folder and how many are kept. A published snapshot is in
the model's dtype (`model.dtype`: bf16 tensors for bfloat16); a checkpoint keeps the float32
master weights and the optimizer state keyed by parameter name; with the files
asyncrl.trainer.model_files adds (tokenizer, generation config, model card) it is a model
directory that transformers, vLLM and SGLang load as it is.

Functions take whole state dicts (under FSDP gathered by every rank, written by rank 0 only).
Both kinds are written into a hidden staging directory and renamed into place, so a reader (or
a restart after a crash) sees a complete snapshot or none.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from asyncrl.model.lora import is_adapter_directory, read_adapter, write_adapter
from asyncrl.trainer.model_files import ModelFiles
from asyncrl.weights.disk import read_state_dict, write_snapshot


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


def publish_weights(
    model: torch.nn.Module, state: dict[str, torch.Tensor], run_dir: Path, version: int,
    dtype: torch.dtype, keep: int = 3, lora=None,
) -> Path:
    """Writes the policy of `version` (the whole `state` of `model`, cast to `dtype`; with
    `lora`, the model.lora section, the adapter's state) for rollout workers; returns its
    directory. Keeps the newest `keep` snapshots (a worker may still be loading the previous
    one)."""
    root = run_dir / "weights"
    target = _atomic_dir(root / f"v{version:06d}",
                         lambda d: _write_policy(d, model, state, dtype, lora))
    for old in sorted(root.glob("v*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def save_checkpoint(
    model: torch.nn.Module, model_state: dict[str, torch.Tensor], optimizer_state: dict,
    run_dir: Path, state: TrainerState, keep: int = 2, lora=None,
    files: ModelFiles | None = None,
) -> Path:
    """Writes a checkpoint of the float32 master weights (with `lora`, the model.lora
    section: the adapter's), the optimizer state (keyed by parameter name) and the
    step/version, with `files` (tokenizer, generation config, card) where given; keeps the
    newest `keep`."""
    def write(directory: Path) -> None:
        _write_policy(directory, model, model_state, torch.float32, lora)
        if files is not None:
            files.write(directory, step=state.step, adapter=lora is not None)
        torch.save(optimizer_state, directory / "optimizer.pt")
        (directory / "state.json").write_text(json.dumps(asdict(state)))

    root = run_dir / "checkpoints"
    target = _atomic_dir(root / f"step-{state.step:06d}", write)
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def _write_policy(directory: Path, model: torch.nn.Module, state: dict[str, torch.Tensor],
                  dtype: torch.dtype, lora) -> None:
    if lora is not None:
        write_adapter(directory, state, lora)
    else:
        write_snapshot(directory, model, state, dtype)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint's directory, if there is one."""
    candidates = sorted((run_dir / "checkpoints").glob("step-*"))
    return candidates[-1] if candidates else None


def read_checkpoint(directory: Path, model: torch.nn.Module) -> Checkpoint:
    """A checkpoint's whole state dicts (for asyncrl.trainer.distributed.load_full_state;
    an adapter checkpoint's model is the adapter's)."""
    return Checkpoint(
        model=(read_adapter(directory) if is_adapter_directory(directory)
               else read_state_dict(directory, model)),
        optimizer=torch.load(directory / "optimizer.pt", weights_only=True),
        state=TrainerState(**json.loads((directory / "state.json").read_text())),
    )
