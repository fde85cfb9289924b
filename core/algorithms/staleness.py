"""AReaL's staleness bound as pure arithmetic.

With staleness bound η, every sample the trainer consumes at version v must have been started by a
policy no older than v − η. AReaL enforces this at admission: a new rollout may start only while
``(η + trainer_version + 1) · batch_size − (accepted − dropped_stale + running) > 0``.

The authority is the buffer's ACQUIRE script (asyncrl.buffer.scripts), which applies the rule
atomically in Redis across every rollout replica. `rollout_capacity` is the same formula over the
same inputs (the job's config and state hashes), for readers and for the workflow's in-process
test gate; tests/buffer/test_buffer_gate_formula.py checks that both grant alike at random states.
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
    dropped_stale: int = 0,
    max_concurrent: int = 0,
) -> int:
    """How many new rollouts (groups) may start now; never negative.

    ``batch_size`` is groups per training step, ``accepted`` counts groups ever accepted into the
    buffer, ``dropped_stale`` those of them the trainer dropped as too stale (never trained:
    their places are given back, or a job whose every slot went to a dropped group would wait
    forever), ``running`` counts granted slots whose group has not been put yet, and
    ``max_concurrent`` caps how many may run at once (0: no cap).
    """
    _check_non_negative(
        max_staleness=max_staleness,
        trainer_version=trainer_version,
        accepted=accepted,
        running=running,
        dropped_stale=dropped_stale,
        max_concurrent=max_concurrent,
    )
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if dropped_stale > accepted:
        raise ValueError(f"dropped_stale ({dropped_stale}) cannot exceed accepted ({accepted})")
    kept = accepted - dropped_stale
    capacity = (max_staleness + trainer_version + 1) * batch_size - (kept + running)
    if max_concurrent:
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

