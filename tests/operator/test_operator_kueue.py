"""Kueue admission against a running Kueue controller manager (tests/cluster/kueue.py) and the
real control plane: RLJobs labelled with a LocalQueue whose ClusterQueue holds one job's
workers at a time. The first runs, the second waits (Queued, its workers at zero, Kueue's
reason in its status) until the first finishes; an evicted job stops its workers and gives its
quota back, and runs again once admitted again; a change of its pods queues it again, and
suspended it asks for no quota."""

from __future__ import annotations

import pytest
from kubernetes.client.exceptions import ApiException

from support.operator_cluster import (  # noqa: F401 - fixtures among them
    crd,
    create_job,
    kube,
    manifest,
    namespace,
    operator,
    patch_spec,
    phase_is,
    pods_of,
    provide_run_volume,
    read_job,
    wait_for,
)

pytestmark = pytest.mark.slow

KUEUE = ("kueue.x-k8s.io", "v1beta2")
FLAVOR, CLUSTER_QUEUE, LOCAL_QUEUE = "asyncrl-flavor", "asyncrl-one-job", "rl"
#: One job's workers (examples/tiny.yaml on the GPU pool): 2.5 CPUs, 6.5 GiB, one GPU. The
#: quota holds one such job, not two (one GPU).
QUOTA = {"cpu": "4", "memory": "10Gi", "nvidia.com/gpu": "1"}


@pytest.fixture(scope="module")
def kueue_controller(control_plane, crd, tmp_path_factory):
    """Kueue running, with a ResourceFlavor and a ClusterQueue (before the operator starts, so
    it finds the Workload resource at once)."""
    from kubernetes import client

    from cluster.kueue import Kueue

    controller = Kueue(control_plane, tmp_path_factory.mktemp("kueue")).start()
    custom = client.CustomObjectsApi(control_plane.api_client())
    custom.create_cluster_custom_object(*KUEUE, "resourceflavors", {
        "apiVersion": "/".join(KUEUE), "kind": "ResourceFlavor",
        "metadata": {"name": FLAVOR}, "spec": {}})
    custom.create_cluster_custom_object(*KUEUE, "clusterqueues", {
        "apiVersion": "/".join(KUEUE), "kind": "ClusterQueue",
        "metadata": {"name": CLUSTER_QUEUE},
        "spec": {"namespaceSelector": {}, "queueingStrategy": "StrictFIFO",
                 "resourceGroups": [{
                     "coveredResources": list(QUOTA),
                     "flavors": [{"name": FLAVOR, "resources": [
                         {"name": name, "nominalQuota": value}
                         for name, value in QUOTA.items()]}]}]}})

    def active():
        queue = custom.get_cluster_custom_object(*KUEUE, "clusterqueues", CLUSTER_QUEUE)
        return any(c["type"] == "Active" and c["status"] == "True"
                   for c in (queue.get("status") or {}).get("conditions") or [])
    wait_for(active, 60, "the ClusterQueue to be active")
    yield controller
    # Kueue's finalizers on the queues are its own to remove: delete them while it runs.
    for plural, name in (("clusterqueues", CLUSTER_QUEUE), ("resourceflavors", FLAVOR)):
        custom.delete_cluster_custom_object(*KUEUE, plural, name)
    controller.stop()


def _workload(kube, namespace: str, job: str) -> dict:
    return kube.custom.get_namespaced_custom_object(*KUEUE, namespace, "workloads",
                                                    f"rljob-{job}")


def _workload_if_any(kube, namespace: str, job: str) -> dict | None:
    """The job's Workload, or None in the moment between the old one's deletion and the new
    one's creation when its pods change."""
    try:
        return _workload(kube, namespace, job)
    except ApiException as error:
        if error.status == 404:
            return None
        raise


def _condition(obj: dict, kind: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or []
                 if c["type"] == kind), {})


def _queued_job(kube, namespace: str, name: str) -> None:
    provide_run_volume(kube, namespace, name)
    data = manifest(name, namespace)
    data["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": LOCAL_QUEUE}
    create_job(kube, data)


def _workers(kube, namespace: str, job: str) -> list[str]:
    return [p.metadata.name for component in ("trainer", "rollout", "reward")
            for p in pods_of(kube, namespace, job, component)]


