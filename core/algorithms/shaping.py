"""Reward shaping the trainer applies before advantages: DAPO's soft overlong punishment.

A response that runs into `rollout.maxNewTokens` is cut before it states an answer and scores 0
whatever its arithmetic; a small model then drifts towards answers that only just fit, and a
step later past the cut. The penalty grows linearly over the last `buffer_tokens` tokens of the
room, from 0 to `factor` at the cut (Yu et al. 2025, DAPO, "soft overlong punishment"):

    penalty(L) = factor * clamp(L - (L_max - buffer), 0, buffer) / buffer

so among right answers the shorter scores more, and a cut response scores below a wrong one
that ended. `buffer_tokens` 0 turns it off.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["overlong_penalties"]


def overlong_penalties(lengths: Tensor, max_new_tokens: int, buffer_tokens: int,
                       factor: float) -> Tensor:
    """Each response's penalty (≥ 0, to subtract from its reward) from its length in tokens."""
    if buffer_tokens <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32)
    if buffer_tokens > max_new_tokens:
        raise ValueError(f"buffer_tokens {buffer_tokens} exceeds max_new_tokens {max_new_tokens}")
    excess = (lengths.to(torch.float32) - (max_new_tokens - buffer_tokens)).clamp(0, buffer_tokens)
    return factor * excess / buffer_tokens
