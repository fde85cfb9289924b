"""`asyncrl export`: a checkpoint of a run as a Hugging Face model directory that
`transformers`, vLLM and SGLang load as it is: weights, config.json, the tokenizer's files
(with its chat template) and generation_config.json.

A full fine-tuning checkpoint is written in `model.dtype`. A LoRA checkpoint (model.lora) is
written as its peft adapter directory plus the tokenizer, or with `merge` as the base model
with the adapter merged into its weights: a plain model that needs neither peft nor the base.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import GenerationConfig

from asyncrl.model.lora import (
    ADAPTER_FILE,
    is_adapter_directory,
    load_adapter_state,
    read_adapter,
    with_adapter,
)
from asyncrl.model.policy import load_policy, load_tokenizer
from asyncrl.trainer.checkpoints import latest_checkpoint
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


def export(checkpoint: Path, model_spec, out: Path, *, merge: bool = False) -> str:
    """Writes `checkpoint` (of a job whose model section is `model_spec`) to `out`; returns
    what was written, in words."""
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty: choose a new folder")
    adapter = is_adapter_directory(checkpoint)
    if merge and not adapter:
        raise ExportError("--merge merges a LoRA adapter, and this checkpoint holds the whole "
                          "model: export it without --merge")
    tokenizer = load_tokenizer(model_spec.source)
    dtype = getattr(torch, model_spec.dtype)
    out.mkdir(parents=True, exist_ok=True)
    if adapter and not merge:
        shutil.copy2(checkpoint / "adapter_config.json", out / "adapter_config.json")
        shutil.copy2(checkpoint / ADAPTER_FILE, out / ADAPTER_FILE)
        tokenizer.save_pretrained(out)
        return "the LoRA adapter (a peft directory: load it onto the base model) and the tokenizer"
    model, _ = load_policy(model_spec, dtype="float32")
    if adapter:
        wrapped = with_adapter(model, model_spec.lora, torch.float32)
        load_adapter_state(wrapped, read_adapter(checkpoint))
        model = wrapped.merge_and_unload()
    else:
        model.load_state_dict(read_state_dict(checkpoint, model))
    model = model.to(dtype)
    model.generation_config = _generation_config(model, tokenizer)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return ("the base model with the LoRA adapter merged" if adapter else "the model") + \
        f" in {model_spec.dtype}, its tokenizer and generation config"


def _generation_config(model, tokenizer) -> GenerationConfig:
    """The model's own generation config where it has one, with the tokenizer's end token."""
    config = model.generation_config or GenerationConfig()
    if config.eos_token_id is None and tokenizer.eos_token_id is not None:
        config.eos_token_id = tokenizer.eos_token_id
    if config.bos_token_id is None and tokenizer.bos_token_id is not None:
        config.bos_token_id = tokenizer.bos_token_id
    return config
