"""The update with a LoRA adapter (model.lora): only the adapter moves, its optimizer holds
the adapter only, and the KL reference is the base with the adapter off."""

import pytest
import torch

from asyncrl.model.lora import adapter_state, trained_model, with_adapter
from asyncrl.spec.job import RLJobSpec
from asyncrl.trainer.step import PolicyUpdater, UpdateConfig, reference_policy
from support.trainer import make_samples, tiny_model

LORA = {"rank": 4, "alpha": 8}


def adapted():
    spec = RLJobSpec.model_validate({"model": {"source": "tiny-random", "lora": LORA},
                                     "algorithm": {"kl": {"coef": 0.5}}})
    wrapped = with_adapter(tiny_model(), spec.model.lora, torch.float32)
    return spec, wrapped, trained_model(wrapped)


def test_only_the_adapter_moves_and_the_optimizer_holds_only_it():
    spec, wrapped, model = adapted()
    updater = PolicyUpdater.from_spec(spec, model, reference_policy(spec),
                                      reference_off=wrapped.disable_adapter)
    held = {id(p) for group in updater.optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for p in model.parameters() if p.requires_grad}
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    adapter = {n: t.clone() for n, t in adapter_state(wrapped).items()}
    for _ in range(2):  # B starts at zero: A's gradient is zero until B has moved
        stats = updater.step(make_samples(6))
    assert stats["grad_norm"] > 0
    for name, parameter in model.named_parameters():
        if name in base:
            assert torch.equal(parameter, base[name]), name
    assert all(not torch.equal(t, adapter[n]) for n, t in adapter_state(wrapped).items())


def test_the_kl_reference_is_the_base_with_the_adapter_off():
    spec, wrapped, model = adapted()
    assert reference_policy(spec) is None  # no second copy of the model
    updater = PolicyUpdater.from_spec(spec, model, None, reference_off=wrapped.disable_adapter)
    first = updater.step(make_samples(4))
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)  # B = 0: the adapted model is the base
    for _ in range(3):
        last = updater.step(make_samples(4))
    assert last["kl"] > 0
    # The adapter is on again after each reference pass.
    assert all(not layer.disable_adapters for name, layer in model.named_modules()
               if hasattr(layer, "disable_adapters") and name.endswith("q_proj"))


def test_a_kl_penalty_without_reference_or_adapter_is_refused():
    with pytest.raises(ValueError, match="reference model"):
        PolicyUpdater(tiny_model(), torch.optim.SGD(tiny_model().parameters(), lr=0.1),
                      UpdateConfig(kl_coef=0.1))
