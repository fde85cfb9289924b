"""What an idle job costs the API server, measured on the real control plane: the operator's
requests (its User-Agent, and kopf's, in the API server's audit log) while 50 RLJobs sit with
nothing changing, and how a deleted child is repaired with the periodic resync far off.
(Run it with -s to see the figures docs/kubernetes.md quotes.)"""

from __future__ import annotations

import time
import uuid

import pytest
import yaml

from support import ROOT
from support.operator_cluster import OperatorProcess, crd, kube, wait_for  # noqa: F401 - fixtures

pytestmark = pytest.mark.slow

JOBS = 50
IDLE_SECONDS = 60
OPERATOR_AGENTS = ("asyncrl-operator/", "kopf/")


@pytest.fixture(scope="module")
def idle_jobs(control_plane, kube, crd, tmp_path_factory):  # noqa: F811 - fixtures
    namespace = f"idle-{uuid.uuid4().hex[:6]}"
    # Idle means nothing changes: the pods stay Pending on cordoned nodes (kwok's fake nodes
    # also let Ready pods flip to NotReady now and then, a change the operator must follow).
    nodes = [n.metadata.name for n in kube.core.list_node().items]
    for node in nodes:
        kube.core.patch_node(node, {"spec": {"unschedulable": True}})
    kube.core.create_namespace({"metadata": {"name": namespace}})
    template = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    names = [f"idle-{i:02d}" for i in range(JOBS)]
    for name in names:
        body = {**template, "metadata": {"name": name, "namespace": namespace}}
        kube.custom.create_namespaced_custom_object("asyncrl.io", "v1alpha1", namespace,
                                                    "rljobs", body)
    # The operator as a user runs it: its default resync interval.
    operator = OperatorProcess(control_plane, tmp_path_factory.mktemp("idle") / "operator.log",
                               interval=None)
    operator.start()
    try:
        yield operator, namespace, names
    finally:
        operator.stop()
        kube.core.delete_namespace(namespace)
        for node in nodes:
            kube.core.patch_node(node, {"spec": {"unschedulable": False}})


def phases(kube, namespace) -> dict[str, str]:
    items = kube.custom.list_namespaced_custom_object("asyncrl.io", "v1alpha1", namespace,
                                                      "rljobs")["items"]
    return {j["metadata"]["name"]: (j.get("status") or {}).get("phase") for j in items}


def test_an_idle_job_costs_the_api_server_almost_nothing(control_plane, kube, idle_jobs):
    operator, namespace, names = idle_jobs
    wait_for(lambda: all(phases(kube, namespace).values()), 600,
             f"all {JOBS} jobs reconciled", operator)
    # Settled: children created, their pods started (kwok), statuses written; no request of
    # the operator's for a while.
    def quiet() -> bool:
        return not control_plane.requests_from(OPERATOR_AGENTS, since=time.time() - 20)
    wait_for(quiet, 600, "the operator to go quiet", operator)
    started = time.time()
    time.sleep(IDLE_SECONDS)
    operator.check()
    requests = control_plane.requests_from(OPERATOR_AGENTS, since=started)
    per_job_minute = len(requests) / JOBS / (IDLE_SECONDS / 60)
    verbs = sorted({f"{r['verb']} {r['objectRef'].get('resource', '')}" for r in requests})
    print(f"\nidle cost: {len(requests)} requests from the operator in {IDLE_SECONDS}s for "
          f"{JOBS} jobs = {per_job_minute:.2f} per job per minute ({verbs})")
    assert per_job_minute < 1, verbs


def test_a_deleted_child_is_repaired_by_its_watch(control_plane, kube, idle_jobs):
    operator, namespace, names = idle_jobs
    name = f"{names[0]}-buffer"
    before = kube.apps.read_namespaced_deployment(name, namespace).metadata.uid
    deleted = time.monotonic()
    kube.apps.delete_namespaced_deployment(name, namespace)

    def recreated() -> bool:
        try:
            return kube.apps.read_namespaced_deployment(name, namespace).metadata.uid != before
        except Exception:  # noqa: BLE001 - 404 until it is back
            return False

    # The default resync is minutes away: only the watch can bring it back this soon.
    wait_for(recreated, 60, "the deleted Deployment to be re-created", operator)
    print(f"\nrepaired in {time.monotonic() - deleted:.1f}s")
