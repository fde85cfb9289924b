"""Rollout correction: how much each token's loss counts given how far the policy that sampled
it (the rollout engine, `π_behav`) is from the proximal policy of the decoupled objective
(the trainer, `π_prox`).

The decoupled objective already weighs every token by ``w = π_prox / π_behav``. That one ratio
carries both of the gaps asynchronous RL has: staleness (the token was sampled by older
weights) and the engine/trainer mismatch (the engine computes different log-probs than the
trainer for the same weights: other kernels, other precision). Per token, in order:

1. ``behaviourWeightCap`` (the decoupled objective's own bound) on the token's ``w``: ``mask``
   drops the token (it also leaves the products below), ``clamp`` caps ``w``.
2. The level forms the ratio ``ρ`` that weighs the token: ``token`` its own ``w``; ``sequence``
   the product of ``w`` over its sequence's kept tokens (the whole response's likelihood ratio);
   ``geometric`` their geometric mean, ``exp(mean log w)`` (length-independent).
3. ``truncate`` C: ``ρ ← min(ρ, C)`` (truncated importance sampling, TIS).
4. ``maskLow``/``maskHigh``: a token (level token) or a whole sequence (sequence, geometric)
   whose ``ρ`` falls outside ``[low, high]`` leaves the loss (masked importance sampling;
   IcePop's two-sided form is level token with both bounds).

The loss of a token is then ``ρ · PPO-clip(π_θ / π_prox)``. Everything is computed in log space
(a sequence's product overflows float32 long before its log does), detached: the weights are
constants of the loss. Pure tensor functions, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

__all__ = ["CORRECTION_LEVELS", "RolloutCorrection", "behaviour_weights"]

CORRECTION_LEVELS = ("token", "sequence", "geometric")
#: The largest log weight turned into a weight: e^30 is about 1e13, finite in float32 even
#: times a large advantage and summed over a batch.
_LOG_WEIGHT_BOUND = 30.0


@dataclass(frozen=True)
class RolloutCorrection:
    """The correction on top of the behaviour cap (the defaults change nothing)."""

    level: Literal["token", "sequence", "geometric"] = "token"
    truncate: float | None = None
    mask_low: float | None = None
    mask_high: float | None = None

    def __post_init__(self):
        if self.level not in CORRECTION_LEVELS:
            raise ValueError(f"level must be one of {CORRECTION_LEVELS}, got {self.level!r}")
        for name in ("truncate", "mask_low", "mask_high"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0 (or None), got {value}")
        if (self.mask_low is not None and self.mask_high is not None
                and self.mask_low >= self.mask_high):
            raise ValueError(f"mask_low {self.mask_low} must be below mask_high {self.mask_high}")

    @property
    def per_sequence(self) -> bool:
        return self.level != "token"


@dataclass(frozen=True)
class BehaviourWeights:
    """Per-token results (token-aligned, detached): the weight of each token's loss, and
    which tokens the cap and the correction acted on."""

    weight: Tensor       # 0 where a token left the loss
    raw: Tensor          # the token's own π_prox / π_behav, before anything
    capped: Tensor       # bool: over behaviourWeightCap
    truncated: Tensor    # bool: ρ lowered to `truncate`
    masked: Tensor       # bool: dropped by maskLow/maskHigh


def behaviour_weights(
    log_weight: Tensor,
    mask: Tensor,
    *,
    cap: float | None,
    cap_mode: str,
    correction: RolloutCorrection = RolloutCorrection(),
    sequence_ids: Tensor | None = None,
    num_sequences: int | None = None,
) -> BehaviourWeights:
    """The weight of every token's loss from its ``log π_prox − log π_behav`` (`log_weight`,
    0 where `mask` is False), following the steps in this module's docstring.

    `sequence_ids` (token-aligned, long, in ``[0, num_sequences)``) says which sequence each
    token belongs to; it is needed for levels sequence and geometric only.
    """
    mask = mask.bool()
    log_weight = torch.where(mask, log_weight.detach().float(), 0.0)
    raw = torch.exp(log_weight)
    no = torch.zeros_like(mask)
    capped = mask & (raw > cap) if cap is not None else no
    kept = mask & ~capped if cap_mode == "mask" else mask
    if cap is not None and cap_mode == "clamp":
        log_weight = log_weight.clamp(max=math.log(cap))
    log_rho = _level_log_ratio(torch.where(kept, log_weight, 0.0), kept, correction,
                               sequence_ids, num_sequences)
    truncated = no
    if correction.truncate is not None:
        truncated = kept & (log_rho > math.log(correction.truncate))
        log_rho = log_rho.clamp(max=math.log(correction.truncate))
    outside = no
    if correction.mask_low is not None:
        outside = outside | (log_rho < math.log(correction.mask_low))
    if correction.mask_high is not None:
        outside = outside | (log_rho > math.log(correction.mask_high))
    masked = kept & outside
    # A sequence's product is unbounded (the spec asks for truncate or maskHigh with it); the
    # bound keeps exp finite so that a zero advantage never meets an infinite weight (NaN).
    weight = torch.where(kept & ~masked, torch.exp(log_rho.clamp(max=_LOG_WEIGHT_BOUND)), 0.0)
    return BehaviourWeights(weight=weight, raw=raw, capped=capped, truncated=truncated,
                            masked=masked)


def _level_log_ratio(log_weight: Tensor, kept: Tensor, correction: RolloutCorrection,
                     sequence_ids: Tensor | None, num_sequences: int | None) -> Tensor:
    """log ρ per token: the token's own, or its sequence's sum (sequence) or mean
    (geometric) of the kept tokens' log weights."""
    if not correction.per_sequence:
        return log_weight
    if sequence_ids is None or num_sequences is None:
        raise ValueError(f"rollout correction at level {correction.level} needs sequence_ids "
                         "and num_sequences")
    if sequence_ids.shape != log_weight.shape:
        raise ValueError(f"sequence_ids has shape {tuple(sequence_ids.shape)}, expected "
                         f"{tuple(log_weight.shape)}")
    ids = sequence_ids.long()
    # float64 sums: a long response's log-ratio sum is exact enough to compare with log C.
    sums = log_weight.new_zeros(num_sequences, dtype=torch.float64).index_add_(
        0, ids, log_weight.double())
    if correction.level == "geometric":
        counts = log_weight.new_zeros(num_sequences, dtype=torch.float64).index_add_(
            0, ids, kept.double())
        sums = sums / counts.clamp(min=1)
    return sums[ids].to(log_weight.dtype)
