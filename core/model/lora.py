"""LoRA adapters (`model.lora`) through the `peft` library, on both sides of a job.

The trainer wraps its model with peft (`with_adapter`): the base weights are frozen in the
compute dtype, the adapter's are float32 and the only ones the optimizer holds. A version of
the policy is the adapter's state dict in peft's own names (what `PeftModel.save_pretrained`
writes, so every path that carries a version carries these tensors only):

    base_model.model.<module>.lora_A.weight   [rank, in]
    base_model.model.<module>.lora_B.weight   [out, rank]

An engine serves a plain model whose adapted weights it rewrites at each version
(`MergedAdapter`): weight = base + (alpha / rank) * B @ A, computed in float32 from a copy of
the base kept at start, never from the previous version's merged weight, so the rounding of a
merge does not build up over hundreds of versions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
from peft import set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from torch import Tensor

from asyncrl.model.policy import model_skeleton

#: The tensors of a saved adapter directory (with ADAPTER_CONFIG), as peft writes it.
ADAPTER_FILE = "adapter_model.safetensors"
#: The adapter's rank, alpha and targets in a saved adapter directory (what SGLang reads).
ADAPTER_CONFIG = "adapter_config.json"
#: peft's prefix of every adapter tensor's name in a saved adapter.
PREFIX = "base_model.model."
_PARTS = {".lora_A.weight": "A", ".lora_B.weight": "B"}


class AdapterError(ValueError):
    """Adapter tensors that do not fit the model's adapter; the message says which."""


def lora_config(lora) -> LoraConfig:
    """peft's LoraConfig for the spec's `model.lora` section."""
    return LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                      target_modules=list(lora.target_modules), bias="none",
                      task_type="CAUSAL_LM")


def scale(lora) -> float:
    return lora.alpha / lora.rank


def with_adapter(model: torch.nn.Module, lora, base_dtype: torch.dtype) -> PeftModel:
    """`model` (changed in place: its targeted layers gain an adapter) wrapped by peft, its
    base weights frozen in `base_dtype`, the adapter's trainable in float32. Raises
    AdapterError when no layer matches model.lora.targetModules."""
    model.to(base_dtype)
    try:
        # peft draws A from the global generator (on the CPU, then moves it): seeded here, so
        # that data-parallel ranks start from one adapter without exchanging it.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(lora.seed)
            wrapped = get_peft_model(model, lora_config(lora))
    except ValueError as exc:  # peft: "Target modules ... not found in the base model"
        raise AdapterError(f"model.lora.targetModules {list(lora.target_modules)}: {exc}") from exc
    for name, parameter in wrapped.named_parameters():
        if ".lora_" in name:
            parameter.data = parameter.data.float()
    return wrapped


def trained_model(wrapped: PeftModel) -> torch.nn.Module:
    """The transformers model inside peft's wrapper, its layers adapted: what the trainer
    computes with (its class, config and submodules are the base model's)."""
    return wrapped.base_model.model


def adapter_state(wrapped: PeftModel) -> dict[str, Tensor]:
    """The adapter's tensors under peft's saved names (detached, on their device)."""
    return {name: tensor.detach() for name, tensor in get_peft_model_state_dict(wrapped).items()}


def load_adapter_state(wrapped: PeftModel, state: dict[str, Tensor]) -> None:
    """Puts saved adapter tensors (peft's names) into `wrapped`; every one must be there."""
    expected = {name: tuple(t.shape) for name, t in adapter_state(wrapped).items()}
    check_adapter(state, expected, "adapter checkpoint", complete=True)
    result = set_peft_model_state_dict(wrapped, state)
    if result.unexpected_keys:
        raise AdapterError(f"adapter checkpoint: tensors peft did not load: "
                           f"{result.unexpected_keys[:3]}")


def write_adapter(directory: Path, state: dict[str, Tensor], lora, base_model: str = "") -> None:
    """A peft adapter directory (adapter_config.json, adapter_model.safetensors in float32):
    `PeftModel.from_pretrained(base, directory)` loads it, and SGLang's adapter API."""
    config = lora_config(lora)
    config.base_model_name_or_path = base_model or None
    config.save_pretrained(str(directory))
    tensors = {name: t.detach().to(device="cpu", dtype=torch.float32).contiguous()
               for name, t in state.items()}
    save_file(tensors, str(Path(directory) / ADAPTER_FILE), metadata={"format": "pt"})


def is_adapter_directory(directory: Path) -> bool:
    return (Path(directory) / ADAPTER_FILE).is_file()


def read_adapter(directory: Path) -> dict[str, Tensor]:
    return load_file(str(Path(directory) / ADAPTER_FILE))


