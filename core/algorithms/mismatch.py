"""The engine/trainer mismatch: for tokens the trainer's current weights generated, the rollout
engine's log-prob and the trainer's should be one number. They differ by the two programs'
numerics (kernels, precision: a bf16 trainer against a float32 engine, say), and that gap is an
off-policy error of its own that no staleness bound removes.

`mismatch_sums` measures it over the tokens it is given, as sums a trainer adds up across
micro-batches and ranks before dividing once (`mismatch_summary`). With ``r = π_trainer /
π_engine`` per token:

- ``|Δ log-prob|``: mean and max of ``|log π_trainer − log π_engine|``;
- ``k3``: Schulman's estimate of KL(π_engine ‖ π_trainer) from the engine's samples, ``r − 1 −
  log r`` (never negative, 0 only where they agree);
- ``outside``: the share of tokens with ``r`` outside ``[0.5, 2]``, where truncation or masking
  (asyncrl.algorithms.correction) would act at IcePop's bounds.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["MISMATCH_BOUNDS", "MISMATCH_SUMS", "mismatch_sums", "mismatch_summary"]

#: The ratio band outside which a token counts in `outside`.
MISMATCH_BOUNDS = (0.5, 2.0)
#: The sums, in the order `mismatch_sums` returns them.
MISMATCH_SUMS = ("tokens", "abs_diff_sum", "abs_diff_max", "k3_sum", "outside")


def mismatch_sums(trainer_logprobs: Tensor, engine_logprobs: Tensor, mask: Tensor) -> Tensor:
    """[tokens, Σ|Δ|, max |Δ|, Σ k3, tokens outside the band] over the tokens where `mask` is
    set, float64 on the tensors' device (no read-back: the caller sums them where it likes)."""
    mask = mask.bool()
    diff = torch.where(mask, trainer_logprobs.detach().double()
                       - engine_logprobs.detach().double(), 0.0)
    ratio = torch.exp(diff)
    k3 = torch.where(mask, ratio - 1.0 - diff, 0.0)
    low, high = (math.log(bound) for bound in MISMATCH_BOUNDS)
    outside = mask & ((diff < low) | (diff > high))
    absolute = diff.abs()
    largest = absolute.amax() if absolute.numel() else absolute.new_zeros(())
    return torch.stack([mask.sum().double(), absolute.sum(), largest, k3.sum(),
                        outside.sum().double()])


def mismatch_summary(sums: list[float] | Tensor) -> dict[str, float | None]:
    """The record's figures from (possibly added-up) sums: None where no token was measured
    (a batch holding no token of the trainer's current version)."""
    values = dict(zip(MISMATCH_SUMS, [float(v) for v in sums]))
    tokens = values["tokens"]
    if tokens <= 0:
        return {"mismatch_tokens": 0, "mismatch_abs_mean": None, "mismatch_abs_max": None,
                "mismatch_k3": None, "mismatch_outside_fraction": None}
    return {
        "mismatch_tokens": int(tokens),
        "mismatch_abs_mean": values["abs_diff_sum"] / tokens,
        "mismatch_abs_max": values["abs_diff_max"],
        "mismatch_k3": values["k3_sum"] / tokens,
        "mismatch_outside_fraction": values["outside"] / tokens,
    }
