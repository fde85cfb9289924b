"""What an evaluation's accuracy is worth: the share of held-out problems solved and its
standard error, sqrt(p (1 - p) / n) (binomial). At n = 160 problems one standard error is at
most 4 points (p = 0.5), at n = 32 it was up to 9."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["accuracy_record", "standard_error"]


def standard_error(accuracy: float, problems: int) -> float:
    """One standard error of an accuracy measured on `problems` problems."""
    if problems <= 0:
        raise ValueError(f"problems must be > 0, got {problems}")
    return math.sqrt(max(accuracy * (1.0 - accuracy), 0.0) / problems)


def accuracy_record(scores: Sequence[float]) -> dict:
    """{eval_accuracy, eval_stderr, eval_problems} of per-problem scores in [0, 1]."""
    if not scores:
        raise ValueError("an evaluation needs at least one scored problem")
    accuracy = sum(scores) / len(scores)
    return {"eval_accuracy": accuracy, "eval_stderr": standard_error(accuracy, len(scores)),
            "eval_problems": len(scores)}
