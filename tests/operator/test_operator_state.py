"""What the operator keeps in memory (asyncrl.operator.state), without a cluster: which child
events become work for their job, how a burst of them is coalesced, and what a deleted job
leaves behind (nothing)."""

from __future__ import annotations

import asyncio
import logging

from asyncrl.operator.builders import JOB_LABEL, OperatorConfig
from asyncrl.operator.state import ChildEvents, JobRegistry, OperatorState
from asyncrl.operator.status import Observation, Workload

JOB = ("ml", "tiny")


def child(kind: str, uid: str, *, generation: int | None = 1, component: str = "buffer",
          status: dict | None = None) -> dict:
    return {"kind": kind, "metadata": {
        "namespace": "ml", "name": f"tiny-{component}", "uid": uid, "generation": generation,
        "labels": {JOB_LABEL: "tiny", "app.kubernetes.io/component": component}},
        "status": status or {}}


def test_the_initial_listing_and_a_new_child_are_no_work():
    events = ChildEvents({})
    events.note({"type": None}, child("Deployment", "d"))
    events.note({"type": "ADDED"}, child("ConfigMap", "c", component="config"))
    assert events.pending == {}
    assert events.generations["d"] == (JOB, 1)


def test_a_changed_child_without_status_is_drift_and_a_deleted_one_is_re_created():
    events = ChildEvents({})
    events.note({"type": "MODIFIED"}, child("ConfigMap", "c", component="config"))
    assert events.pending == {JOB: True}
    events = ChildEvents({})
    events.note({"type": "DELETED"}, child("Service", "s"))
    assert events.pending == {JOB: True}
    events = ChildEvents({})
    events.note({"type": "DELETED"}, child("Pod", "p", component="trainer"))
    assert events.pending == {JOB: False}  # its workload re-creates a pod


def test_a_workloads_counts_refresh_the_status_and_its_new_spec_reconciles():
    observed = {JOB: Observation(generation=1, suspend=False, max_steps=10, workloads=(
        Workload("buffer", 1, exists=True, replicas=1, ready=0, updated=1),))}
    events = ChildEvents(observed)
    same = {"replicas": 1, "readyReplicas": 0, "updatedReplicas": 1, "observedGeneration": 1}
    events.note({"type": None}, child("Deployment", "d", status=same))
    events.note({"type": "MODIFIED"}, child("Deployment", "d", status=same))
    assert events.pending == {}  # nothing the status is made from moved
    events.note({"type": "MODIFIED"}, child("Deployment", "d", status={**same, "readyReplicas": 1}))
    assert events.pending == {JOB: False}
    events.note({"type": "MODIFIED"}, child("Deployment", "d", generation=2, status=same))
    assert events.pending == {JOB: True}


def test_a_trainer_pod_counts_only_when_its_phase_or_restarts_move():
    events = ChildEvents({})
    running = {"phase": "Running", "containerStatuses": [{"restartCount": 0}]}
    events.note({"type": "MODIFIED"}, child("Pod", "p", component="trainer", status=running))
    assert events.pending == {JOB: False}
    events.pending.clear()
    events.note({"type": "MODIFIED"}, child("Pod", "p", component="trainer", status=running))
    assert events.pending == {}
    restarted = {"phase": "Running", "containerStatuses": [{"restartCount": 1}]}
    events.note({"type": "MODIFIED"}, child("Pod", "p", component="trainer", status=restarted))
    assert events.pending == {JOB: False}


def test_a_crash_looping_pod_of_any_component_counts_at_each_restart():
    """A crash-looping rollout pod stays not ready (its Deployment's counts do not move) while
    its restarts mount past spec.backoffLimit: each restart must reach the job's status."""
    events = ChildEvents({})
    for restarts in (6, 7):
        looping = {"phase": "Running", "containerStatuses": [{
            "restartCount": restarts, "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]}
        events.note({"type": "MODIFIED"}, child("Pod", "p", component="rollout", status=looping))
        assert events.pending == {JOB: False}, restarts
        events.pending.clear()


def test_a_trainer_pods_init_container_exit_counts():
    """The model download runs in an init container; its failure is in initContainerStatuses."""
    events = ChildEvents({})
    running = {"phase": "Pending", "initContainerStatuses": [{
        "restartCount": 0, "state": {"running": {}}}]}
    events.note({"type": "MODIFIED"}, child("Pod", "p", component="trainer", status=running))
    events.pending.clear()
    exited = {"phase": "Pending", "initContainerStatuses": [{
        "restartCount": 0, "state": {"terminated": {"exitCode": 1, "reason": "Error"}}}]}
    events.note({"type": "MODIFIED"}, child("Pod", "p", component="trainer", status=exited))
    assert events.pending == {JOB: False}


def test_a_burst_of_events_is_one_piece_of_work_per_job():
    events = ChildEvents({}, settle_seconds=0.05)
    done: list[tuple[str, str, bool]] = []

    async def burst() -> None:
        task = asyncio.create_task(events.run(lambda *work: done.append(work),
                                              logging.getLogger("test")))
        await asyncio.sleep(0)  # run() is waiting for its first wake-up
        events.note({"type": "DELETED"}, child("Pod", "p", component="trainer"))
        events.note({"type": "MODIFIED"}, child("ConfigMap", "c", component="config"))
        events.note({"type": "DELETED"}, child("Pod", "q", component="trainer"))
        await asyncio.sleep(0.3)
        task.cancel()

    asyncio.run(burst())
    assert done == [("ml", "tiny", True)]


def test_accepted_rate_is_per_second_since_the_last_reading():
    registry = JobRegistry()
    assert registry.accepted_rate("uid", 10, now=100.0) is None
    assert registry.accepted_rate("uid", 30, now=110.0) == 2.0
    assert registry.accepted_rate("uid", 30, now=110.0) is None  # no time passed
    assert registry.accepted_rate("uid", 0, now=120.0) == 0.0  # a reset buffer: never negative


def test_a_forgotten_job_leaves_nothing_behind():
    registry = JobRegistry()
    lock = registry.lock(JOB)
    assert registry.lock(JOB) is lock
    registry.remember(JOB, object(), Observation(generation=1, suspend=False, max_steps=1))
    registry.accepted_rate("uid", 1, now=1.0)
    registry.child_events.note({"type": "MODIFIED"}, child("ConfigMap", "c", component="config"))
    registry.forget(*JOB, "uid")
    assert not registry.jobs and not registry.observed
    assert not registry.child_events.pending and not registry.child_events.generations
    assert registry.accepted_rate("uid", 5, now=2.0) is None
    assert registry.lock(JOB) is not lock


def test_flags_override_the_environments_settings(monkeypatch):
    monkeypatch.setenv("ASYNCRL_OPERATOR_INTERVAL", "3")
    monkeypatch.setenv("ASYNCRL_OPERATOR_BUFFER_STATS", "0")
    state = OperatorState()
    assert (state.interval, state.resync_interval, state.buffer_stats) == (3.0, 600.0, False)
    config = OperatorConfig(image="example.org/asyncrl:test")
    state.configure(config, resync_interval=5, buffer_stats=True)
    assert (state.config, state.interval, state.resync_interval, state.buffer_stats) == \
        (config, 3.0, 5, True)
