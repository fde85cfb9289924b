"""What a model directory holds besides its weights and config.json so that `transformers`,
vLLM and SGLang load it as it is: the tokenizer's files (with its chat template),
generation_config.json, and a model card (README.md) saying which job and step made it.
The one owner of these files for the trainer's checkpoints and for `asyncrl export`.

A LoRA directory (peft's adapter files) gets the tokenizer and the card beside the adapter;
its generation config is the base model's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import GenerationConfig

from asyncrl.model.hub import hub_model
from asyncrl.model.policy import SMOLLM2

#: The Hub model the builtin SmolLM2 is (converted from its GGUF release).
_BUILTIN_HUB_IDS = {SMOLLM2: "HuggingFaceTB/SmolLM2-135M-Instruct"}
README = "README.md"


@dataclass(frozen=True)
class ModelFiles:
    """The files of one job's model directories: `tokenizer` and `generation` (the
    generation config) are saved as they are; `job` and `source` (its model.source) go into
    each card with the step of the directory."""

    tokenizer: object
    generation: GenerationConfig | None  # None: an adapter's (the base model's)
    job: str
    source: str

    @classmethod
    def of(cls, job, model, tokenizer) -> ModelFiles:
        """For `job` (an RLJob) whose model (a transformers model) and tokenizer are these."""
        return cls(tokenizer, generation_config(model, tokenizer), job.metadata.name,
                   job.spec.model.source)

    def write(self, directory: Path, *, step: int, adapter: bool, merged: bool = False) -> None:
        """Into `directory`, which holds the weights of `step` (a peft adapter with
        `adapter`; the base with the adapter merged with `merged`)."""
        directory = Path(directory)
        self.tokenizer.save_pretrained(directory)
        if not adapter:
            self.generation.save_pretrained(directory)
        (directory / README).write_text(
            model_card(self.job, self.source, step, adapter=adapter, merged=merged))


def generation_config(model, tokenizer) -> GenerationConfig:
    """The model's own generation config where it has one, with the tokenizer's end token."""
    config = GenerationConfig.from_dict(model.generation_config.to_dict()) \
        if model.generation_config is not None else GenerationConfig()
    if config.eos_token_id is None and tokenizer.eos_token_id is not None:
        config.eos_token_id = tokenizer.eos_token_id
    if config.bos_token_id is None and tokenizer.bos_token_id is not None:
        config.bos_token_id = tokenizer.bos_token_id
    return config


def model_card(job: str, source: str, step: int, *, adapter: bool, merged: bool = False) -> str:
    """README.md: the Hub's YAML header (base model, library, tags) and what made the model."""
    base = hub_id(source)
    header = [f"base_model: {json.dumps(base)}"] if base else []
    header += [f"library_name: {'peft' if adapter else 'transformers'}",
               "tags:", "- asyncrl", "- reinforcement-learning"]
    kind = ("a LoRA adapter (peft) of the base model" if adapter
            else "the base model with a LoRA adapter merged" if merged else "the whole model")
    load = ("`PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder)`"
            if adapter
            else "`AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`")
    return "\n".join([
        "---", *header, "---", "",
        f"# {job}, step {step}", "",
        f"Trained with reinforcement learning by asyncrl: the RLJob `{job}` (model.source "
        f"`{source}`) at training step {step}.", "",
        f"This folder holds {kind}, its tokenizer (with the chat template)"
        f"{'' if adapter else ' and generation config'}; {load} load it.", "",
    ])


def hub_id(source: str) -> str | None:
    """The Hub id a card names as its base model: the builtin's, or the Hub model `source`
    names on this machine (asyncrl.model.hub.hub_model); None for the tiny random model and
    local folders."""
    return _BUILTIN_HUB_IDS.get(source) or hub_model(source)
