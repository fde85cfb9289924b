"""How stale a trajectory is, as pure arithmetic.

With staleness bound η, every sample the trainer consumes at version v must have been started by a
policy no older than v − η (AReaL's rule). The bound is enforced at admission by the buffer's
ACQUIRE script (asyncrl.buffer.scripts), the gate formula's one owner, atomically in Redis across
every rollout replica; the tests hold it to an oracle (tests/support/gate_oracle.py). What the
trainer measures afterwards, a consumed trajectory's staleness, is here.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import Tensor

__all__ = ["staleness"]


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

