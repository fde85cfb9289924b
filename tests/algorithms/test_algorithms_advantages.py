"""Group-relative advantages against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algorithms.advantages import (
    ESTIMATORS,
    broadcast_to_tokens,
    compute_advantages,
    dr_grpo_advantages,
    episode_advantages,
    grpo_advantages,
    normalize_batch,
    rloo_advantages,
)

F64 = torch.float64


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def test_grpo_hand_computed():
    # Group [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3).
    # Group [3, 1, 2, 2]: mean 2,   unbiased std sqrt((1 + 1 + 0 + 0) / 3) = sqrt(2/3).
    rewards = t([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])
    s1, s2 = math.sqrt(1 / 3), math.sqrt(2 / 3)
    expected = [
        [0.5 / s1, -0.5 / s1, -0.5 / s1, 0.5 / s1],
        [1 / s2, -1 / s2, 0.0, 0.0],
    ]
    got = grpo_advantages(rewards, eps=0.0)
    for row, want in zip(got.tolist(), expected):
        assert row == pytest.approx(want, abs=1e-12)
    with_eps = grpo_advantages(rewards, eps=0.5)
    assert with_eps[0, 0].item() == pytest.approx(0.5 / (s1 + 0.5), abs=1e-12)


def test_dr_grpo_hand_computed():
    rewards = t([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 6.0]])
    assert dr_grpo_advantages(rewards).tolist() == [[0.5, -0.5, -0.5, 0.5], [0.0, -2.0, -1.0, 3.0]]


def test_rloo_hand_computed():
    # Group [1, 0, 0]: others' means are 0, 1/2, 1/2.
    # Group [4, 2, 0]: others' means are 1, 2, 3.
    rewards = t([[1.0, 0.0, 0.0], [4.0, 2.0, 0.0]])
    got = rloo_advantages(rewards).tolist()
    assert got[0] == pytest.approx([1.0, -0.5, -0.5], abs=1e-12)
    assert got[1] == pytest.approx([3.0, 0.0, -3.0], abs=1e-12)


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_all_equal_rewards_give_exact_zeros(estimator):
    # 0.1 is not exactly representable: the group mean rounds away from 0.1, so this checks
    # that flat groups are zeroed explicitly rather than left as tiny values divided by eps.
    rewards = t([[0.1, 0.1, 0.1], [1.0, 0.0, 1.0], [7.0, 7.0, 7.0]])
    got = compute_advantages(rewards, estimator)
    assert got[0].tolist() == [0.0, 0.0, 0.0]
    assert got[2].tolist() == [0.0, 0.0, 0.0]
    assert got[1].abs().sum().item() > 0


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_single_sample_groups_give_zeros(estimator):
    got = compute_advantages(t([[1.0], [0.0], [0.5]]), estimator)
    assert got.tolist() == [[0.0], [0.0], [0.0]]
    assert torch.isfinite(got).all()


def test_integer_rewards_become_floats():
    got = grpo_advantages(torch.tensor([[1, 0]]))
    assert got.is_floating_point()
    # mean 0.5, unbiased std sqrt(0.5)
    assert got[0, 0].item() == pytest.approx(0.5 / (math.sqrt(0.5) + 1e-6), rel=1e-6)


def test_rewards_must_be_two_dimensional():
    with pytest.raises(ValueError, match="rewards"):
        grpo_advantages(t([1.0, 0.0]))


def test_normalize_batch_hand_computed():
    # [1, 2, 3, 6]: mean 3, unbiased std sqrt((4 + 1 + 0 + 9) / 3) = sqrt(14/3).
    s = math.sqrt(14 / 3)
    got = normalize_batch(t([[1.0, 2.0], [3.0, 6.0]]), eps=0.0)
    assert got.flatten().tolist() == pytest.approx([-2 / s, -1 / s, 0.0, 3 / s], abs=1e-12)
    assert got.shape == (2, 2)


def test_normalize_batch_degenerate_inputs_give_zeros():
    assert normalize_batch(t([5.0])).tolist() == [0.0]
    assert normalize_batch(t([])).tolist() == []
    assert normalize_batch(t([[0.3, 0.3], [0.3, 0.3]])).tolist() == [[0.0, 0.0], [0.0, 0.0]]


def test_compute_advantages_dispatch_and_batch_norm():
    rewards = t([[1.0, 0.0], [3.0, 1.0]])
    assert compute_advantages(rewards, "dr_grpo").tolist() == [[0.5, -0.5], [1.0, -1.0]]
    assert compute_advantages(rewards, "rloo").tolist() == [[1.0, -1.0], [2.0, -2.0]]
    torch.testing.assert_close(compute_advantages(rewards, "grpo"), grpo_advantages(rewards))
    # Batch norm of [0.5, -0.5, 1, -1]: mean 0, unbiased std sqrt(2.5 / 3).
    s = math.sqrt(2.5 / 3)
    normed = compute_advantages(rewards, "dr_grpo", batch_norm=True)
    assert normed.flatten().tolist() == pytest.approx(
        [0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 1 / (s + 1e-6), -1 / (s + 1e-6)], abs=1e-12
    )


def test_unknown_estimator_lists_valid_names():
    assert ESTIMATORS == ("grpo", "dr_grpo", "rloo")
    with pytest.raises(ValueError, match="ppo") as info:
        compute_advantages(t([[1.0, 0.0]]), "ppo")
    for name in ESTIMATORS:
        assert name in str(info.value)


def test_broadcast_to_tokens():
    adv = t([0.5, -1.0, 2.0, 3.0])
    cu_seqlens = torch.tensor([0, 3, 3, 4, 6], dtype=torch.int32)  # lengths 3, 0, 1, 2
    assert broadcast_to_tokens(adv, cu_seqlens).tolist() == [0.5, 0.5, 0.5, 2.0, 3.0, 3.0]
    assert broadcast_to_tokens(t([]), torch.tensor([0])).tolist() == []


def test_broadcast_to_tokens_errors():
    with pytest.raises(ValueError, match="cu_seqlens"):
        broadcast_to_tokens(t([1.0, 2.0]), torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="start at 0"):
        broadcast_to_tokens(t([1.0]), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="non-decreasing"):
        broadcast_to_tokens(t([1.0, 2.0]), torch.tensor([0, 3, 2]))
    with pytest.raises(ValueError, match="sequence_advantages"):
        broadcast_to_tokens(t([[1.0]]), torch.tensor([0, 1]))


# Episodes: a group's n episodes may give several samples each, each with its own reward.


@pytest.mark.parametrize("batch_norm", [False, True])
@pytest.mark.parametrize("estimator", ESTIMATORS)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_one_sample_per_episode_is_exactly_compute_advantages(estimator, batch_norm, dtype):
    generator = torch.Generator().manual_seed(0)
    rewards = torch.rand(5, 4, generator=generator, dtype=dtype)
    rewards[1] = 0.1  # a flat group
    rewards[3, :2] = 1.0
    episodes = torch.arange(rewards.numel())
    got = episode_advantages(rewards.flatten(), episodes, rewards, estimator, batch_norm)
    want = compute_advantages(rewards, estimator, batch_norm).flatten()
    assert torch.equal(got, want)


# One group of 3 episodes with rewards [1, 0, 2] (mean 1, unbiased std 1); episode 1 gives two
# samples, the first (an intermediate turn) with its own reward 0.5.
EPISODE_REWARDS = t([[1.0, 0.0, 2.0]])
SAMPLE_REWARDS = t([1.0, 0.5, 0.0, 2.0])
EPISODE_OF_SAMPLE = torch.tensor([0, 1, 1, 2])


@pytest.mark.parametrize("estimator, expected", [
    ("grpo", [0.0, -0.5, -1.0, 1.0]),
    ("dr_grpo", [0.0, -0.5, -1.0, 1.0]),
    # The mean of the other episodes: 1, 1.5, 1.5, 0.5.
    ("rloo", [0.0, -1.0, -1.5, 1.5]),
])
def test_several_samples_of_an_episode_hand_computed(estimator, expected):
    got = episode_advantages(SAMPLE_REWARDS, EPISODE_OF_SAMPLE, EPISODE_REWARDS, estimator,
                             eps=0.0)
    assert got.tolist() == pytest.approx(expected, abs=1e-12)


def test_episode_advantages_batch_norm_is_over_all_samples():
    got = episode_advantages(SAMPLE_REWARDS, EPISODE_OF_SAMPLE, EPISODE_REWARDS, "dr_grpo",
                             batch_norm=True)
    torch.testing.assert_close(got, normalize_batch(t([0.0, -0.5, -1.0, 1.0])))


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_episodes_of_equal_rewards_give_zeros_whatever_their_samples(estimator):
    """A flat group carries no signal, even where an intermediate turn scored otherwise."""
    got = episode_advantages(t([0.3, 0.9, 0.3, 0.0]), torch.tensor([0, 0, 1, 2]),
                             t([[0.3, 0.3], [0.0, 0.0]]), estimator)
    assert got.tolist() == [0.0, 0.0, 0.0, 0.0]
    single = episode_advantages(t([0.3, 1.0]), torch.tensor([0, 0]), t([[1.0]]), estimator)
    assert single.tolist() == [0.0, 0.0]


def test_episode_advantages_errors():
    with pytest.raises(ValueError, match="one length"):
        episode_advantages(t([1.0, 0.0]), torch.tensor([0]), t([[1.0, 0.0]]), "grpo")
    with pytest.raises(ValueError, match="index the 2 episodes"):
        episode_advantages(t([1.0, 0.0]), torch.tensor([0, 2]), t([[1.0, 0.0]]), "grpo")
    with pytest.raises(ValueError, match="valid names"):
        episode_advantages(t([1.0, 0.0]), torch.tensor([0, 1]), t([[1.0, 0.0]]), "ppo")
