"""Several optimizer steps per batch (PPO minibatches and epochs), the learning-rate schedule,
and what the step measures about the weights before it: the policy's entropy and the
engine/trainer mismatch."""

from __future__ import annotations

import pytest
import torch

from asyncrl.trainer.step import PolicyUpdater, TrainSample, UpdateConfig, _pack, split_in_order
from support.trainer import make_groups, make_samples, tiny_model


def _updater(model, lr=0.1, **config):
    return PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=lr), UpdateConfig(**config))


def _with_versions(samples, version):
    return [TrainSample(s.input_ids, s.loss_mask, s.behaviour_logprobs, s.advantage, version)
            for s in samples]


def test_samples_are_split_in_order_into_near_equal_runs():
    samples = list(range(7))
    assert split_in_order(samples, 3) == [[0, 1, 2], [3, 4], [5, 6]]
    assert split_in_order(samples, 1) == [samples]
    assert split_in_order([0], 2) == [[0], []]


def test_minibatches_make_one_optimizer_step_each_and_the_clip_acts_after_the_first():
    """Two minibatches: the first is clipped against the weights it computes with (nothing to
    clip), the second against the weights before the first step, which a large step has moved:
    the clip acts there, as it never can with one step per batch."""
    samples = make_groups(2, 8)
    stats = _updater(tiny_model(), lr=2.0, ppo_minibatches=2).step(samples, 0)
    assert stats["optimizer_steps"] == 2
    first, second = stats["clip_fraction_per_minibatch"]
    assert first == 0.0
    assert second > 0.0
    assert stats["clip_fraction"] > 0.0
    assert stats["approx_kl"] > 0.0
    single = _updater(tiny_model(), lr=2.0).step(samples, 0)
    assert single["optimizer_steps"] == 1 and single["clip_fraction"] == 0.0


