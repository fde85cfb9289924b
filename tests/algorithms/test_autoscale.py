"""The rollout autoscaler's rule (asyncrl.algorithms.autoscale), on hand-computed cases."""

import pytest
from pydantic import ValidationError

from asyncrl.algorithms.autoscale import (
    AT_BOUND,
    COOLING_DOWN,
    SCALED_IN,
    SCALED_OUT,
    STEADY,
    WARMING_UP,
    Reading,
    ReadingWindow,
    decide,
    demand,
    spec_hash,
    window_signals,
)
from asyncrl.spec import AutoscaleSpec, parse_manifest
from asyncrl.spec.errors import describe

SPEC = AutoscaleSpec(min_replicas=1, max_replicas=8, cooldown_seconds=60)


def window(idle: float, busy: float, seconds: float = 100.0, workers: int = 2):
    """Readings `seconds` apart in which the trainer waited `idle` of the time and each
    worker's engine generated `busy` of it."""
    names = [f"rollout-{i}" for i in range(workers)]
    first = Reading(1000.0, 50.0, 3, {name: 10.0 for name in names})
    last = Reading(1000.0 + seconds, 50.0 + idle * seconds, 9,
                   {name: 10.0 + busy * seconds for name in names})
    return first, last


def test_window_signals_are_shares_of_the_window():
    first, last = window(0.25, 0.5)
    signals = window_signals(first, last)
    assert (signals.seconds, signals.trainer_idle, signals.rollout_busy) == (100, 0.25, 0.5)
    # A worker seen at one end only does not count; one seen at neither end gives nothing.
    last = Reading(last.time, last.trainer_waited, 9, {**last.rollout_busy, "rollout-9": 90.0})
    assert window_signals(first, last).rollout_busy == 0.5
    assert window_signals(first, Reading(1100.0, 75.0, 9, {"rollout-7": 5.0})) is None
    # A restarted trainer's counter starts again from 0: no signal from such a window.
    assert window_signals(first, Reading(1100.0, 1.0, 1, last.rollout_busy)) is None


@pytest.mark.parametrize("idle, busy, expected", [
    (0.5, 1.0, 1.8),      # (1 - 0.1) / (1 - 0.5), the engines busier than their target
    (0.5, 0.6, 1.35),     # the same, times 0.6 / 0.8: less busy engines gain less from more
    (0.5, 0.2, 1.0),      # engines idle while the trainer waits: not generation's fault
    (1.0, 1.0, 18.0),     # a trainer that only waits: (1 - 0.1) / 0.05 at most
    (0.02, 0.4, 0.5),     # fed trainer, engines at half their target: half the workers
    (0.02, 1.0, 1.0),     # fed trainer, busy engines: as it should be
    (0.07, 0.4, 1.0),     # the dead band between half the idle target and the target
])
def test_demand(idle, busy, expected):
    first, last = window(idle, busy)
    assert demand(SPEC, window_signals(first, last)) == pytest.approx(expected)


@pytest.mark.parametrize("current, idle, busy, replicas, reason", [
    (1, 0.5, 1.0, 2, SCALED_OUT),   # ceil(1 x 1.8)
    (2, 0.5, 1.0, 4, SCALED_OUT),   # ceil(3.6)
    (3, 1.0, 1.0, 6, SCALED_OUT),   # at most twice the current
    (6, 0.5, 1.0, 8, SCALED_OUT),   # at most maxReplicas
    (8, 0.5, 1.0, 8, AT_BOUND),
    (4, 0.02, 0.4, 2, SCALED_IN),   # ceil(4 x 0.5)
    (3, 0.02, 0.4, 2, SCALED_IN),   # ceil(1.5)
    (8, 0.0, 0.08, 4, SCALED_IN),   # at most half: ceil(8 x 0.1) = 1 would be
    (1, 0.0, 0.08, 1, AT_BOUND),    # minReplicas
    (2, 0.02, 0.75, 2, STEADY),     # demand 0.9375: within the tolerance
    (2, 0.5, 0.2, 2, STEADY),
])
def test_decide(current, idle, busy, replicas, reason):
    decision = decide(SPEC, current, *window(idle, busy), since_last_change=None)
    assert (decision.replicas, decision.reason) == (replicas, reason), decision.message
    assert decision.scales == (reason in (SCALED_OUT, SCALED_IN))


