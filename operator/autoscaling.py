"""The rollout autoscaler in the cluster: spec.rollout.autoscale, decided by the rule of
asyncrl.algorithms.autoscale over what the operator observes, kept in status.autoscaling.

Who sets the rollout replicas:

- The autoscaler, while status.autoscaling.active: the rollout Deployment gets
  status.autoscaling.replicas, and spec.rollout.replicas is the count the job started with.
- A person, once spec.rollout.replicas differs from the value the autoscaler took over with
  (`kubectl scale rljob/...` writes it through the scale subresource): autoscaling turns off
  (reason ScaledByHand, an Event says so) and spec.rollout.replicas rules, until the autoscale
  section itself changes, which turns it on again from the current count.
- An external scaler (autoscale.scaler: external): the operator computes the signal only (in
  status and as its metric) and spec.rollout.replicas rules; a HorizontalPodAutoscaler or KEDA
  writes it through the scale subresource.

The readings of a decision's window are kept in the operator's memory (`AutoscaleMemory`); an
operator that restarts reads them again for a cooldown before its next decision, and takes the
time of the last change from status.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Mapping

from asyncrl.algorithms.autoscale import (
    SCALED_BY_HAND,
    Reading,
    ReadingWindow,
    decide,
    spec_hash,
    window_signals,
)
from asyncrl.operator.status import STAMP, parse_stamp
from asyncrl.spec import RLJob

#: Reasons of status.autoscaling beyond the rule's own.
AUTOSCALING_ON, EXTERNAL, SUSPENDED = "AutoscalingOn", "ExternalScaler", "JobSuspended"

#: When a reading is taken (seconds); tests give the readings a clock of their own.
clock = time.monotonic


@dataclass
class AutoscaleMemory:
    """One job's readings since the autoscaler's last change."""

    window: ReadingWindow = field(default_factory=ReadingWindow)


@dataclass(frozen=True)
class AutoscaleEvent:
    reason: str
    message: str


def settled(job: RLJob, previous: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """status.autoscaling before this observation's decision: who sets the replicas now,
    given the spec and the previous status (see the module's docstring). None without
    rollout.autoscale."""
    autoscale = job.spec.rollout.autoscale
    if autoscale is None:
        return None
    by_spec = job.spec.rollout.replicas
    digest = spec_hash(autoscale)
    base = {"replicas": by_spec, "specReplicas": by_spec, "specHash": digest}
    if autoscale.scaler == "external":
        return {**dict(previous or {}), **base, "active": False, "reason": EXTERNAL,
                "message": "autoscale.scaler is external: the signal is computed, and "
                "spec.rollout.replicas is set by the external scaler"}
    if previous is None or previous.get("specHash") != digest:
        kept = previous["replicas"] if previous and previous.get("active") else by_spec
        start = min(max(kept, autoscale.min_replicas), autoscale.max_replicas)
        return {**base, "active": True, "replicas": start, "reason": AUTOSCALING_ON,
                "message": f"the autoscaler sets the rollout replicas, from {start}, between "
                f"{autoscale.min_replicas} and {autoscale.max_replicas}"}
    if previous.get("active") and by_spec != previous.get("specReplicas"):
        return {**dict(previous), **base, "active": False, "reason": SCALED_BY_HAND,
                "message": f"spec.rollout.replicas was set to {by_spec} by hand (kubectl "
                "scale): autoscaling is off until spec.rollout.autoscale changes"}
    if not previous.get("active"):
        return {**dict(previous), **base}
    return dict(previous)


def rollout_replicas(job: RLJob, autoscaling: Mapping[str, Any] | None) -> int:
    """The replicas the rollout Deployment gets."""
    if autoscaling and autoscaling.get("active"):
        return autoscaling["replicas"]
    return job.spec.rollout.replicas


def with_rollout_replicas(job: RLJob, replicas: int) -> RLJob:
    """`job` with spec.rollout.replicas = `replicas` (what the builders build from)."""
    if replicas == job.spec.rollout.replicas:
        return job
    rollout = job.spec.rollout.model_copy(update={"replicas": replicas})
    return job.model_copy(update={"spec": job.spec.model_copy(update={"rollout": rollout})})


def reading(trainer, rollout_busy: Mapping[str, float] | None) -> Reading | None:
    """A reading from the figures (asyncrl.operator.observe.Figures' trainer and rollout busy
    seconds), None when either is missing."""
    if trainer is None or not rollout_busy:
        return None
    return Reading(clock(), trainer.waited_seconds_total, trainer.step,
                   dict(rollout_busy))


def next_autoscaling(job: RLJob, previous: Mapping[str, Any] | None, memory: AutoscaleMemory,
                     now_reading: Reading | None, now: datetime,
                     ) -> tuple[dict[str, Any] | None, list[AutoscaleEvent]]:
    """status.autoscaling after this observation, and the Events to post: a change of
    replicas, and autoscaling turning off or on."""
    current = settled(job, previous)
    if current is None:
        return None, []
    events = []
    if current["reason"] in (SCALED_BY_HAND, AUTOSCALING_ON, EXTERNAL) and \
            (previous or {}).get("reason") != current["reason"]:
        events.append(AutoscaleEvent(
            "AutoscalingOff" if current["reason"] == SCALED_BY_HAND else current["reason"],
            current["message"]))
    if previous is not None and previous.get("replicas") != current["replicas"]:
        memory.window.restart()  # scaled by someone else: the readings were of other replicas
    if job.spec.suspend:
        memory.window.restart()  # readings of a suspended job say nothing of its needs
        if current.get("active"):
            current.update(reason=SUSPENDED, message="the job is suspended: no decisions")
        return current, events
    if now_reading is not None:
        memory.window.add(now_reading)
    since = None
    if current.get("lastScaleTime"):
        since = (now - parse_stamp(current["lastScaleTime"])).total_seconds()
    decision = decide(job.spec.rollout.autoscale, current["replicas"], memory.window.first,
                      memory.window.last, since)
    signals = (window_signals(memory.window.first, memory.window.last)
               if memory.window.first and memory.window.last else None)
    if signals is not None and decision.demand is not None:
        current.update(trainerIdle=round(signals.trainer_idle, 3),
                       rolloutBusy=round(signals.rollout_busy, 3),
                       demand=round(decision.demand, 3))
    if not current.get("active"):
        return current, events  # the signal only: someone else sets the replicas
    current.update(reason=decision.reason, message=decision.message)
    if decision.scales:
        current.update(replicas=decision.replicas, lastScaleTime=now.strftime(STAMP))
        memory.window.restart()
        events.append(AutoscaleEvent(decision.reason, decision.message))
    return current, events


def wanted_replicas(job: RLJob, autoscaling: Mapping[str, Any] | None) -> int | None:
    """The replicas the signal asks for, within the bounds (the metric an external scaler
    reads); None before the first signal."""
    autoscale = job.spec.rollout.autoscale
    if autoscale is None or not autoscaling or autoscaling.get("demand") is None:
        return None
    current = rollout_replicas(job, autoscaling) if autoscaling.get("active") \
        else job.spec.rollout.replicas
    wanted = math.ceil(current * autoscaling["demand"] - 1e-9)
    return min(max(wanted, autoscale.min_replicas), autoscale.max_replicas)
