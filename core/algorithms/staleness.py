"""AReaL's staleness bound as pure arithmetic.

With staleness bound η, every sample the trainer consumes at version v must have been started by a
policy no older than v − η. AReaL enforces this at admission: a new rollout may start only while
``(η + trainer_version + 1) · batch_size − (accepted + running) > 0``. The buffer service applies
this rule atomically across all rollout replicas; the arithmetic lives here so it can be tested
alone.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

__all__ = ["rollout_capacity", "staleness"]


def rollout_capacity(
    *,
    max_staleness: int,
    trainer_version: int,
    batch_size: int,
    accepted: int,
    running: int,
    max_concurrent: int | None = None,
) -> int:
    """How many new rollouts (groups) may start now; never negative.

    ``batch_size`` is groups per training step, ``accepted`` counts groups ever accepted into the
    buffer and not dropped as too stale (a dropped group's place is generated again),
    ``running`` counts granted slots whose group has not been put yet, and
    ``max_concurrent`` optionally caps how many may run at once.
    """
    _check_non_negative(
        max_staleness=max_staleness,
        trainer_version=trainer_version,
        accepted=accepted,
        running=running,
    )
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    capacity = (max_staleness + trainer_version + 1) * batch_size - (accepted + running)
    if max_concurrent is not None:
        _check_non_negative(max_concurrent=max_concurrent)
        capacity = min(capacity, max_concurrent - running)
    return max(capacity, 0)


def staleness(trainer_version: int, token_versions: Iterable[int] | Tensor) -> int:
    """Versions between the trainer and a trajectory's *oldest* generated token.

    An interrupted rollout resumes under new weights, so one trajectory can hold tokens of
    several versions; the oldest one bounds how off-policy it is. Pass the versions of generated
    tokens only: prompt tokens have no version (engines often mark them -1), which is rejected.
    """
    _check_non_negative(trainer_version=trainer_version)
    if isinstance(token_versions, Tensor):
        if token_versions.numel() == 0:
            raise ValueError("token_versions is empty; a trajectory needs at least one token")
        oldest = int(token_versions.min())
    else:
        versions = list(token_versions)
        if not versions:
            raise ValueError("token_versions is empty; a trajectory needs at least one token")
        oldest = min(int(v) for v in versions)
    if oldest < 0:
        raise ValueError(
            f"token_versions contains {oldest}; pass the versions of generated tokens only "
            "(prompt tokens have no version)"
        )
    if oldest > trainer_version:
        raise ValueError(
            f"token_versions are all newer than trainer_version={trainer_version} "
            f"(oldest is {oldest}); no policy version can be ahead of the trainer"
        )
    return trainer_version - oldest


def _check_non_negative(**values: int) -> None:
    for name, value in values.items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")

