"""The learning rate of each training step: linear warm-up, then constant, linear or cosine
decay to a share of the base rate at the last step. A pure function of the step's index, so
a trainer resumed from a checkpoint takes up the schedule where it left off with no state of
its own."""

from __future__ import annotations

import math

__all__ = ["DECAYS", "learning_rate_factor"]

DECAYS = ("constant", "linear", "cosine")


def learning_rate_factor(step: int, max_steps: int, *, warmup_steps: int = 0,
                         decay: str = "constant", final_fraction: float = 0.1) -> float:
    """The factor on the base learning rate for training step `step` (0 for the first of
    `max_steps`). Warm-up: (step + 1) / warmup_steps. After it, decay runs from 1 at the first
    step past warm-up to `final_fraction` at the last step (step max_steps - 1)."""
    if decay not in DECAYS:
        raise ValueError(f"decay must be one of {DECAYS}, got {decay!r}")
    if step < 0 or max_steps < 1:
        raise ValueError(f"need step >= 0 and max_steps >= 1, got {step} and {max_steps}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if decay == "constant":
        return 1.0
    span = max_steps - 1 - warmup_steps
    progress = min((step - warmup_steps) / span, 1.0) if span > 0 else 1.0
    if decay == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return final_fraction + (1.0 - final_fraction) * shape
