"""How many rollout replicas a job wants (spec.rollout.autoscale), from two signals over a
window: the share of its time the trainer waited for a batch, and the share of theirs the
rollout engines spent generating (their decode occupancy). One rule for the operator and for
`asyncrl run`, a pure function of what they observe.

The signal is one number, the demand: wanted replicas over current ones, so that
wanted = ceil(current x demand), as a HorizontalPodAutoscaler computes from a metric and its
target.

- The trainer waits more than `targetTrainerIdle`: generation is short. If the rollout's
  throughput grows with its replicas, the trainer is busy (1 - idle) of its time now and
  should be (1 - target): demand (1 - target) / (1 - idle), scaled down by how far the
  engines are from `targetRolloutBusy` (engines that idle while the trainer waits are held
  back by something else: the staleness bound, the reward service), and never below 1.
- The trainer waits less than half its target (a dead band between, so that a change does
  not undo the last one), and the engines are less busy than their target: there are more
  workers than the trainer can take batches from. Demand busy / target, never above 1.
- Otherwise, or within `tolerance` of 1: no change. A change waits `cooldownSeconds` after
  the last one (the window restarts there: older readings describe other replicas), grows
  the replicas at most twofold and shrinks them at most by half, within the bounds.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Mapping

from asyncrl.spec import AutoscaleSpec

#: Reasons, as status and events name them.
SCALED_OUT, SCALED_IN = "ScaledOut", "ScaledIn"
TRAINER_WAITS, WORKERS_IDLE = "TrainerWaitsForData", "RolloutWorkersIdle"
STEADY, COOLING_DOWN, WARMING_UP = "WithinTarget", "CoolingDown", "CollectingSignals"
AT_BOUND = "AtBound"
SCALED_BY_HAND = "ScaledByHand"


@dataclass(frozen=True)
class Reading:
    """Counters of the job at one moment (seconds since any fixed origin)."""

    time: float
    #: The trainer's seconds spent waiting for a batch, over its life.
    trainer_waited: float
    #: The trainer's steps so far.
    trainer_step: int
    #: Each rollout worker's engine: its seconds generating, over its life, by worker name.
    rollout_busy: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Signals:
    """What a window of readings says."""

    seconds: float
    trainer_idle: float
    rollout_busy: float


def window_signals(first: Reading, last: Reading) -> Signals | None:
    """The signals between two readings: None when the window is empty or a counter went
    backwards (a restarted trainer), or no worker was seen at both ends."""
    seconds = last.time - first.time
    waited = last.trainer_waited - first.trainer_waited
    workers = [name for name in last.rollout_busy if name in first.rollout_busy]
    if seconds <= 0 or waited < 0 or not workers:
        return None
    busy = [max(0.0, last.rollout_busy[name] - first.rollout_busy[name]) / seconds
            for name in workers]
    return Signals(seconds, min(1.0, waited / seconds), min(1.0, sum(busy) / len(busy)))


class ReadingWindow:
    """The readings a decision reads: from the first one after the last change (once the
    trainer has stepped: the wait for its first batch is the job starting, not generation
    falling short) to the latest. A counter that went backwards (a restarted trainer) starts
    the window again."""

    def __init__(self) -> None:
        self.first: Reading | None = None
        self.last: Reading | None = None

    def add(self, reading: Reading) -> None:
        if reading.trainer_step < 1:
            return
        if self.first is None or reading.trainer_waited < self.first.trainer_waited:
            self.first = reading
        self.last = reading

    def restart(self) -> None:
        """After a change: the next reading opens the window."""
        self.first = self.last = None


def demand(spec: AutoscaleSpec, signals: Signals) -> float:
    """Wanted over current rollout replicas (see the module's docstring)."""
    idle, busy = signals.trainer_idle, signals.rollout_busy
    occupancy = busy / spec.target_rollout_busy
    if idle > spec.target_trainer_idle:
        short = (1 - spec.target_trainer_idle) / max(1 - idle, 0.05)
        return max(1.0, short * min(1.0, occupancy))
    if idle <= spec.target_trainer_idle / 2:
        return min(1.0, occupancy)
    return 1.0


@dataclass(frozen=True)
class Decision:
    replicas: int
    reason: str
    message: str
    demand: float | None = None

    @property
    def scales(self) -> bool:
        return self.reason in (SCALED_OUT, SCALED_IN)


def decide(spec: AutoscaleSpec, current: int, first: Reading | None, last: Reading | None,
           since_last_change: float | None) -> Decision:
    """The rollout replicas from `current`, given the window's first and last readings and
    the seconds since the last change (None: never changed)."""
    window = window_signals(first, last) if first and last else None
    if window is None or window.seconds < spec.cooldown_seconds or last.trainer_step < 1:
        return Decision(current, WARMING_UP,
                        f"reading the signals until the trainer has stepped and "
                        f"{spec.cooldown_seconds:g} s have passed")
    if since_last_change is not None and since_last_change < spec.cooldown_seconds:
        return Decision(current, COOLING_DOWN, f"{since_last_change:.0f} s since the last "
                        f"change, of cooldownSeconds {spec.cooldown_seconds:g}")
    wanted_share = demand(spec, window)
    said = (f"over {window.seconds:.0f} s the trainer waited {window.trainer_idle:.0%} "
            f"(target {spec.target_trainer_idle:.0%}) and the rollout engines generated "
            f"{window.rollout_busy:.0%} (target {spec.target_rollout_busy:.0%})")
    if abs(wanted_share - 1) <= spec.tolerance:
        return Decision(current, STEADY, said, wanted_share)
    wanted = math.ceil(current * wanted_share - 1e-9)
    wanted = min(wanted, 2 * current, spec.max_replicas)
    wanted = max(wanted, math.ceil(current / 2), spec.min_replicas)
    why = TRAINER_WAITS if wanted_share > 1 else WORKERS_IDLE
    if wanted == current:
        bound = spec.max_replicas if wanted_share > 1 else spec.min_replicas
        return Decision(current, AT_BOUND, f"{said}; {why}, and {current} is the "
                        f"{'maximum' if wanted_share > 1 else 'minimum'} ({bound})",
                        wanted_share)
    reason = SCALED_OUT if wanted > current else SCALED_IN
    return Decision(wanted, reason, f"{current} -> {wanted} rollout replicas: {said}",
                    wanted_share)


def spec_hash(spec: AutoscaleSpec) -> str:
    """A short digest of the autoscale section: a change of it turns autoscaling back on
    after a scale by hand."""
    # Numbers as floats: 60 and 60.0 are the same setting.
    values = {key: value if isinstance(value, str) else float(value)
              for key, value in spec.model_dump(by_alias=True).items()}
    text = json.dumps(values, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]
