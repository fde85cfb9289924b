"""Kueue admission's rules without a cluster (asyncrl.operator.kueue): the Workload a queued
job asks for, what each state of a Workload means for the job, the status writes that give
quota back, and the job's phase and workers while it waits. tests/operator/test_operator_kueue.py
runs the same against a running Kueue."""

from __future__ import annotations

from datetime import datetime, timezone

import yaml

from asyncrl.operator import kueue
from asyncrl.operator.builders import OperatorConfig
from asyncrl.operator.lifetime import as_applied
from asyncrl.operator.status import Observation, Workload, compute_status
from asyncrl.spec import parse_manifest
from support import ROOT

AT = datetime(2026, 11, 30, 12, 0, 0, tzinfo=timezone.utc)
QUEUED = {"kueue.x-k8s.io/queue-name": "team-a"}


def job(**rollout):
    data = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    data["metadata"]["namespace"] = "ns"
    data["spec"]["rollout"].update(rollout)
    return parse_manifest(data)


def body(labels=None, status=None, generation=1):
    return {"metadata": {"name": "tiny", "namespace": "ns", "uid": "u-1",
                         "generation": generation, "labels": labels or {}},
            "status": status or {}}


def workload(*conditions, cluster_queue=None):
    return {"metadata": {"name": "rljob-tiny", "namespace": "ns", "resourceVersion": "7"},
            "status": {"conditions": [
                {"type": kind, "status": value, "reason": reason, "message": message,
                 "lastTransitionTime": "2026-11-30T11:00:00Z"}
                for kind, value, reason, message in conditions],
                **({"admission": {"clusterQueue": cluster_queue}} if cluster_queue else {})}}


def test_the_workload_asks_for_the_workers_pods_and_is_owned_by_the_job():
    built = kueue.build_workload(job(replicas=2), body(QUEUED), OperatorConfig())
    assert built["metadata"]["name"] == "rljob-tiny"
    assert built["metadata"]["ownerReferences"] == [{
        "apiVersion": "asyncrl.io/v1alpha1", "kind": "RLJob", "name": "tiny", "uid": "u-1",
        "controller": True, "blockOwnerDeletion": True}]
    assert built["spec"]["queueName"] == "team-a" and built["spec"]["active"] is True
    assert built["metadata"]["annotations"] == {"asyncrl.io/job-generation": "1"}
    sets = {p["name"]: p for p in built["spec"]["podSets"]}
    # Redis and the buffer keep the job's state and are not asked for.
    assert {name: p["count"] for name, p in sets.items()} == \
        {"trainer": 1, "reward": 1, "rollout": 2}
    (trainer,) = sets["trainer"]["template"]["spec"]["containers"]
    assert trainer["resources"]["requests"] == {"cpu": "1", "memory": "4Gi"}


def test_a_suspended_job_asks_for_no_quota():
    data = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    data["metadata"]["namespace"] = "ns"
    data["spec"]["suspend"] = True
    built = kueue.build_workload(parse_manifest(data), body(QUEUED), OperatorConfig())
    # Inactive: Kueue evicts it (or never admits it); the pods it would run are still named.
    assert built["spec"]["active"] is False
    assert {p["name"] for p in built["spec"]["podSets"]} == {"trainer", "reward", "rollout"}


def test_with_autoscale_the_quota_holds_the_most_rollout_replicas():
    scaled = job(replicas=1, autoscale={"minReplicas": 1, "maxReplicas": 4})
    sets = {p["name"]: p["count"] for p in kueue.pod_sets(scaled, OperatorConfig())}
    assert sets["rollout"] == 4


def test_what_each_state_of_the_workload_means_for_the_job():
    none = kueue.read_admission("team-a", "rljob-tiny", None)
    assert not none.exists and not none.admitted
    pending = kueue.read_admission("team-a", "rljob-tiny", workload(
        ("QuotaReserved", "False", "Pending", "couldn't assign flavors to pod set rollout: "
         "insufficient unused quota for nvidia.com/gpu")))
    assert (pending.admitted, pending.reason) == (False, "Pending")
    assert "insufficient unused quota" in pending.message
    admitted = kueue.read_admission("team-a", "rljob-tiny", workload(
        ("QuotaReserved", "True", "QuotaReserved", "Quota reserved in ClusterQueue cq"),
        ("Admitted", "True", "Admitted", "The workload is admitted"), cluster_queue="cq"))
    assert (admitted.admitted, admitted.cluster_queue, admitted.evicted) == (True, "cq", None)
    evicted = kueue.read_admission("team-a", "rljob-tiny", workload(
        ("QuotaReserved", "True", "QuotaReserved", ""), ("Admitted", "True", "Admitted", ""),
        ("Evicted", "True", "Preempted", "Preempted to accommodate a higher priority Workload")))
    assert (evicted.admitted, evicted.evicted, evicted.reason) == (False, "Preempted", "Preempted")
    finished = kueue.read_admission("team-a", "rljob-tiny", workload(
        ("QuotaReserved", "True", "QuotaReserved", ""), ("Admitted", "True", "Admitted", ""),
        ("Finished", "True", "Succeeded", "The RLJob succeeded.")))
    assert (finished.admitted, finished.finished, finished.reason) == (False, True, "Succeeded")
    assert admitted.as_status() == {"name": "team-a", "workload": "rljob-tiny",
                                    "admitted": True, "clusterQueue": "cq"}


