"""The tests' oracle for the staleness gate: AReaL's admission rule as plain Python.

The gate has one owner, the buffer's ACQUIRE script (asyncrl.buffer.scripts), which applies
the rule atomically in Redis across every rollout replica; no production code computes it
again. This is the same formula over the same inputs (the job's config and state hashes),
written out so tests can say what the script must grant: tests/buffer/test_buffer_gate_formula.py
holds the script to it at random states, tests/algorithms/test_algorithms_staleness.py holds it
to a hand-computed table, and the workflow's in-process test gate (support.rollout) grants by it.

With staleness bound η, every sample the trainer consumes at version v must have been started by a
policy no older than v − η. AReaL enforces this at admission: a new rollout may start only while
``(η + trainer_version + 1) · batch_size − (accepted − dropped_stale + running) > 0``;
``oversample`` (algorithm.oversampleGroups) adds to the left side: admission only, the bound is
kept where the trainer consumes.
"""

from __future__ import annotations

__all__ = ["rollout_capacity"]


def rollout_capacity(
    *,
    max_staleness: int,
    trainer_version: int,
    batch_size: int,
    accepted: int,
    running: int,
    dropped_stale: int = 0,
    max_concurrent: int = 0,
    oversample: int = 0,
) -> int:
    """How many new rollouts (groups) may start now; never negative.

    ``batch_size`` is groups per training step, ``accepted`` counts groups ever accepted into the
    buffer, ``dropped_stale`` those of them the trainer dropped as too stale (never trained:
    their places are given back, or a job whose every slot went to a dropped group would wait
    forever), ``running`` counts granted slots whose group has not been put yet, and
    ``max_concurrent`` caps how many may run at once (0: no cap), and ``oversample`` groups may
    start beyond the bound.
    """
    for name, value in dict(max_staleness=max_staleness, trainer_version=trainer_version,
                            accepted=accepted, running=running, dropped_stale=dropped_stale,
                            max_concurrent=max_concurrent, oversample=oversample).items():
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if dropped_stale > accepted:
        raise ValueError(f"dropped_stale ({dropped_stale}) cannot exceed accepted ({accepted})")
    kept = accepted - dropped_stale
    capacity = (max_staleness + trainer_version + 1) * batch_size + oversample - (kept + running)
    if max_concurrent:
        capacity = min(capacity, max_concurrent - running)
    return max(capacity, 0)