def test_a_decision_says_its_signals():
    decision = decide(SPEC, 1, *window(0.5, 1.0), since_last_change=None)
    assert decision.message == ("1 -> 2 rollout replicas: over 100 s the trainer waited 50% "
                                "(target 10%) and the rollout engines generated 100% (target "
                                "80%)")


def test_no_change_before_a_window_of_cooldown_seconds_nor_within_the_cooldown():
    assert decide(SPEC, 1, *window(0.5, 1.0, seconds=59), None).reason == WARMING_UP
    assert decide(SPEC, 1, None, None, None).reason == WARMING_UP
    decision = decide(SPEC, 1, *window(0.5, 1.0), since_last_change=30)
    assert (decision.replicas, decision.reason) == (1, COOLING_DOWN)
    assert decide(SPEC, 1, *window(0.5, 1.0), since_last_change=61).reason == SCALED_OUT


def test_the_window_opens_at_the_trainers_first_step_and_again_after_a_change():
    readings = ReadingWindow()
    readings.add(Reading(0.0, 40.0, 0, {"rollout-0": 1.0}))  # the wait for the first batch
    assert readings.first is None
    step_one = Reading(45.0, 41.0, 1, {"rollout-0": 30.0})
    readings.add(step_one)
    readings.add(Reading(200.0, 60.0, 9, {"rollout-0": 150.0}))
    assert readings.first == step_one and readings.last.time == 200.0
    readings.restart()
    assert readings.first is None and readings.last is None
    restarted = Reading(300.0, 2.0, 1, {"rollout-0": 1.0})
    readings.add(Reading(250.0, 70.0, 11, {"rollout-0": 190.0}))
    readings.add(restarted)  # the trainer restarted: its counter went back
    assert readings.first == restarted


def test_the_spec_hash_follows_the_section():
    assert spec_hash(SPEC) == spec_hash(AutoscaleSpec(max_replicas=8))
    assert spec_hash(SPEC) != spec_hash(AutoscaleSpec(max_replicas=9))


def tiny_with(rollout: dict, trainer: dict | None = None) -> dict:
    from support import ROOT
    import yaml

    manifest = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    manifest["spec"]["rollout"].update(rollout)
    manifest["spec"]["trainer"].update(trainer or {})
    return manifest


@pytest.mark.parametrize("rollout, trainer, field, fix", [
    ({"autoscale": {"minReplicas": 3, "maxReplicas": 2}}, None,
     "spec.rollout.autoscale.minReplicas", "set minReplicas at or below maxReplicas"),
    ({"replicas": 4, "autoscale": {"maxReplicas": 3}}, None,
     "spec.rollout.replicas", "set replicas between 1 and 3"),
    ({"autoscale": {"maxReplicas": 3}}, {"weightTransfer": "distributed"},
     "spec.trainer.weightTransfer", "set trainer.weightTransfer: disk"),
    ({"autoscale": {"minReplicas": 1}}, None, "spec.rollout.autoscale.maxReplicas", ""),
])
def test_bad_autoscale_sections_are_refused_naming_the_field(rollout, trainer, field, fix):
    with pytest.raises(ValidationError) as raised:
        parse_manifest(tiny_with(rollout, trainer))
    text = describe(raised.value)
    assert field in text and fix in text, text


def test_a_good_section_parses_with_its_defaults():
    job = parse_manifest(tiny_with({"replicas": 2, "autoscale": {"maxReplicas": 4}}))
    autoscale = job.spec.rollout.autoscale
    assert (autoscale.min_replicas, autoscale.max_replicas, autoscale.target_trainer_idle,
            autoscale.target_rollout_busy, autoscale.cooldown_seconds) == (1, 4, 0.1, 0.8, 60)
