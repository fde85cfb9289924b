"""A LoRA job's pieces for tests: the adapter section and an adapter with trained-looking
(random, B not zero) values on the tests' tiny model."""

from __future__ import annotations

import torch

from asyncrl.model.lora import with_adapter
from asyncrl.spec.job import LoraSpec
from support.tiny_model import tiny_model

LORA = LoraSpec(rank=4, alpha=8)


def trained_adapter(seed: int, base_seed: int = 1, lora: LoraSpec = LORA):
    """peft's wrapper of tiny_model(base_seed), its adapter random for `seed`."""
    wrapped = with_adapter(tiny_model(base_seed), lora, torch.float32)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in wrapped.named_parameters():
            if ".lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return wrapped