@contextlib.contextmanager
def adapter_dropout(model: torch.nn.Module, active: bool) -> Iterator[None]:
    """The adapter's dropout on (`active`) for the passes inside, whatever the model's mode:
    the trainer runs its model in eval mode, and drops the adapter's inputs only in the
    passes that take gradients."""
    dropouts = [m for name, m in model.named_modules()
                if ".lora_dropout." in name and isinstance(m, torch.nn.Dropout)]
    if not active or not dropouts:
        yield
        return
    for module in dropouts:
        module.train()
    try:
        yield
    finally:
        for module in dropouts:
            module.eval()


def adapter_shapes(config, lora) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the adapter peft makes for a model of `config` (on the meta device:
    no memory): what an engine accepts, and the manifest of transfers that carry it."""
    wrapped = get_peft_model(model_skeleton(config), lora_config(lora))
    return {name: tuple(t.shape) for name, t in get_peft_model_state_dict(wrapped).items()}


def adapted_weight(name: str) -> tuple[str, str]:
    """(the base model's weight, "A" or "B") of an adapter tensor's saved name."""
    for suffix, part in _PARTS.items():
        if name.startswith(PREFIX) and name.endswith(suffix):
            return name[len(PREFIX):-len(suffix)] + ".weight", part
    raise AdapterError(f"{name!r} is not a LoRA adapter tensor "
                       f"({PREFIX}<module>.lora_A.weight or .lora_B.weight)")


def is_adapter_state(state: dict[str, Tensor]) -> bool:
    return bool(state) and all(name.startswith(PREFIX) and ".lora_" in name for name in state)


def check_adapter(state: dict[str, Tensor], expected: dict[str, tuple[int, ...]], what: str,
                  *, complete: bool) -> dict[str, Tensor]:
    """`state` against the adapter's names and shapes (`complete`: every tensor present);
    raises AdapterError naming the first that does not fit."""
    unknown = sorted(set(state) - set(expected))
    if unknown:
        raise AdapterError(f"{what} has tensors this model's adapter does not: {unknown[:3]} "
                           f"(model.lora: rank and targetModules must be the trainer's)")
    if complete and (missing := sorted(set(expected) - set(state))):
        raise AdapterError(f"{what} is missing adapter tensor {missing[0]!r}")
    for name, tensor in state.items():
        if tuple(tensor.shape) != expected[name]:
            raise AdapterError(f"{what}: adapter tensor {name!r} has shape "
                               f"{tuple(tensor.shape)}, the model's adapter {expected[name]} "
                               "(model.lora.rank must be the trainer's)")
    return state


class MergedAdapter:
    """An engine's side of an adapter: the adapted weights of a plain model, rewritten from a
    kept copy of the base at each version. Starts as the base (B = 0, as peft initialises)."""

    def __init__(self, model: torch.nn.Module, lora):
        self.scale = scale(lora)
        self.shapes = adapter_shapes(model.config, lora)
        parameters = dict(model.named_parameters())
        self.base: dict[str, Tensor] = {}
        self.current: dict[str, Tensor] = {}  # the adapter tensors of the version served
        for name, shape in self.shapes.items():
            weight, _ = adapted_weight(name)
            if weight not in parameters:
                raise AdapterError(f"the adapter adapts {weight!r}, which the model lacks")
            if weight not in self.base:
                self.base[weight] = parameters[weight].detach().clone()
            self.current[name] = torch.zeros(shape, dtype=torch.float32,
                                             device=parameters[weight].device)

    @property
    def bytes_per_version(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.current.values())

    def check(self, state: dict[str, Tensor], what: str, *, complete: bool = True
              ) -> dict[str, Tensor]:
        return check_adapter(state, self.shapes, what, complete=complete)

    def write(self, weights: dict[str, Tensor], state: dict[str, Tensor]) -> None:
        """Takes the adapter tensors in `state` (all of them, or a part of a transfer) and
        rewrites the model's weights (`weights`: its state dict) that they adapt."""
        touched = set()
        for name, tensor in state.items():
            self.current[name].copy_(tensor)
            touched.add(adapted_weight(name)[0])
        with torch.no_grad():
            for weight in touched:
                a = self.current[f"{PREFIX}{weight[:-len('.weight')]}.lora_A.weight"]
                b = self.current[f"{PREFIX}{weight[:-len('.weight')]}.lora_B.weight"]
                target = weights[weight]
                if target.dtype == torch.float32 and target.is_contiguous():
                    # Straight into the weight: no float32 copy of the base per version.
                    torch.addmm(self.base[weight], b, a, alpha=self.scale, out=target)
                else:
                    target.copy_(torch.addmm(self.base[weight].float(), b, a, alpha=self.scale))
