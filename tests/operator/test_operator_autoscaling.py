"""Who sets the rollout replicas, and what status.autoscaling says
(asyncrl.operator.autoscaling), without a cluster: the autoscaler's decisions, a scale by hand
turning it off, a new autoscale section turning it on, an external scaler, a suspended job."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import yaml

from asyncrl.algorithms.autoscale import Reading
from asyncrl.operator.autoscaling import (
    AutoscaleMemory,
    next_autoscaling,
    rollout_replicas,
    settled,
    wanted_replicas,
    with_rollout_replicas,
)
from asyncrl.spec import parse_manifest
from support import ROOT

NOW = datetime(2026, 11, 29, 12, 0, 0, tzinfo=timezone.utc)


def job(replicas: int = 1, suspend: bool = False, **autoscale):
    data = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    data["metadata"]["namespace"] = "ml"
    data["spec"]["rollout"]["replicas"] = replicas
    data["spec"]["rollout"]["autoscale"] = {"maxReplicas": 4, "cooldownSeconds": 60, **autoscale}
    data["spec"]["suspend"] = suspend
    return parse_manifest(data)


def starving(memory: AutoscaleMemory, seconds: float = 100, workers: int = 1):
    """Fills `memory`'s window with readings in which the trainer waited half the time and
    the engines were always busy; returns the last reading (for the decision)."""
    names = [f"tiny-rollout-{i}" for i in range(workers)]
    memory.window.add(Reading(0.0, 10.0, 2, {name: 5.0 for name in names}))
    return Reading(seconds, 10.0 + seconds / 2, 9, {name: 5.0 + seconds for name in names})


def test_the_autoscaler_starts_from_the_specs_replicas_and_scales_out_saying_why():
    spec = job()
    memory = AutoscaleMemory()
    status, events = next_autoscaling(spec, None, memory, None, NOW)
    assert (status["active"], status["replicas"], status["specReplicas"]) == (True, 1, 1)
    assert [e.reason for e in events] == ["AutoscalingOn"]
    assert status["reason"] == "CollectingSignals"

    status, events = next_autoscaling(spec, status, memory, starving(memory), NOW)
    assert (status["replicas"], status["reason"]) == (2, "ScaledOut")
    assert status["lastScaleTime"] == "2026-11-29T12:00:00Z"
    assert (status["trainerIdle"], status["rolloutBusy"], status["demand"]) == (0.5, 1.0, 1.8)
    [event] = events
    assert event.reason == "ScaledOut" and event.message.startswith("1 -> 2 rollout replicas")
    assert rollout_replicas(spec, status) == 2
    assert memory.window.first is None  # the next window starts after the change


def test_the_cooldown_holds_across_an_operator_restart_through_status():
    spec = job()
    status = {**settled(spec, None), "replicas": 2, "lastScaleTime": "2026-11-29T12:00:00Z"}
    memory = AutoscaleMemory()  # a restarted operator: no readings
    later = NOW + timedelta(seconds=150)
    status, _ = next_autoscaling(spec, status, memory, starving(memory), later - timedelta(
        seconds=120))
    assert (status["replicas"], status["reason"]) == (2, "CoolingDown")
    status, _ = next_autoscaling(spec, status, memory, Reading(200.0, 110.0, 12,
                                                                {"tiny-rollout-0": 205.0}), later)
    assert (status["replicas"], status["reason"]) == (4, "ScaledOut")


def test_a_scale_by_hand_turns_autoscaling_off_until_the_section_changes():
    spec = job()
    memory = AutoscaleMemory()
    status, _ = next_autoscaling(spec, None, memory, None, NOW)
    status, _ = next_autoscaling(spec, status, memory, starving(memory), NOW)
    assert status["replicas"] == 2

    by_hand = job(replicas=3)  # kubectl scale rljob/tiny --replicas=3
    status, events = next_autoscaling(by_hand, status, memory, starving(memory), NOW)
    assert (status["active"], status["reason"], status["replicas"]) == (False, "ScaledByHand", 3)
    assert [e.reason for e in events] == ["AutoscalingOff"]
    assert "until spec.rollout.autoscale changes" in events[0].message
    assert rollout_replicas(by_hand, status) == 3
    # The signal is still computed; nothing is decided, and the Event is not repeated.
    status, events = next_autoscaling(by_hand, status, memory, None, NOW)
    assert (status["active"], status["reason"], events) == (False, "ScaledByHand", [])
    # Scaled by hand again: the spec still rules.
    assert rollout_replicas(job(replicas=1), next_autoscaling(
        job(replicas=1), status, memory, None, NOW)[0]) == 1

    changed = job(replicas=3, maxReplicas=6)  # the section changes: the autoscaler is back
    status, events = next_autoscaling(changed, status, memory, None, NOW)
    assert (status["active"], status["replicas"], status["specReplicas"]) == (True, 3, 3)
    assert [e.reason for e in events] == ["AutoscalingOn"]


def test_a_changed_section_keeps_the_current_count_within_its_new_bounds():
    status = {**settled(job(), None), "replicas": 4}
    assert settled(job(maxReplicas=3), status)["replicas"] == 3
    assert settled(job(maxReplicas=6), status)["replicas"] == 4


def test_an_external_scaler_gets_the_signal_and_sets_the_replicas_itself():
    spec = job(replicas=2, scaler="external")
    memory = AutoscaleMemory()
    status, events = next_autoscaling(spec, None, memory, None, NOW)
    assert (status["active"], status["reason"]) == (False, "ExternalScaler")
    assert [e.reason for e in events] == ["ExternalScaler"]
    status, events = next_autoscaling(spec, status, memory, starving(memory, workers=2), NOW)
    assert (status["replicas"], status["demand"], events) == (2, 1.8, [])
    assert rollout_replicas(spec, status) == 2
    assert wanted_replicas(spec, status) == 4  # ceil(2 x 1.8), the metric's value


def test_a_suspended_job_decides_nothing_and_forgets_its_readings():
    memory = AutoscaleMemory()
    status, _ = next_autoscaling(job(), None, memory, None, NOW)
    status, events = next_autoscaling(job(suspend=True), status, memory, starving(memory), NOW)
    assert (status["replicas"], status["reason"], events) == (1, "JobSuspended", [])
    assert memory.window.first is None


def test_no_autoscale_section_no_status_and_the_spec_rules():
    data = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    spec = parse_manifest(data)
    assert next_autoscaling(spec, None, AutoscaleMemory(), None, NOW) == (None, [])
    assert rollout_replicas(spec, None) == 1
    assert with_rollout_replicas(spec, 1) is spec
    assert with_rollout_replicas(spec, 3).spec.rollout.replicas == 3
