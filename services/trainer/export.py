"""`asyncrl export`: a checkpoint of a run as a Hugging Face model directory that
`transformers`, vLLM and SGLang load as it is: weights, config.json, the tokenizer's files
(with its chat template), generation_config.json and a model card naming the job and step
(asyncrl.trainer.model_files, which the checkpoints share).

A full fine-tuning checkpoint is written in `model.dtype`. A LoRA checkpoint (model.lora) is
written as its peft adapter directory plus the tokenizer, or with `merge` as the base model
with the adapter merged into its weights: a plain model that needs neither peft nor the base.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from asyncrl.model.lora import (
    ADAPTER_FILE,
    is_adapter_directory,
    load_adapter_state,
    read_adapter,
    with_adapter,
)
from asyncrl.model.policy import load_policy, load_tokenizer
from asyncrl.trainer.checkpoints import latest_checkpoint
from asyncrl.trainer.model_files import ModelFiles
from asyncrl.weights.disk import read_state_dict


class ExportError(ValueError):
    """What cannot be exported, and what to do instead."""


def checkpoint_of(run_dir: Path, step: int | None) -> Path:
    """The run's checkpoint of `step` (None: the newest)."""
    if step is None:
        found = latest_checkpoint(run_dir)
        if found is None:
            raise ExportError(f"{run_dir} has no checkpoints/step-* yet: a run writes one every "
                              "trainer.checkpointEvery steps and at its last step")
        return found
    found = run_dir / "checkpoints" / f"step-{step:06d}"
    if not found.is_dir():
        kept = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*"))
        raise ExportError(f"{run_dir} has no checkpoint of step {step}; it keeps {kept or 'none'}")
    return found


def export(checkpoint: Path, job, out: Path, *, merge: bool = False) -> str:
    """Writes `checkpoint` (of `job`, an RLJob) to `out`; returns what was written, in
    words."""
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty: choose a new folder")
    model_spec = job.spec.model
    adapter = is_adapter_directory(checkpoint)
    if merge and not adapter:
        raise ExportError("--merge merges a LoRA adapter, and this checkpoint holds the whole "
                          "model: export it without --merge")
    step = json.loads((checkpoint / "state.json").read_text())["step"]
    tokenizer = load_tokenizer(model_spec.source, model_spec.revision)
    dtype = getattr(torch, model_spec.dtype)
    out.mkdir(parents=True, exist_ok=True)
    if adapter and not merge:
        shutil.copy2(checkpoint / "adapter_config.json", out / "adapter_config.json")
        shutil.copy2(checkpoint / ADAPTER_FILE, out / ADAPTER_FILE)
        # The generation config is the base model's: none is written beside an adapter.
        ModelFiles(tokenizer, None, job.metadata.name, model_spec.source).write(
            out, step=step, adapter=True)
        return "the LoRA adapter (a peft directory: load it onto the base model) and the tokenizer"
    model, _ = load_policy(model_spec, dtype="float32")
    if adapter:
        wrapped = with_adapter(model, model_spec.lora, torch.float32)
        load_adapter_state(wrapped, read_adapter(checkpoint))
        model = wrapped.merge_and_unload()
    else:
        model.load_state_dict(read_state_dict(checkpoint, model))
    model = model.to(dtype)
    files = ModelFiles.of(job, model, tokenizer)
    model.generation_config = files.generation
    model.save_pretrained(out)
    files.write(out, step=step, adapter=False, merged=adapter)
    return ("the base model with the LoRA adapter merged" if adapter else "the model") + \
        f" in {model_spec.dtype}, its tokenizer and generation config"