def test_the_second_job_waits_for_quota_and_an_evicted_job_gives_it_back(
        kube, kueue_controller, operator, namespace):
    kube.custom.create_namespaced_custom_object(*KUEUE, namespace, "localqueues", {
        "apiVersion": "/".join(KUEUE), "kind": "LocalQueue",
        "metadata": {"name": LOCAL_QUEUE}, "spec": {"clusterQueue": CLUSTER_QUEUE}})
    _queued_job(kube, namespace, "first")
    wait_for(phase_is(kube, namespace, "first", "Running"), 240, "first to be Running", operator)
    _queued_job(kube, namespace, "second")

    # The first holds the quota: the second is Queued, with Kueue's reason, and no workers.
    wait_for(phase_is(kube, namespace, "second", "Queued"), 60, "second to be Queued", operator)

    def kueues_reason():
        status = kueues_reason.seen = read_job(kube, namespace, "second")["status"]
        admitted = _condition({"status": status}, "Admitted")
        return "insufficient unused quota" in admitted.get("message", "") and status
    kueues_reason.seen = None
    queued = wait_for(kueues_reason, 60, "Kueue's reason in second's status", operator)
    assert queued["phase"] == "Queued"
    assert _condition({"status": queued}, "Admitted")["status"] == "False"
    assert queued["queue"] == {"name": LOCAL_QUEUE, "workload": "rljob-second",
                               "admitted": False}
    assert _workers(kube, namespace, "second") == []
    workload = _workload(kube, namespace, "second")
    assert workload["metadata"]["ownerReferences"][0]["name"] == "second"
    assert {p["name"]: p["count"] for p in workload["spec"]["podSets"]} == \
        {"trainer": 1, "reward": 1, "rollout": 1}
    first = read_job(kube, namespace, "first")["status"]
    assert first["queue"]["admitted"] and first["queue"]["clusterQueue"] == CLUSTER_QUEUE
    assert _workers(kube, namespace, "first")

    # The first finishes (it fails past a deadline): its Workload is Finished, its quota
    # given back, and the second runs.
    patch_spec(kube, namespace, "first", {"activeDeadlineSeconds": 1})
    wait_for(phase_is(kube, namespace, "first", "Failed"), 60, "first to fail", operator)
    wait_for(lambda: _condition(_workload(kube, namespace, "first"), "Finished")
             .get("status") == "True", 30, "first's Workload to be Finished", operator)
    wait_for(phase_is(kube, namespace, "second", "Running"), 240, "second to be Running",
             operator)
    wait_for(lambda: not _workers(kube, namespace, "first"), 60, "first's workers to stop")

    # Evicted (deactivated): the workers stop, the reservation is cleared, the job waits.
    kube.custom.patch_namespaced_custom_object(
        *KUEUE, namespace, "workloads", "rljob-second", {"spec": {"active": False}},
        _content_type="application/merge-patch+json")
    wait_for(phase_is(kube, namespace, "second", "Queued"), 60, "second to be Queued again",
             operator)
    wait_for(lambda: _condition(_workload(kube, namespace, "second"), "QuotaReserved")
             .get("status") == "False", 60, "second's reservation to be cleared", operator)
    wait_for(lambda: not _workers(kube, namespace, "second"), 60, "second's workers to stop")
    # Active again: admitted again, it runs again.
    kube.custom.patch_namespaced_custom_object(
        *KUEUE, namespace, "workloads", "rljob-second", {"spec": {"active": True}},
        _content_type="application/merge-patch+json")
    wait_for(phase_is(kube, namespace, "second", "Running"), 240, "second to run again",
             operator)

    # Its pods change (two rollout replicas, two GPUs: more than the quota): Kueue's pod sets
    # cannot, so it queues again with a new Workload, its workers stopped.
    first_uid = _workload(kube, namespace, "second")["metadata"]["uid"]
    patch_spec(kube, namespace, "second", {"rollout": {"replicas": 2}})

    def requeued():
        workload = requeued.seen = _workload_if_any(kube, namespace, "second")
        if workload is None:
            return False
        counts = {p["name"]: p["count"] for p in workload["spec"]["podSets"]}
        return workload["metadata"]["uid"] != first_uid and counts["rollout"] == 2
    requeued.seen = None
    wait_for(requeued, 60, "a new Workload for second's new pods", operator)
    wait_for(phase_is(kube, namespace, "second", "Queued"), 60, "second to queue again",
             operator)
    wait_for(lambda: not _workers(kube, namespace, "second"), 60, "second's workers to stop")

    # Suspended, it asks for nothing (its Workload inactive); resumed, it queues again.
    patch_spec(kube, namespace, "second", {"suspend": True})
    wait_for(lambda: _workload(kube, namespace, "second")["spec"]["active"] is False, 60,
             "second's Workload to be inactive while it is suspended", operator)
    wait_for(phase_is(kube, namespace, "second", "Suspended"), 60, "second to be Suspended",
             operator)
    patch_spec(kube, namespace, "second", {"suspend": False})
    wait_for(lambda: _workload(kube, namespace, "second")["spec"]["active"] is True, 60,
             "second's Workload to be active again once resumed", operator)
    wait_for(phase_is(kube, namespace, "second", "Queued"), 60, "second to queue again",
             operator)
