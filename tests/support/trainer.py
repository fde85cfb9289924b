"""Shared builders for trainer tests: a tiny model and a reproducible batch."""

from __future__ import annotations

import torch

from asyncrl.trainer.step import PolicyUpdater, TrainSample, UpdateConfig
from support import tiny_model as tiny

VOCAB = 512


def tiny_model() -> torch.nn.Module:
    """The trainer tests' tiny model: seed 7, VOCAB tokens."""
    return tiny.tiny_model(seed=7, vocab_size=VOCAB)


def make_samples(count: int, seed: int = 0, behaviour_noise: float = 0.1) -> list[TrainSample]:
    """Prompt + response samples of mixed lengths with made-up behaviour log-probs and
    advantages (what a rollout would produce, minus the generation)."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for _ in range(count):
        prompt = int(torch.randint(2, 6, (1,), generator=generator))
        response = int(torch.randint(1, 9, (1,), generator=generator))
        ids = torch.randint(0, VOCAB, (prompt + response,), generator=generator)
        mask = torch.zeros(prompt + response, dtype=torch.bool)
        mask[prompt:] = True
        behaviour = torch.zeros(prompt + response)
        behaviour[prompt:] = -6.2 + behaviour_noise * torch.randn(response, generator=generator)
        advantage = float(torch.randn(1, generator=generator))
        samples.append(TrainSample(ids, mask, behaviour, advantage))
    return samples


def make_groups(groups: int, size: int, seed: int = 0) -> list[TrainSample]:
    """`groups` groups of `size` responses to one prompt each (make_samples' kind of sample),
    the groups' prompts of different lengths."""
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for index in range(groups):
        prompt = torch.randint(0, VOCAB, (4 + 3 * index,), generator=generator)
        for response in make_samples(size, seed=seed * 1000 + index):
            generated = response.input_ids[response.loss_mask]
            mask = torch.cat([torch.zeros(len(prompt), dtype=torch.bool),
                              torch.ones(len(generated), dtype=torch.bool)])
            behaviour = torch.cat([torch.zeros(len(prompt)),
                                   response.behaviour_logprobs[response.loss_mask]])
            samples.append(TrainSample(torch.cat([prompt, generated]), mask, behaviour,
                                       response.advantage))
    return samples


def two_sgd_steps(samples: list[TrainSample], logits_in_blocks: bool, **config):
    """Two steps (SGD: its update is the gradient's, undistorted); the stats of each, the
    parameters after, and the shapes of the tensors kept for backward in the first."""
    model = tiny_model()
    updater = PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            UpdateConfig(logits_in_blocks=logits_in_blocks, **config))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept = []  # the parameters left out

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in weights:
            kept.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        first = updater.step(samples)
    second = updater.step(samples)
    return first, second, [p.detach().clone() for p in model.parameters()], kept


def assert_same_steps(expected: list[dict], got: list[dict], params, expected_params) -> None:
    """Steps (each of several micro-batches) with the same stats and parameters after, to
    float32's 1e-6."""
    import pytest

    for before, after in zip(expected, got):
        assert after["micro_batches"] > 1
        for name in ("loss", "grad_norm", "clip_fraction", "approx_kl", "trained_tokens"):
            assert after[name] == pytest.approx(before[name], rel=1e-5, abs=1e-7), name
    for parameter, expected_parameter in zip(params, expected_params):
        torch.testing.assert_close(parameter, expected_parameter, atol=1e-6, rtol=0)
