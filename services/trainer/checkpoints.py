"""Checkpoints and published weight snapshots of the trainer, in the run folder.

    <run>/checkpoints/step-000010/{model.safetensors, optimizer.pt, state.json}
    <run>/weights/v000010/model.safetensors      (what rollout workers load)

Both are written into a hidden staging directory and renamed into place, so a reader (or a
restart after a crash) sees a complete snapshot or none.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model


@dataclass(frozen=True)
class TrainerState:
    step: int
    version: int


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


def publish_weights(model: torch.nn.Module, run_dir: Path, version: int, keep: int = 3) -> Path:
    """Writes the policy of `version` for rollout workers; returns its directory. Keeps the
    newest `keep` snapshots (a worker may still be loading the previous one)."""
    root = run_dir / "weights"
    target = _atomic_dir(root / f"v{version:06d}", lambda d: save_model(model, str(d / "model.safetensors")))
    for old in sorted(root.glob("v*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def save_checkpoint(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, run_dir: Path, state: TrainerState,
    keep: int = 2,
) -> Path:
    def write(directory: Path) -> None:
        save_model(model, str(directory / "model.safetensors"))
        torch.save(optimizer.state_dict(), directory / "optimizer.pt")
        (directory / "state.json").write_text(json.dumps(asdict(state)))

    root = run_dir / "checkpoints"
    target = _atomic_dir(root / f"step-{state.step:06d}", write)
    for old in sorted(root.glob("step-*"))[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def load_latest_checkpoint(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, run_dir: Path
) -> TrainerState | None:
    """Restores the newest complete checkpoint into model and optimizer, if there is one."""
    candidates = sorted((run_dir / "checkpoints").glob("step-*"))
    if not candidates:
        return None
    latest = candidates[-1]
    load_model(model, str(latest / "model.safetensors"))
    optimizer.load_state_dict(torch.load(latest / "optimizer.pt", weights_only=True))
    return TrainerState(**json.loads((latest / "state.json").read_text()))
