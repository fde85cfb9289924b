"""The rollout autoscaler's reconcile against a real control plane (tests/cluster), in this
process: a module of its own, so that no operator process of another test's reconciles the same
jobs meanwhile (as one leader does in a cluster)."""

from __future__ import annotations

import pytest

from support.operator_cluster import (  # noqa: F401 - fixtures among them
    crd,
    create_job,
    events_about,
    kube,
    manifest,
    namespace,
    patch_spec,
    read_job,
    status_of,
)

pytestmark = pytest.mark.slow


def test_the_autoscaler_rescales_the_rollout_and_kubectl_scale_turns_it_off(kube, crd, namespace,
                                                                           monkeypatch):
    """The operator's reconcile and status refresh, in this process against the real API
    server, given the figures its gRPC calls would fetch (kwok pods run nothing), on a clock
    of the test's own: a trainer waiting 60% of the time beside fully busy engines scales the
    rollout Deployment out, with status and an Event saying why; `kubectl scale` then turns
    autoscaling off, and a new autoscale section turns it on again."""
    from asyncrl.operator import autoscaling
    from asyncrl.operator import kube as operator_kube
    from asyncrl.operator.observe import Figures
    from asyncrl.operator.reconcile import reconcile, refresh_status
    from asyncrl.operator.state import OperatorState
    from asyncrl.operator.status import TrainerStatus

    monkeypatch.setattr(operator_kube, "CLIENTS", operator_kube.Clients(kube.api))
    now = [1000.0]
    monkeypatch.setattr(autoscaling, "clock", lambda: now[0])
    state = OperatorState(buffer_stats=False)
    name = "scaled"
    create_job(kube, manifest(name, namespace, rollout__autoscale={
        "maxReplicas": 4, "cooldownSeconds": 30}))
    reconcile(state, read_job(kube, namespace, name))

    def replicas() -> int:
        return kube.apps.read_namespaced_deployment(f"{name}-rollout", namespace).spec.replicas

    def figures(step: int) -> Figures:
        seconds = now[0] - 1000.0
        return Figures(trainer=TrainerStatus(step=step, phase="training",
                                             waited_seconds_total=5.0 + 0.6 * seconds),
                       rollout_busy={f"{name}-rollout-0": 2.0 + seconds})

    assert replicas() == 1
    assert status_of(kube, namespace, name)["autoscaling"]["reason"] == "CollectingSignals"
    events_about(kube, namespace, name, "AutoscalingOn")
    refresh_status(state, read_job(kube, namespace, name), figures(1))
    now[0] += 40
    before_scaling = read_job(kube, namespace, name)
    refresh_status(state, read_job(kube, namespace, name), figures(6))

    scaling = status_of(kube, namespace, name)["autoscaling"]
    assert (scaling["active"], scaling["replicas"], scaling["reason"]) == (True, 2, "ScaledOut")
    assert (scaling["trainerIdle"], scaling["rolloutBusy"], scaling["demand"]) == (0.6, 1.0, 2.25)
    assert replicas() == 2  # at once, not at the next reconcile
    events = events_about(kube, namespace, name, "ScaledOut")
    [scaled] = [e for e in events if e.reason == "ScaledOut"]
    assert scaled.message.startswith("1 -> 2 rollout replicas: over 40 s the trainer waited 60%")
    # The spec is the user's: it still says the count the job started with.
    assert read_job(kube, namespace, name)["spec"]["rollout"]["replicas"] == 1

    # A reconcile handed the body from before that decision (kopf's, for an event that came
    # while the job's lock was held) decides from the status as stored: within the cooldown,
    # the same signals scale nothing again and post no second Event.
    for _ in range(2):
        now[0] += 10
        refresh_status(state, read_job(kube, namespace, name), figures(7))
    reconcile(state, before_scaling)
    assert status_of(kube, namespace, name)["autoscaling"]["replicas"] == 2
    assert len([e for e in events_about(kube, namespace, name, "ScaledOut")
                if e.reason == "ScaledOut"]) == 1

    # kubectl scale rljob/scaled --replicas=3: the hand wins, and autoscaling is off.
    kube.custom.patch_namespaced_custom_object_scale(
        "asyncrl.io", "v1alpha1", namespace, "rljobs", name, {"spec": {"replicas": 3}},
        _content_type="application/merge-patch+json")
    reconcile(state, read_job(kube, namespace, name))
    scaling = status_of(kube, namespace, name)["autoscaling"]
    assert (scaling["active"], scaling["reason"], scaling["replicas"]) == (False, "ScaledByHand", 3)
    assert replicas() == 3
    events_about(kube, namespace, name, "AutoscalingOff")

    # A new autoscale section: the autoscaler is back, from the current count.
    patch_spec(kube, namespace, name, {"rollout": {"autoscale": {"maxReplicas": 6}}})
    reconcile(state, read_job(kube, namespace, name))
    scaling = status_of(kube, namespace, name)["autoscaling"]
    assert (scaling["active"], scaling["replicas"]) == (True, 3)
    assert scaling["reason"] == "CollectingSignals", scaling
    assert replicas() == 3
    assert len([e for e in events_about(kube, namespace, name, "AutoscalingOn")
                if e.reason == "AutoscalingOn"]) == 2