def test_finishing_and_releasing_write_the_conditions_kueue_reads():
    admitted = workload(("QuotaReserved", "True", "QuotaReserved", ""),
                        ("Admitted", "True", "Admitted", ""))
    done = kueue.finished_status(admitted, False, "The RLJob failed: DeadlineExceeded.", AT)
    finished = {c["type"]: c for c in done["conditions"]}["Finished"]
    assert (finished["status"], finished["reason"], finished["lastTransitionTime"]) == \
        ("True", "Failed", "2026-11-30T12:00:00Z")
    evicted = workload(("QuotaReserved", "True", "QuotaReserved", ""),
                       ("Admitted", "True", "Admitted", ""),
                       ("Evicted", "True", "Deactivated", "The workload is deactivated"))
    released = kueue.released_status(evicted, AT)
    assert released["admission"] is None
    by_type = {c["type"]: c for c in released["conditions"]}
    assert (by_type["QuotaReserved"]["status"], by_type["QuotaReserved"]["reason"]) == \
        ("False", "Pending")
    assert (by_type["Admitted"]["status"], by_type["Admitted"]["reason"]) == \
        ("False", "NoReservation")
    # Deactivated: Kueue itself requeues it once it is active again.
    assert (by_type["Requeued"]["status"], by_type["Requeued"]["reason"]) == \
        ("False", "Deactivated")
    assert by_type["Evicted"] == {c["type"]: c for c in evicted["status"]["conditions"]}["Evicted"]


def test_a_queued_job_keeps_its_workers_at_zero_until_admitted():
    spec = job()
    assert as_applied(spec, body()) is spec  # not queued
    assert as_applied(spec, body(QUEUED)).spec.suspend is True  # no status yet
    waiting = body(QUEUED, {"queue": {"name": "team-a", "workload": "rljob-tiny",
                                      "admitted": False}})
    assert as_applied(spec, waiting).spec.suspend is True
    running = body(QUEUED, {"queue": {"name": "team-a", "workload": "rljob-tiny",
                                      "admitted": True}})
    assert as_applied(spec, running) is spec
    # Done at its spec: the workers stop, then the Workload is marked Finished.
    succeeded = body(QUEUED, {"phase": "Succeeded", "observedGeneration": 1,
                              "queue": {"name": "team-a", "workload": "rljob-tiny",
                                        "admitted": True}})
    assert kueue.done_at_spec(succeeded) and as_applied(spec, succeeded).spec.suspend is True
    edited = {**succeeded, "metadata": {**succeeded["metadata"], "generation": 2}}
    assert not kueue.done_at_spec(edited) and as_applied(spec, edited) is spec


def test_a_queued_job_is_queued_with_kueues_reason_and_its_deadline_waits():
    waiting = kueue.Admission("team-a", "rljob-tiny", exists=True, reason="Pending",
                              message="insufficient unused quota for nvidia.com/gpu")
    workloads = tuple(Workload(c, 0, exists=True, current=True)
                      for c in ("redis", "buffer", "trainer", "rollout", "reward"))
    observed = Observation(generation=1, suspend=False, max_steps=10, workloads=workloads,
                           active_deadline_seconds=60, queue=waiting, now=AT)
    status = compute_status(observed, {"startTime": "2026-11-30T10:00:00Z"})
    assert status["phase"] == "Queued"
    assert status["startTime"] is None and status["failure"] is None
    admitted = {c["type"]: c for c in status["conditions"]}["Admitted"]
    assert (admitted["status"], admitted["reason"], admitted["message"]) == \
        ("False", "Pending", "insufficient unused quota for nvidia.com/gpu")
    assert status["queue"]["admitted"] is False