def test_the_first_minibatchs_step_is_a_whole_step_on_its_samples():
    """The first minibatch's proximal policy is the weights before it, as a one-step update
    of those samples alone has: the same parameters after it."""
    samples = make_groups(2, 4)
    split, alone = tiny_model(), tiny_model()
    updater = _updater(split, ppo_minibatches=2)
    steps = []
    updater.optimizer.step = _counting(updater.optimizer.step, steps, split)
    updater.step(samples, 0)
    _updater(alone).step(samples[:4], 0)
    for a, b in zip(steps[0], alone.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def _counting(step, snapshots, model):
    def wrapped(*args, **kwargs):
        result = step(*args, **kwargs)
        snapshots.append([p.detach().clone() for p in model.parameters()])
        return result
    return wrapped


def test_epochs_pass_over_the_minibatches_again():
    stats = _updater(tiny_model(), ppo_minibatches=2, ppo_epochs=3).step(make_groups(2, 4), 0)
    assert stats["optimizer_steps"] == 6
    assert len(stats["clip_fraction_per_minibatch"]) == 6
    assert stats["trained_tokens"] == sum(int(s.loss_mask.sum()) for s in make_groups(2, 4))


def test_loglinear_with_several_steps_is_refused():
    with pytest.raises(ValueError, match="loglinear"):
        _updater(tiny_model(), proximal="loglinear", ppo_minibatches=2).step(
            _with_versions(make_samples(4), 0), 0)


def test_the_schedule_sets_each_steps_learning_rate():
    model = tiny_model()
    updater = _updater(model, learning_rate=0.5, lr_decay="linear", lr_final_fraction=0.2,
                       max_steps=5)
    stats = updater.step(make_samples(2), 0, step=4)
    assert stats["learning_rate"] == pytest.approx(0.1)
    assert updater.optimizer.param_groups[0]["lr"] == pytest.approx(0.1)
    assert "learning_rate" not in _updater(tiny_model()).step(make_samples(2), 0)


@pytest.mark.parametrize("logits_in_blocks", [True, False])
def test_entropy_is_the_policys_over_the_trained_tokens(logits_in_blocks):
    model = tiny_model()
    samples = make_samples(3)
    stats = _updater(model, lr=0.0, temperature=0.7,
                     logits_in_blocks=logits_in_blocks).step(samples, 0)
    expected, tokens = 0.0, 0
    with torch.no_grad():
        for sample in samples:
            logits = model(input_ids=sample.input_ids[None]).logits[0].float() / 0.7
            probabilities = torch.softmax(logits, -1)
            entropy = -(probabilities * torch.log_softmax(logits, -1)).sum(-1)
            # Position i predicts token i + 1: the entropies of the response's predictions.
            predicting = sample.loss_mask.nonzero().squeeze(-1) - 1
            expected += float(entropy[predicting].sum())
            tokens += len(predicting)
    assert stats["entropy"] == pytest.approx(expected / tokens, rel=1e-4)


def test_mismatch_is_measured_on_tokens_of_the_trainers_version():
    """Behaviour log-probs equal to the trainer's own: no mismatch; shifted by 0.1: 0.1 per
    token. Tokens of another version are not counted."""
    model = tiny_model()
    updater = _updater(model, lr=0.0, micro_batch_max_tokens=16)  # several micro-batches
    samples = make_samples(4)
    exact = []
    for sample in samples:
        logprobs = updater._logprobs(model, _pack([sample])).detach()
        behaviour = torch.where(sample.loss_mask, logprobs, 0.0)
        exact.append(TrainSample(sample.input_ids, sample.loss_mask, behaviour, 1.0, 3))
    stats = updater.step(exact, 3)
    assert stats["mismatch_tokens"] == sum(int(s.loss_mask.sum()) for s in samples)
    assert stats["mismatch_abs_max"] < 1e-5 and stats["mismatch_k3"] < 1e-8
    shifted = [TrainSample(s.input_ids, s.loss_mask,
                           torch.where(s.loss_mask, s.behaviour_logprobs - 0.1, 0.0), 1.0, 3)
               for s in exact]
    stats = updater.step(shifted, 3)
    assert stats["mismatch_abs_mean"] == pytest.approx(0.1, abs=1e-5)
    assert stats["mismatch_abs_max"] == pytest.approx(0.1, abs=1e-5)  # a max, not a sum
    assert stats["micro_batches"] > 1
    assert stats["mismatch_outside_fraction"] == 0.0
    older = updater.step(_with_versions(shifted, 2), 3)
    assert older["mismatch_tokens"] == 0 and older["mismatch_abs_mean"] is None


def test_a_minibatch_with_no_samples_steps_nothing():
    """More minibatches than samples: the empty one makes no optimizer step (AdamW would
    move the weights on momentum and decay alone)."""
    sample = make_samples(1)
    split, whole = tiny_model(), tiny_model()
    for model, minibatches in ((split, 2), (whole, 1)):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        PolicyUpdater(model, optimizer, UpdateConfig(ppo_minibatches=minibatches)).step(sample, 0)
    for a, b in zip(split.parameters(), whole.parameters()):
        torch.testing.assert_close(a, b)


def test_entropy_in_blocks_is_the_whole_rows(monkeypatch):
    from asyncrl.model import recompute

    logits = torch.randn(10, 50) * 3
    logits[0, 5] = float("-inf")  # a masked token adds nothing, not NaN
    whole = recompute.entropy_of_logits(logits)
    monkeypatch.setattr(recompute, "LOGIT_ROWS", 3)
    torch.testing.assert_close(recompute.entropy_of_logits(logits), whole)
    assert torch.isfinite(whole).all()


@pytest.mark.parametrize("minibatches", [1, 2])
def test_entropy_comes_from_the_weights_before_the_update(minibatches):
    """One step: from the training forward; several: from the pass before the first. The
    same weights, the same figure."""
    samples = make_groups(2, 4)
    stats = _updater(tiny_model(), lr=5.0, ppo_minibatches=minibatches).step(samples, 0)
    reference = _updater(tiny_model(), lr=0.0).step(samples, 0)
    assert stats["entropy"] == pytest.approx(reference["entropy"], rel=1e-5)
