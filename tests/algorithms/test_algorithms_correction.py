"""Rollout correction (truncated and masked importance weights at token, sequence and
geometric level) and the engine/trainer mismatch figures, against hand-computed cases."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algorithms.correction import RolloutCorrection, behaviour_weights
from asyncrl.algorithms.mismatch import mismatch_sums, mismatch_summary
from asyncrl.algorithms.ppo import decoupled_ppo_loss

# Two sequences: tokens 0-2 are sequence 0, tokens 3-4 sequence 1; token 5 is a prompt token.
RATIOS = [2.0, 0.5, 4.0, 1.5, 3.0, 1.0]
MASK = torch.tensor([True, True, True, True, True, False])
SEQUENCES = torch.tensor([0, 0, 0, 1, 1, 1])


def weights(cap=None, cap_mode="mask", **correction):
    log_weight = torch.tensor([math.log(r) for r in RATIOS])
    return behaviour_weights(log_weight, MASK, cap=cap, cap_mode=cap_mode,
                             correction=RolloutCorrection(**correction),
                             sequence_ids=SEQUENCES, num_sequences=2)


def close(tensor, expected):
    torch.testing.assert_close(tensor, torch.tensor(expected, dtype=tensor.dtype),
                               rtol=1e-5, atol=1e-6)


def test_the_default_is_each_tokens_own_weight():
    close(weights().weight, [2.0, 0.5, 4.0, 1.5, 3.0, 0.0])


def test_the_behaviour_cap_masks_or_clamps_each_token_first():
    close(weights(cap=3.5).weight, [2.0, 0.5, 0.0, 1.5, 3.0, 0.0])
    close(weights(cap=3.5, cap_mode="clamp").weight, [2.0, 0.5, 3.5, 1.5, 3.0, 0.0])


def test_token_truncation_is_tis():
    result = weights(truncate=2.0)
    close(result.weight, [2.0, 0.5, 2.0, 1.5, 2.0, 0.0])
    assert result.truncated.tolist() == [False, False, True, False, True, False]


def test_icepop_masks_tokens_outside_both_bounds():
    result = weights(mask_low=0.6, mask_high=2.5)
    close(result.weight, [2.0, 0.0, 0.0, 1.5, 0.0, 0.0])
    assert result.masked.tolist() == [False, True, True, False, True, False]


def test_sequence_level_weighs_every_token_by_its_responses_product():
    # Sequence 0: 2 * 0.5 * 4 = 4; sequence 1: 1.5 * 3 = 4.5.
    close(weights(level="sequence").weight, [4.0, 4.0, 4.0, 4.5, 4.5, 0.0])
    close(weights(level="sequence", truncate=4.2).weight, [4.0, 4.0, 4.0, 4.2, 4.2, 0.0])
    # Sequence masking drops a whole response.
    close(weights(level="sequence", mask_high=4.2).weight, [4.0, 4.0, 4.0, 0.0, 0.0, 0.0])


def test_geometric_level_is_the_products_geometric_mean():
    geo0, geo1 = 4.0 ** (1 / 3), 4.5 ** 0.5
    close(weights(level="geometric").weight, [geo0] * 3 + [geo1] * 2 + [0.0])
    close(weights(level="geometric", mask_low=1.6, mask_high=2.5).weight,
          [0.0] * 3 + [geo1] * 2 + [0.0])


def test_a_token_masked_by_the_cap_leaves_its_sequences_product():
    # Token 2 (weight 4) is over the cap: sequence 0's product is 2 * 0.5 = 1 without it.
    close(weights(cap=3.5, level="sequence").weight, [1.0, 1.0, 0.0, 4.5, 4.5, 0.0])


def test_a_long_sequences_product_neither_overflows_nor_goes_nan():
    log_weight = torch.full((400,), math.log(2.0))
    result = behaviour_weights(log_weight, torch.ones(400, dtype=torch.bool), cap=None,
                               cap_mode="mask",
                               correction=RolloutCorrection(level="sequence", truncate=10.0),
                               sequence_ids=torch.zeros(400, dtype=torch.long), num_sequences=1)
    close(result.weight, [10.0] * 400)


def test_sequence_levels_need_the_sequences():
    with pytest.raises(ValueError, match="sequence_ids"):
        behaviour_weights(torch.zeros(3), torch.ones(3, dtype=torch.bool), cap=None,
                          cap_mode="mask", correction=RolloutCorrection(level="sequence"))


@pytest.mark.parametrize("arguments, message", [
    ({"level": "response"}, "level"), ({"truncate": 0.0}, "truncate"),
    ({"mask_low": 2.0, "mask_high": 0.5}, "below"),
])
def test_a_bad_correction_is_refused(arguments, message):
    with pytest.raises(ValueError, match=message):
        RolloutCorrection(**arguments)


def test_the_loss_weighs_each_tokens_ppo_term_by_the_corrected_weight():
    """With π_θ = π_prox every PPO term is -A; the loss is the mean of -A · weight."""
    proximal = torch.tensor([-1.0, -2.0, -0.5, -3.0, -1.5, 0.0], dtype=torch.float64)
    behaviour = proximal - torch.tensor([math.log(r) for r in RATIOS], dtype=torch.float64)
    logprobs = proximal.clone().requires_grad_(True)
    advantages = torch.ones(6, dtype=torch.float64)
    loss, stats = decoupled_ppo_loss(
        logprobs, proximal, behaviour, advantages, MASK, behaviour_weight_cap=None,
        correction=RolloutCorrection(truncate=2.0, mask_low=0.6),
        sequence_ids=SEQUENCES, num_sequences=2)
    # Weights 2, masked, 2 (truncated), 1.5, 2 (truncated): sum 7.5 over 5 tokens.
    assert float(loss.detach()) == pytest.approx(-7.5 / 5)
    assert float(stats["correction_truncated_fraction"]) == pytest.approx(2 / 5)
    assert float(stats["correction_masked_fraction"]) == pytest.approx(1 / 5)
    loss.backward()
    # d loss / d logprob_t = -A · weight_t / tokens (ratio 1, inside the clip).
    close(logprobs.grad.float(), [-0.4, 0.0, -0.4, -0.3, -0.4, 0.0])


def test_the_default_correction_leaves_the_loss_as_before():
    proximal = torch.tensor([-1.0, -2.0, -0.5], dtype=torch.float64)
    behaviour = proximal - torch.tensor([0.3, -0.2, 2.0], dtype=torch.float64)
    logprobs = (proximal + 0.1).requires_grad_(True)
    advantages = torch.tensor([1.0, -1.0, 0.5], dtype=torch.float64)
    mask = torch.ones(3, dtype=torch.bool)
    loss, stats = decoupled_ppo_loss(logprobs, proximal, behaviour, advantages, mask)
    ratio = math.exp(0.1)
    # Token 0: A = 1, ratio inside the clip, weight e^0.3; token 1: A = -1, the unclipped
    # term wins, weight e^-0.2; token 2: weight e^2 = 7.4 is over the default cap 5: masked.
    expected = [-ratio * math.exp(0.3), ratio * math.exp(-0.2), 0.0]
    assert float(loss.detach()) == pytest.approx(sum(expected) / 3)
    assert float(stats["behaviour_capped_fraction"]) == pytest.approx(1 / 3)
    assert float(stats["correction_masked_fraction"]) == 0.0


def test_mismatch_figures_by_hand():
    trainer = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    engine = torch.tensor([-1.0, -1.0, -0.5 - math.log(3.0), -9.0])
    mask = torch.tensor([True, True, True, False])  # the last token is of another version
    summary = mismatch_summary(mismatch_sums(trainer, engine, mask))
    assert summary["mismatch_tokens"] == 3
    assert summary["mismatch_abs_mean"] == pytest.approx((0 + 1 + math.log(3)) / 3)
    assert summary["mismatch_abs_max"] == pytest.approx(math.log(3))
    r1, r2 = math.exp(-1.0), 3.0
    k3 = (0.0 + (r1 - 1 + 1.0) + (r2 - 1 - math.log(3))) / 3
    assert summary["mismatch_k3"] == pytest.approx(k3)
    # r = e^-1 = 0.37 and 3 are outside [0.5, 2].
    assert summary["mismatch_outside_fraction"] == pytest.approx(2 / 3)


def test_identical_log_probs_have_no_mismatch_and_no_tokens_no_figures():
    logprobs = torch.tensor([-1.0, -2.0])
    exact = mismatch_summary(mismatch_sums(logprobs, logprobs.clone(), torch.ones(2).bool()))
    assert exact["mismatch_abs_max"] == 0.0 and exact["mismatch_k3"] == 0.0
    none = mismatch_summary(mismatch_sums(logprobs, logprobs, torch.zeros(2).bool()))
    assert none == {"mismatch_tokens": 0, "mismatch_abs_mean": None, "mismatch_abs_max": None,
                    "mismatch_k3": None, "mismatch_outside_fraction": None}


def test_an_unbounded_sequence_product_stays_finite_in_the_loss():
    """400 tokens of weight e^0.25: the product e^100 would overflow float32; with a zero
    advantage it must not turn the loss into NaN."""
    count = 400
    proximal = torch.full((count,), -1.0)
    behaviour = proximal - 0.25
    logprobs = proximal.clone().requires_grad_(True)
    loss, _ = decoupled_ppo_loss(
        logprobs, proximal, behaviour, torch.zeros(count), torch.ones(count, dtype=torch.bool),
        behaviour_weight_cap=None, correction=RolloutCorrection(level="sequence"),
        sequence_ids=torch.zeros(count, dtype=torch.long), num_sequences=1)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logprobs.grad).all()
