"""What `asyncrl eval --model` names, resolved to what the evaluation engine loads:

    base                 the job's own model.source
    RUN_DIR              a run folder's newest checkpoint (RUN_DIR@N: the checkpoint of step N)
    CHECKPOINT           a checkpoints/step-N folder (the whole model, or a LoRA adapter)
    EXPORTED             a folder `asyncrl export` wrote: a model, or a peft adapter

A checkpoint's or an adapter's tensors reach the engine as a weight update onto the job's model,
the way the trainer's evaluation gives them (so the numbers match); an exported model is loaded
as the model itself.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from asyncrl.model.lora import ADAPTER_CONFIG, is_adapter_directory, read_adapter
from asyncrl.spec.job import LoraSpec
from asyncrl.trainer.export import ExportError, checkpoint_of
from asyncrl.weights.disk import read_state_dict

OPTION = "--model"
_AT_STEP = re.compile(r"^(?P<path>.+)@(?P<step>\d+)$")


class ModelArgumentError(ValueError):
    """A --model value that names no model; the message names the value and the fix."""


@dataclass(frozen=True)
class EvalModel:
    """`label`: the value as given; `where`: what it resolved to; `model_spec`: the model
    section the engine loads; `weights`: a checkpoint or adapter folder applied onto it."""

    label: str
    where: str
    model_spec: object
    weights: Path | None = None
    step: int | None = None

    def state(self, model) -> dict | None:
        """The tensors of `weights` for `model` (an adapter's, or the whole model's)."""
        if self.weights is None:
            return None
        if is_adapter_directory(self.weights):
            return read_adapter(self.weights)
        return read_state_dict(self.weights, model)


def resolve_model(text: str, model_spec) -> EvalModel:
    """The model `text` names, for a job whose model section is `model_spec`."""
    if text == "base":
        return EvalModel(text, f"the job's model.source {model_spec.source}", model_spec)
    at = _AT_STEP.match(text)
    path = Path(at["path"] if at else text).expanduser()
    if not path.is_dir():
        raise ModelArgumentError(f"{OPTION} {text}: no such folder; give a run folder "
                                 "(RUN_DIR or RUN_DIR@STEP), a checkpoint, an exported model, "
                                 "or base")
    if at or (path / "checkpoints").is_dir():
        try:
            checkpoint = checkpoint_of(path, int(at["step"]) if at else None)
        except ExportError as exc:
            raise ModelArgumentError(f"{OPTION} {text}: {exc}") from None
        return _checkpoint(text, checkpoint, model_spec)
    if (path / "state.json").is_file():
        return _checkpoint(text, path, model_spec)
    if is_adapter_directory(path):
        return EvalModel(text, f"the LoRA adapter in {path}",
                         model_spec.model_copy(update={"lora": _lora_of(path)}), weights=path)
    if (path / "config.json").is_file():
        return EvalModel(text, f"the model in {path}",
                         model_spec.model_copy(update={"source": str(path.resolve()),
                                                       "lora": None}))
    raise ModelArgumentError(
        f"{OPTION} {text}: {path} holds no model (no config.json, adapter_model.safetensors "
        "or checkpoints/): give a run folder, a checkpoint, a folder `asyncrl export` wrote, "
        "or base")


def _checkpoint(text: str, checkpoint: Path, model_spec) -> EvalModel:
    step = json.loads((checkpoint / "state.json").read_text())["step"]
    if is_adapter_directory(checkpoint):
        model_spec = model_spec.model_copy(update={"lora": _lora_of(checkpoint)})
    elif model_spec.lora is not None:
        model_spec = model_spec.model_copy(update={"lora": None})
    return EvalModel(text, f"{checkpoint} (step {step})", model_spec, weights=checkpoint,
                     step=step)


def _lora_of(directory: Path) -> LoraSpec:
    """The model.lora section an adapter folder was written with (its peft config)."""
    config = json.loads((directory / ADAPTER_CONFIG).read_text())
    return LoraSpec(rank=config["r"], alpha=config["lora_alpha"],
                    target_modules=sorted(config["target_modules"]))
