"""Group-relative advantage estimators for outcome rewards.

The buffer hands the trainer whole groups: n responses sampled for the same prompt. Rewards arrive
as ``[num_groups, group_size]``; each response's advantage is its reward measured against the other
responses to the same prompt, so no value network is needed. A group in which every response got
the same reward carries no learning signal and gets advantage 0 (never NaN).

Multi-turn episodes take the responses' place: a group is n episodes of one prompt, and an
episode whose turns did not merge into one sequence gives several samples, each with its own
reward. ``episode_advantages`` measures each sample's reward against its group's episode
rewards (one per episode, that of its last sample), as the estimators measure a response's.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "AGGREGATIONS",
    "ESTIMATORS",
    "aggregation_weights",
    "broadcast_to_tokens",
    "compute_advantages",
    "dr_grpo_advantages",
    "episode_advantages",
    "grpo_advantages",
    "normalize_batch",
    "rloo_advantages",
]

ESTIMATORS = ("grpo", "dr_grpo", "rloo")
AGGREGATIONS = ("token_mean", "sequence_mean")


def grpo_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """GRPO (DeepSeekMath): ``(r - group mean) / (group std + eps)``, unbiased std.

    Size-1 groups and groups of equal rewards give 0 (their std is undefined or 0).
    """
    rewards = _check_rewards(rewards)
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    scaled = centred / (rewards.std(dim=1, keepdim=True) + eps)
    return _zero_flat_groups(rewards, scaled)


def dr_grpo_advantages(rewards: Tensor) -> Tensor:
    """Dr. GRPO (Liu et al. 2025): ``r - group mean``; dropping the std removes GRPO's bias
    towards prompts that are almost always (or almost never) solved."""
    rewards = _check_rewards(rewards)
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    return _zero_flat_groups(rewards, centred)


def rloo_advantages(rewards: Tensor) -> Tensor:
    """RLOO (Ahmadian et al. 2024): ``r`` minus the mean of the *other* n-1 rewards in its group,
    a baseline independent of the sample itself. Size-1 groups give 0 (no other sample)."""
    rewards = _check_rewards(rewards)
    group_size = rewards.shape[1]
    if group_size < 2:
        return torch.zeros_like(rewards)
    leave_one_out_mean = (rewards.sum(dim=1, keepdim=True) - rewards) / (group_size - 1)
    return _zero_flat_groups(rewards, rewards - leave_one_out_mean)


def normalize_batch(advantages: Tensor, eps: float = 1e-6) -> Tensor:
    """Whole-batch ``(a - mean) / (std + eps)`` over every element, unbiased std.

    Fewer than two elements, or all elements equal, give zeros.
    """
    if advantages.numel() < 2:
        return torch.zeros_like(advantages)
    flat = advantages.flatten()
    normalised = (advantages - flat.mean()) / (flat.std() + eps)
    all_equal = flat.amax() == flat.amin()
    return torch.where(all_equal, torch.zeros_like(normalised), normalised)


def compute_advantages(rewards: Tensor, estimator: str, batch_norm: bool = False) -> Tensor:
    """Advantages ``[num_groups, group_size]`` by estimator name (one of ``ESTIMATORS``),
    optionally normalised over the whole batch afterwards."""
    if estimator == "grpo":
        advantages = grpo_advantages(rewards)
    elif estimator == "dr_grpo":
        advantages = dr_grpo_advantages(rewards)
    elif estimator == "rloo":
        advantages = rloo_advantages(rewards)
    else:
        raise _unknown_estimator(estimator)
    return normalize_batch(advantages) if batch_norm else advantages


def episode_advantages(sample_rewards: Tensor, episode_of_sample: Tensor, episode_rewards: Tensor,
                       estimator: str, batch_norm: bool = False, eps: float = 1e-6) -> Tensor:
    """Advantages ``[num_samples]`` of a batch of episodes, one or more samples each.

    ``episode_rewards`` ``[num_groups, group_size]`` holds each episode's reward (that of its
    last sample), ``sample_rewards`` ``[num_samples]`` each sample's own reward and
    ``episode_of_sample`` ``[num_samples]`` the flat index ``group * group_size + episode`` of
    its episode. A sample's reward ``r`` is measured against its group's episode rewards:
    ``(r - mean) / (std + eps)`` for grpo, ``r - mean`` for dr_grpo, ``r`` minus the mean of
    the group's other episodes for rloo. Groups whose episode rewards are all equal, and
    size-1 groups, give 0. With one sample per episode this is exactly
    ``compute_advantages(episode_rewards, ...).flatten()``.
    """
    rewards = _check_rewards(episode_rewards)
    if estimator not in ESTIMATORS:
        raise _unknown_estimator(estimator)
    if sample_rewards.dim() != 1 or episode_of_sample.shape != sample_rewards.shape:
        raise ValueError(
            f"sample_rewards and episode_of_sample must be 1-D [num_samples] of one length, got "
            f"shapes {tuple(sample_rewards.shape)} and {tuple(episode_of_sample.shape)}"
        )
    episodes, group_size = rewards.numel(), rewards.shape[1]
    if len(episode_of_sample) and not 0 <= int(episode_of_sample.min()) <= int(
            episode_of_sample.max()) < episodes:
        raise ValueError(f"episode_of_sample must index the {episodes} episodes of "
                         f"episode_rewards (group * group_size + episode)")
    if group_size < 2:
        return torch.zeros(sample_rewards.shape, dtype=rewards.dtype)
    group_of_sample = episode_of_sample // group_size
    mean = rewards.mean(dim=1)
    if estimator == "rloo":
        baseline = ((rewards.sum(dim=1, keepdim=True) - rewards) / (group_size - 1)).flatten()
        advantages = sample_rewards.to(rewards.dtype) - baseline[episode_of_sample]
    else:
        advantages = sample_rewards.to(rewards.dtype) - mean[group_of_sample]
    if estimator == "grpo":
        advantages = advantages / (rewards.std(dim=1) + eps)[group_of_sample]
    flat = (rewards.amax(dim=1) == rewards.amin(dim=1))[group_of_sample]
    advantages = torch.where(flat, torch.zeros_like(advantages), advantages)
    return normalize_batch(advantages) if batch_norm else advantages


def aggregation_weights(loss_tokens: Tensor, aggregation: str) -> Tensor:
    """Factors on the samples' advantages (same shape as ``loss_tokens``, each sample's tokens
    in the loss: its response length, or its model tokens in an episode) that turn the
    trainer's loss, the sum of every loss token's PPO term over the batch's token count, into
    the aggregation asked for. The PPO term is linear in a positive factor on the advantage,
    so this is exact, clipping included. Any shape: a flat vector serves ragged groups.

    ``token_mean``: all 1, every token weighs the same. ``sequence_mean``: ``tokens /
    (samples x its tokens)``, so each sample's tokens share an equal part of the loss whatever
    its length (a sample with no tokens has none to weigh).
    """
    if aggregation == "token_mean":
        return torch.ones(loss_tokens.shape)
    if aggregation != "sequence_mean":
        raise ValueError(f"unknown loss aggregation {aggregation!r}; valid names: "
                         f"{', '.join(AGGREGATIONS)}")
    lengths = loss_tokens.to(torch.float32)
    return lengths.sum() / (lengths.numel() * lengths.clamp(min=1))


def broadcast_to_tokens(sequence_advantages: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Repeat one advantage per sequence over that sequence's tokens in a packed batch.

    ``cu_seqlens`` (length N+1, starting at 0) holds the sequence boundaries, as in
    ``PackedBatch.cu_seqlens``; the result is ``[cu_seqlens[-1]]``. Prompt tokens receive the
    value too: the loss mask is what keeps them out of the loss.
    """
    if sequence_advantages.dim() != 1:
        raise ValueError(
            f"sequence_advantages must be 1-D [N], got shape {tuple(sequence_advantages.shape)}"
        )
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() != sequence_advantages.numel() + 1:
        raise ValueError(
            f"cu_seqlens must be 1-D with N+1 = {sequence_advantages.numel() + 1} entries, "
            f"got shape {tuple(cu_seqlens.shape)}"
        )
    if int(cu_seqlens[0]) != 0:
        raise ValueError(f"cu_seqlens must start at 0, got {int(cu_seqlens[0])}")
    lengths = cu_seqlens.diff().to(device=sequence_advantages.device, dtype=torch.long)
    if bool((lengths < 0).any()):
        raise ValueError("cu_seqlens must be non-decreasing")
    return torch.repeat_interleave(
        sequence_advantages, lengths, output_size=int(cu_seqlens[-1])
    )


def _unknown_estimator(estimator: str) -> ValueError:
    return ValueError(
        f"unknown advantage estimator {estimator!r}; valid names: {', '.join(ESTIMATORS)}"
    )


def _check_rewards(rewards: Tensor) -> Tensor:
    """Rewards must be ``[num_groups, group_size]``; integer rewards become floats."""
    if rewards.dim() != 2:
        raise ValueError(
            f"rewards must be 2-D [num_groups, group_size], got shape {tuple(rewards.shape)}"
        )
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    return rewards


def _zero_flat_groups(rewards: Tensor, advantages: Tensor) -> Tensor:
    """Exact zeros for groups whose rewards are all equal, where rounding in the mean would
    otherwise leave tiny values (and ``/ (0 + eps)`` would blow them up)."""
    flat = rewards.amax(dim=1, keepdim=True) == rewards.amin(dim=1, keepdim=True)
    return torch.where(flat, torch.zeros_like(advantages), advantages)
