"""LoRA adapters through peft (asyncrl.model.lora): what the trainer wraps, saves and sends,
and what an engine merges."""

import pytest
import torch
from peft import PeftModel

from asyncrl.model.lora import (
    AdapterError,
    MergedAdapter,
    adapter_dropout,
    adapter_shapes,
    adapter_state,
    check_adapter,
    load_adapter_state,
    read_adapter,
    trained_model,
    with_adapter,
    write_adapter,
)
from asyncrl.model.policy import packed_token_logprobs
from asyncrl.spec.job import LoraSpec
from support.lora import LORA, trained_adapter
from support.tiny_model import tiny_model

def logprobs(model, ids):
    with torch.no_grad():
        return packed_token_logprobs(model, ids, torch.arange(len(ids)),
                                     torch.tensor([0, len(ids)]))


def test_the_base_is_frozen_in_the_compute_dtype_and_only_the_adapter_trains():
    wrapped = with_adapter(tiny_model(1), LORA, torch.bfloat16)
    trainable = {n for n, p in wrapped.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    for name, parameter in wrapped.named_parameters():
        assert parameter.dtype == (torch.float32 if ".lora_" in name else torch.bfloat16), name
    # Every projection of attention and MLP, in each of the 2 layers: 7 x 2 x (A, B).
    assert len(trainable) == 28


def test_the_adapter_state_has_peft_names_and_the_shapes_an_engine_expects():
    wrapped = trained_adapter(seed=1)
    state = adapter_state(wrapped)
    assert {n: tuple(t.shape) for n, t in state.items()} == adapter_shapes(
        trained_model(wrapped).config, LORA)
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in state
    assert state["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (4, 64)


def test_target_modules_that_match_nothing_are_refused_naming_the_field():
    with pytest.raises(AdapterError, match="model.lora.targetModules"):
        with_adapter(tiny_model(1), LoraSpec(target_modules=["no_such_proj"]), torch.float32)


def test_a_written_adapter_loads_with_peft_and_computes_the_same_policy(tmp_path):
    wrapped = trained_adapter(seed=2, base_seed=2)
    write_adapter(tmp_path, adapter_state(wrapped), LORA)
    loaded = PeftModel.from_pretrained(tiny_model(2), str(tmp_path)).eval()
    ids = torch.randint(0, 256, (20,), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(logprobs(loaded, ids), logprobs(trained_model(wrapped), ids))
    # And the merged model, a plain transformers model, computes it too.
    merged = loaded.merge_and_unload()
    assert not any(".lora_" in name for name, _ in merged.named_parameters())
    torch.testing.assert_close(logprobs(merged, ids), logprobs(trained_model(wrapped), ids),
                               atol=1e-4, rtol=0)


def test_a_checkpointed_adapter_loads_back_exactly(tmp_path):
    source = trained_adapter(seed=3, base_seed=3)
    write_adapter(tmp_path, adapter_state(source), LORA)
    target = with_adapter(tiny_model(3), LORA, torch.float32)
    load_adapter_state(target, read_adapter(tmp_path))
    for name, tensor in adapter_state(source).items():
        assert torch.equal(adapter_state(target)[name], tensor)


def test_adapter_tensors_that_do_not_fit_are_refused_naming_them():
    shapes = adapter_shapes(tiny_model(1).config, LORA)
    state = {n: torch.zeros(s) for n, s in shapes.items()}
    name = next(iter(shapes))
    with pytest.raises(AdapterError, match="rank"):
        check_adapter({**state, name: torch.zeros(8, 64)}, shapes, "v1", complete=True)
    with pytest.raises(AdapterError, match="missing adapter tensor"):
        check_adapter({n: t for n, t in state.items() if n != name}, shapes, "v1", complete=True)
    with pytest.raises(AdapterError, match="does not"):
        check_adapter({**state, "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 64)},
                      shapes, "v1", complete=True)
    # A part of a transfer may hold some of them.
    check_adapter({name: state[name]}, shapes, "part", complete=False)


def test_the_adapter_dropout_acts_only_inside_its_context():
    wrapped = with_adapter(tiny_model(1), LoraSpec(rank=4, alpha=8, dropout=0.5), torch.float32)
    model = trained_model(wrapped).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if ".lora_B." in name:
                parameter.fill_(0.5)
    ids = torch.arange(1, 30)
    assert torch.equal(logprobs(model, ids), logprobs(model, ids))  # eval: no dropout
    with adapter_dropout(model, True):
        assert not torch.equal(logprobs(model, ids), logprobs(model, ids))
    assert torch.equal(logprobs(model, ids), logprobs(model, ids))


def test_the_merged_weights_are_the_base_plus_the_scaled_product():
    wrapped = trained_adapter(seed=4, base_seed=4)
    plain = tiny_model(4)
    merger = MergedAdapter(plain, LORA)
    weights = plain.state_dict()
    merger.write(weights, adapter_state(wrapped))
    ids = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(logprobs(plain, ids), logprobs(trained_model(wrapped), ids),
                               atol=1e-4, rtol=0)
    assert merger.bytes_per_version == sum(
        t.numel() * 4 for t in adapter_state(wrapped).values())


def test_the_adapter_starts_the_same_in_every_process():
    """Seeded by model.lora.seed, whatever the global generator's state (data-parallel ranks
    must start from one adapter)."""
    torch.manual_seed(123)
    first = adapter_state(with_adapter(tiny_model(1), LORA, torch.float32))
    torch.manual_seed(456)
    second = adapter_state(with_adapter(tiny_model(1), LORA, torch.float32))
    other = adapter_state(with_adapter(tiny_model(1), LORA.model_copy(update={"seed": 1}),
                                       torch.float32))
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert torch.equal(first[name], second[name]) and not torch.equal(first[name], other[name])
