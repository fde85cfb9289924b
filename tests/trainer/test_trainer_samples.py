"""samples_from_groups turns a batch's groups into training samples: loss masks, advantages and
the episode-reward matrix, for single-turn groups and for episodes of several samples."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from asyncrl.algorithms.advantages import aggregation_weights, compute_advantages
from asyncrl.data.samples import Group, Trajectory
from asyncrl.trainer.service import overlong_penalty_record, samples_from_groups


def algorithm(estimator="grpo", batch_norm=False, aggregation="token_mean", overlong=0):
    return SimpleNamespace(advantage_estimator=estimator, batch_norm_advantages=batch_norm,
                           loss_aggregation=aggregation,
                           overlong_penalty=SimpleNamespace(buffer_tokens=overlong, factor=1.0))


def sample(response: int, reward: float, mask=(), continues=False, version=3) -> Trajectory:
    """A sample with a 2-token prompt and `response` response tokens."""
    return Trajectory([1, 2], [5] * response, [-0.25] * response, [version] * response, reward,
                      "stop", 0.0, 0.0, list(mask), continues)


# One group of two episodes (groupSize 2): episode 0 gave two samples, its first turn (reward
# 0.5, an environment token in the middle) and its second (reward 1, ending with one); episode
# 1 is one sample with reward 0.
EPISODES = [Group("g", "p", [
    sample(3, 0.5, mask=[1, 0, 1]),
    sample(4, 1.0, mask=[1, 1, 1, 0], continues=True),
    sample(2, 0.0),
], 0)]


@pytest.mark.parametrize("as_protobuf", [False, True])
def test_an_episode_of_two_samples_gives_masks_advantages_and_episode_rewards(as_protobuf):
    groups = [g.to_pb() for g in EPISODES] if as_protobuf else EPISODES
    samples, rewards = samples_from_groups(groups, algorithm("dr_grpo"))
    # Episode rewards [1, 0]: mean 0.5.
    assert rewards.tolist() == [[1.0, 0.0]]
    assert [s.loss_mask.tolist() for s in samples] == [
        [False, False, True, False, True],
        [False, False, True, True, True, False],
        [False, False, True, True],
    ]
    assert [s.advantage for s in samples] == pytest.approx([0.0, 0.5, -0.5])
    # Behaviour log-probs and versions stay as given, environment tokens included.
    assert samples[0].behaviour_logprobs.tolist() == [0.0, 0.0, -0.25, -0.25, -0.25]
    assert samples[0].token_versions.tolist() == [-1, -1, 3, 3, 3]
    assert samples[0].version == 3


def test_grpo_and_rloo_measure_each_sample_against_the_episodes():
    # Episode rewards [1, 0]: unbiased std sqrt(0.5); rloo's other episode: 0, then 1.
    grpo, _ = samples_from_groups(EPISODES, algorithm("grpo"))
    scale = 0.5 ** 0.5 + 1e-6
    assert [s.advantage for s in grpo] == pytest.approx([0.0, 0.5 / scale, -0.5 / scale])
    rloo, _ = samples_from_groups(EPISODES, algorithm("rloo"))
    assert [s.advantage for s in rloo] == pytest.approx([0.5, 1.0, -1.0])


def test_sequence_mean_weighs_each_sample_by_its_model_tokens():
    """Model tokens 2, 3 and 2 (7 over 3 samples): factors 7/6, 7/9 and 7/6, so each sample's
    advantage summed over its loss tokens is its advantage x 7/3."""
    samples, _ = samples_from_groups(EPISODES, algorithm("rloo", aggregation="sequence_mean"))
    assert [s.advantage for s in samples] == pytest.approx([0.5 * 7 / 6, 1.0 * 7 / 9,
                                                            -1.0 * 7 / 6])
    summed = [s.advantage * int(s.loss_mask.sum()) for s in samples]
    assert summed == pytest.approx([0.5 * 7 / 3, 7 / 3, -7 / 3])


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
@pytest.mark.parametrize("batch_norm", [False, True])
@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_single_turn_batches_give_what_they_gave_before(estimator, batch_norm, aggregation):
    """Every sample its own episode: the [groups, n] computation the trainer always did."""
    generator = torch.Generator().manual_seed(1)
    rewards = torch.rand(3, 4, generator=generator)
    lengths = torch.randint(1, 9, (3, 4), generator=generator)
    groups = [Group(f"g{g}", "p", [sample(int(lengths[g, i]), float(rewards[g, i]))
                                   for i in range(4)], 0).to_pb() for g in range(3)]
    samples, got_rewards = samples_from_groups(groups, algorithm(estimator, batch_norm,
                                                                 aggregation))
    before = (compute_advantages(rewards, estimator, batch_norm)
              * aggregation_weights(lengths, aggregation)).flatten()
    assert torch.equal(got_rewards, rewards)
    assert torch.equal(torch.tensor([s.advantage for s in samples]), before)
    assert all(s.loss_mask.tolist() == [False] * 2 + [True] * (len(s.input_ids) - 2)
               for s in samples)


def test_groups_of_different_episode_counts_are_refused():
    groups = [Group("a", "p", [sample(1, 1.0), sample(1, 0.0)], 0),
              Group("b", "p", [sample(1, 1.0)], 0)]
    with pytest.raises(ValueError, match=r"different numbers of episodes \(\[2, 1\]\)"):
        samples_from_groups(groups, algorithm())


def test_the_overlong_penalty_shapes_the_advantages_not_the_rewards_reported():
    """maxNewTokens 8, a buffer of 4: responses of 2, 6 and 8 tokens lose 0, 0.5 and 1. Two
    right answers (1, 1) and a cut one (0) become 1, 0.5 and -1 (mean 1/6) for dr_grpo; the
    reward matrix stays as scored."""
    groups = [Group("g", "p", [sample(2, 1.0), sample(6, 1.0), sample(8, 0.0)], 0)]
    samples, rewards = samples_from_groups(groups, algorithm("dr_grpo", overlong=4), 8)
    assert rewards.tolist() == [[1.0, 1.0, 0.0]]
    assert [s.advantage for s in samples] == pytest.approx([1 - 1 / 6, 0.5 - 1 / 6, -1 - 1 / 6])
    # A group the buffer would call uniform (all right) still ranks its answers by length.
    groups = [Group("g", "p", [sample(2, 1.0), sample(7, 1.0)], 0)]
    samples, _ = samples_from_groups(groups, algorithm("dr_grpo", overlong=4), 8)
    assert [s.advantage for s in samples] == pytest.approx([0.375, -0.375])
    # The step's record: the batch's mean penalty, (0 + 0.75) / 2; nothing when it is off.
    assert overlong_penalty_record(groups, algorithm(overlong=4), 8) == {
        "overlong_penalty_mean": 0.375}
    assert overlong_penalty_record(groups, algorithm(), 8) == {}


def test_the_overlong_penalty_refuses_episodes_of_several_samples():
    with pytest.raises(ValueError, match="overlongPenalty shapes single-turn jobs only"):
        samples_from_groups(EPISODES, algorithm(overlong=4), 8)
