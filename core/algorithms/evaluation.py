"""What an evaluation's accuracy is worth: the share of held-out problems solved and its
standard error, sqrt(p (1 - p) / n) (binomial). At n = 160 problems one standard error is at
most 4 points (p = 0.5), at n = 32 it was up to 9. With k sampled responses per problem:
pass@k (unbiased) and maj@k (majority vote over the extracted answers)."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["accuracy_record", "majority_score", "pass_at_k", "standard_error"]


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


def pass_at_k(samples: int, solved: int, k: int) -> float:
    """The unbiased estimate of pass@k from `samples` responses of which `solved` were right
    (Chen et al. 2021, arXiv 2107.03374): 1 - C(n - c, k) / C(n, k)."""
    if not 0 < k <= samples:
        raise ValueError(f"k must be in 1..samples ({samples}), got {k}")
    if not 0 <= solved <= samples:
        raise ValueError(f"solved must be in 0..samples ({samples}), got {solved}")
    if samples - solved < k:
        return 1.0
    return 1.0 - math.comb(samples - solved, k) / math.comb(samples, k)


def majority_score(answers: Sequence[str | None], scores: Sequence[float]) -> float:
    """maj@k of one problem: the best score among the responses that give the most frequent
    answer (ties: the answer given first); responses without an answer do not vote, and 0.0
    when none has one."""
    if len(answers) != len(scores):
        raise ValueError(f"{len(answers)} answers for {len(scores)} scores")
    counts: dict[str, int] = {}
    for answer in answers:
        if answer is not None:
            counts[answer] = counts.get(answer, 0) + 1
    if not counts:
        return 0.0
    winner = max(counts, key=counts.__getitem__)  # the first of the most frequent
    return max(score for answer, score in zip(answers, scores) if answer == winner)
