"""AReaL's staleness capacity rule (the tests' oracle for the buffer's gate, support.gate_oracle)
against a hand-computed table, and a trajectory's staleness."""

from __future__ import annotations

import pytest
import torch

from asyncrl.algorithms.staleness import staleness
from support.gate_oracle import rollout_capacity

# (η, trainer_version, batch_size, accepted, running, max_concurrent (0: no cap), expected)
CAPACITY_TABLE = [
    # η = 0: synchronous-like, only the batch for the next step may be in flight.
    (0, 0, 4, 0, 0, 0, 4),  # (0+0+1)*4 - 0
    (0, 0, 4, 2, 2, 0, 0),  # 4 - 4
    (0, 0, 4, 3, 2, 0, 0),  # 4 - 5 = -1, floored at 0
    (0, 2, 4, 10, 1, 0, 1),  # (0+2+1)*4 - 11
    # η = 1: one extra batch may run ahead.
    (1, 0, 4, 0, 0, 0, 8),  # (1+0+1)*4
    (1, 3, 2, 5, 2, 0, 3),  # (1+3+1)*2 - 7
    (1, 0, 4, 6, 1, 16, 1),  # min(8 - 7, 16 - 1): staleness binds
    # η = 4
    (4, 0, 8, 0, 0, 0, 40),  # (4+0+1)*8
    (4, 10, 8, 100, 15, 0, 5),  # (4+10+1)*8 - 115
    (4, 0, 8, 0, 6, 10, 4),  # min(40 - 6, 10 - 6): concurrency binds
    (4, 0, 8, 0, 10, 10, 0),  # concurrency full
    (4, 0, 8, 0, 12, 10, 0),  # more running than allowed (after a scale-down): floored at 0
    (4, 3, 8, 0, 0, 0, 64),  # max_concurrent 0: no cap
]


@pytest.mark.parametrize(
    ("eta", "version", "batch", "accepted", "running", "max_concurrent", "expected"),
    CAPACITY_TABLE,
)
def test_capacity_table(eta, version, batch, accepted, running, max_concurrent, expected):
    got = rollout_capacity(
        max_staleness=eta,
        trainer_version=version,
        batch_size=batch,
        accepted=accepted,
        running=running,
        max_concurrent=max_concurrent,
    )
    assert got == expected
    assert isinstance(got, int)


def test_groups_dropped_as_too_stale_give_their_places_back():
    args = dict(max_staleness=0, trainer_version=1, batch_size=4, accepted=8, running=0)
    assert rollout_capacity(**args) == 0
    assert rollout_capacity(dropped_stale=3, **args) == 3
    with pytest.raises(ValueError, match="dropped_stale"):
        rollout_capacity(dropped_stale=9, **args)


def test_oversampled_groups_start_beside_the_batch_at_eta_0():
    # eta 0, two groups a step: without over-generation a skipped group is replaced only
    # after it finishes; with 6 extra, 8 start at once, still capped by max_concurrent.
    args = dict(max_staleness=0, trainer_version=3, batch_size=2, accepted=6, running=2)
    assert rollout_capacity(**args) == 0
    assert rollout_capacity(oversample=6, **args) == 6
    assert rollout_capacity(oversample=6, max_concurrent=5, **args) == 3
    # an extra group accepted at version 3 is dropped stale at version 4: its place comes back
    assert rollout_capacity(oversample=6, **{**args, "accepted": 9, "running": 5}) == 0
    assert rollout_capacity(oversample=6, dropped_stale=1,
                            **{**args, "trainer_version": 4, "accepted": 9, "running": 5}) == 3
    with pytest.raises(ValueError, match="oversample"):
        rollout_capacity(oversample=-1, **args)


def test_bumping_the_version_opens_one_batch_of_slots():
    args = dict(max_staleness=1, batch_size=4, accepted=5, running=3)
    assert rollout_capacity(trainer_version=0, **args) == 0
    assert rollout_capacity(trainer_version=1, **args) == 4


@pytest.mark.parametrize(
    "name", ["max_staleness", "trainer_version", "accepted", "running", "dropped_stale",
             "max_concurrent"]
)
def test_negative_inputs_are_named(name):
    args = dict(
        max_staleness=1, trainer_version=0, batch_size=4, accepted=0, running=0, dropped_stale=0,
        max_concurrent=8,
    )
    args[name] = -1
    with pytest.raises(ValueError, match=name):
        rollout_capacity(**args)


@pytest.mark.parametrize("batch_size", [0, -2])
def test_batch_size_must_be_positive(batch_size):
    with pytest.raises(ValueError, match="batch_size"):
        rollout_capacity(
            max_staleness=1, trainer_version=0, batch_size=batch_size, accepted=0, running=0
        )


def test_staleness_is_set_by_the_oldest_token():
    assert staleness(5, [5, 5, 5]) == 0
    assert staleness(5, [3, 4, 4, 5]) == 2
    assert staleness(7, torch.tensor([6, 2, 7])) == 5
    assert staleness(0, (0,)) == 0


def test_staleness_errors():
    with pytest.raises(ValueError, match="empty"):
        staleness(3, [])
    with pytest.raises(ValueError, match="empty"):
        staleness(3, torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="prompt tokens"):
        staleness(3, [-1, 2])
    with pytest.raises(ValueError, match="trainer_version"):
        staleness(2, [3, 4])
    with pytest.raises(ValueError, match="trainer_version"):
        staleness(-1, [0])
