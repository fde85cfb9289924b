"""The torch engine serving a LoRA job (model.lora): each version is the adapter's tensors,
merged into the engine's weights from a kept copy of the base."""

import pytest
import torch

from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.engine.types import RequestError, SamplingParams
from asyncrl.model.lora import adapter_state, trained_model, with_adapter, write_adapter
from asyncrl.model.policy import packed_token_logprobs
from asyncrl.spec.job import LoraSpec
from support.lora import LORA, trained_adapter
from support.tiny_model import tiny_model

LOGPROB_TOLERANCE = 1e-4  # the engine's tolerance against the trainer without an adapter too


def trainer_logprobs(wrapped, prompt, output):
    ids = torch.tensor(prompt + output)
    with torch.no_grad():
        return packed_token_logprobs(trained_model(wrapped), ids, torch.arange(len(ids)),
                                     torch.tensor([0, len(ids)]))[len(prompt):]


PROMPTS = [[5, 17, 3], [200, 9, 41, 7, 7], [1, 2]]


@pytest.mark.parametrize("fused", [True, False])
def test_each_versions_logprobs_are_the_trainers_for_the_same_adapter(tmp_path, fused):
    """Versions by state dict and from a peft directory on disk: the engine's log-probs are
    those the trainer computes with the adapter unmerged."""
    engine = TorchEngine(tiny_model(1).eval(), max_running_requests=4, max_sequence_length=64,
                         seed=0, fused_decode=fused, lora=LORA).start()
    try:
        for version, how in [(1, "state"), (2, "disk")]:
            wrapped = trained_adapter(seed=version)
            state = adapter_state(wrapped)
            if how == "state":
                engine.update_weights_from_state_dict(state, version)
            else:
                write_adapter(tmp_path / f"v{version}", state, LORA)
                engine.update_weights(tmp_path / f"v{version}", version)
            futures = [engine.submit(p, SamplingParams(max_new_tokens=8)) for p in PROMPTS]
            for prompt, future in zip(PROMPTS, futures):
                result = future.result(timeout=60)
                assert set(result.output_versions) == {version}
                torch.testing.assert_close(torch.tensor(result.output_logprobs),
                                           trainer_logprobs(wrapped, prompt, result.output_ids),
                                           atol=LOGPROB_TOLERANCE, rtol=0)
    finally:
        engine.stop()


def test_hundreds_of_versions_leave_no_merge_error_behind():
    """Each version is merged from the kept base: after 300 versions the weights are exactly
    those of an engine that took only the last one."""
    long_lived = TorchEngine(tiny_model(1).eval(), max_running_requests=1,
                             max_sequence_length=32, lora=LORA)
    shapes = {n: t.shape for n, t in adapter_state(trained_adapter(0)).items()}
    generator = torch.Generator().manual_seed(0)
    for version in range(1, 301):
        long_lived.update_weights_from_state_dict(
            {n: torch.randn(s, generator=generator) for n, s in shapes.items()}, version)
    last = adapter_state(trained_adapter(seed=7))
    long_lived.update_weights_from_state_dict(last, 301)
    fresh = TorchEngine(tiny_model(1).eval(), max_running_requests=1, max_sequence_length=32,
                        lora=LORA)
    fresh.update_weights_from_state_dict(last, 1)
    for (name, kept), (_, once) in zip(long_lived._model.state_dict().items(),
                                       fresh._model.state_dict().items()):
        assert torch.equal(kept, once), name


def test_an_adapter_that_does_not_fit_is_refused_and_the_version_kept():
    engine = TorchEngine(tiny_model(1).eval(), max_running_requests=2, max_sequence_length=32,
                         lora=LORA)
    good = adapter_state(trained_adapter(seed=1))
    engine.update_weights_from_state_dict(good, 1)
    before = {n: t.clone() for n, t in engine._model.state_dict().items()}
    wrong_rank = adapter_state(with_adapter(tiny_model(1), LoraSpec(rank=8), torch.float32))
    with pytest.raises(RequestError, match="rank"):
        engine.update_weights_from_state_dict(wrong_rank, 2)
    whole_model = tiny_model(2).state_dict()  # a full snapshot to a LoRA engine
    with pytest.raises(RequestError, match="adapter does not"):
        engine.update_weights_from_state_dict(whole_model, 2)
    assert engine.version == 1
    for name, tensor in engine._model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
