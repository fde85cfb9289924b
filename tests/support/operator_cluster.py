"""The operator against the kwok control plane (tests/operator, tests/chart): its fixtures
(kube, crd, operator, namespace), the operator as a process, and helpers to create, read and
wait for jobs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from asyncrl.spec.crd import build_crd
from support import ROOT, waiting

ASYNCRL = str(Path(sys.executable).parent / "asyncrl")
RESYNC_SECONDS = 2

# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def kube(control_plane):
    from kubernetes import client

    api = control_plane.api_client()
    return type("Kube", (), {
        "api": api, "core": client.CoreV1Api(api), "apps": client.AppsV1Api(api),
        "custom": client.CustomObjectsApi(api),
        "networking": client.NetworkingV1Api(api),
        "ext": client.ApiextensionsV1Api(api),
    })


@pytest.fixture(scope="module")
def crd(kube):
    from kubernetes.client.rest import ApiException

    definition = build_crd()
    try:
        kube.ext.create_custom_resource_definition(definition)
    except ApiException as exc:  # left by the chart tests (the chart keeps its CRD)
        if exc.status != 409:
            raise
        current = kube.ext.read_custom_resource_definition(definition["metadata"]["name"])
        definition["metadata"]["resourceVersion"] = current.metadata.resource_version
        kube.ext.replace_custom_resource_definition(definition["metadata"]["name"], definition)
    wait_for(lambda: any(c.type == "Established" and c.status == "True" for c in (
        kube.ext.read_custom_resource_definition(definition["metadata"]["name"]).status
        .conditions or [])), 30, "the CRD to be established")
    return definition


class OperatorProcess:
    """`asyncrl operator` against the control plane; `interval` None keeps its default."""

    def __init__(self, control_plane, log: Path, interval: float | None = RESYNC_SECONDS):
        self.control_plane, self.log, self.interval = control_plane, log, interval
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        env = {**os.environ, "KUBECONFIG": str(self.control_plane.kubeconfig)}
        handle = open(self.log, "ab")
        interval = ["--interval", str(self.interval)] if self.interval is not None else []
        self.process = subprocess.Popen(
            [ASYNCRL, "operator", *interval,
             "--image", "example.org/asyncrl:test", "--gpu-image", "example.org/asyncrl:test-gpu",
             "--verbose"],
            env=env, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        handle.close()

    def stop(self, sig=signal.SIGTERM) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)

    def check(self) -> None:
        if self.process is None or self.process.poll() is not None:
            raise AssertionError(f"the operator exited:\n{self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:] if self.log.exists() else ""


@pytest.fixture(scope="module")
def operator(control_plane, crd, tmp_path_factory):
    process = OperatorProcess(control_plane, tmp_path_factory.mktemp("operator") / "operator.log")
    process.start()
    yield process
    process.stop()


@pytest.fixture
def namespace(kube):
    name = f"t-{uuid.uuid4().hex[:8]}"
    kube.core.create_namespace({"metadata": {"name": name}})
    # Pods are admitted once the service-account controller has made `default`.
    wait_for(lambda: _exists(lambda: kube.core.read_namespaced_service_account("default", name)),
             30, "the default service account")
    yield name
    # Wait until its pods are gone: they hold the GPU node's fake GPUs, and the next test's
    # GPU pods are scheduled only once they are free. Not for the namespace itself: the
    # namespace controller looks again only after the pods' grace period (~10 s a test), and
    # nothing of it is in the next test's way (no test lists across namespaces).
    kube.core.delete_namespace(name)
    wait_for(lambda: not kube.core.list_namespaced_pod(name).items, 180,
             f"the pods of namespace {name} to be deleted")


# --------------------------------------------------------------------------- helpers


def wait_for(predicate, timeout: float, what: str, operator: OperatorProcess | None = None):
    """support.waiting.wait_for four times a second, failing at once (with its log) if
    `operator` exits; on timeout it shows what the predicate last saw, if it says, and the
    operator's log."""

    def check():
        if operator is not None:
            operator.check()
        return predicate()

    def describe() -> str:
        seen = getattr(predicate, "seen", None)  # what a predicate last looked at, if it says
        detail = [f"last seen: {seen!r}"] if seen is not None else []
        detail += [f"operator log:\n{operator.tail()}"] if operator else []
        return "\n".join(detail)

    return waiting.wait_for(check, timeout, what, describe, every=0.25)


def _exists(read) -> bool:
    from kubernetes.client.rest import ApiException

    try:
        read()
        return True
    except ApiException as exc:
        if exc.status == 404:
            return False
        raise


def manifest(name: str, namespace: str, **spec_changes) -> dict:
    """examples/tiny.yaml with the rollout on the GPU pool (1 GPU per replica)."""
    data = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    data["metadata"] = {"name": name, "namespace": namespace}
    data["spec"]["rollout"]["placement"] = {
        "gpus": 1, "nodeSelector": {"node-pool": "gpu"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]}
    for dotted, value in spec_changes.items():
        node = data["spec"]
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return data


def provide_run_volume(kube, namespace: str, job: str) -> None:
    """What a storage class would do: a volume for the job's run claim (pre-bound to it)."""
    kube.core.create_persistent_volume({
        "metadata": {"name": f"{namespace}-{job}-run"},
        "spec": {"capacity": {"storage": "20Gi"}, "accessModes": ["ReadWriteMany"],
                 "persistentVolumeReclaimPolicy": "Delete", "storageClassName": "",
                 "hostPath": {"path": f"/tmp/asyncrl-test-pv/{namespace}-{job}"},
                 "claimRef": {"namespace": namespace, "name": f"{job}-run"}},
    })


def provide_claim(kube, namespace: str, claim: str) -> None:
    """A claim of the user's, bound to a volume made for it: what a job's dataset.volume or
    reward.python.volume names (the job never creates it)."""
    kube.core.create_persistent_volume({
        "metadata": {"name": f"{namespace}-{claim}"},
        "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"],
                 "persistentVolumeReclaimPolicy": "Delete", "storageClassName": "",
                 "hostPath": {"path": f"/tmp/asyncrl-test-pv/{namespace}-{claim}"},
                 "claimRef": {"namespace": namespace, "name": claim}},
    })
    kube.core.create_namespaced_persistent_volume_claim(namespace, {
        "metadata": {"name": claim},
        "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "",
                 "volumeName": f"{namespace}-{claim}",
                 "resources": {"requests": {"storage": "1Gi"}}},
    })


def create_job(kube, data: dict) -> dict:
    meta = data["metadata"]
    return kube.custom.create_namespaced_custom_object(
        "asyncrl.io", "v1alpha1", meta["namespace"], "rljobs", data)


def read_job(kube, namespace: str, name: str) -> dict:
    return kube.custom.get_namespaced_custom_object("asyncrl.io", "v1alpha1", namespace,
                                                    "rljobs", name)


def patch_spec(kube, namespace: str, name: str, spec: dict) -> None:
    kube.custom.patch_namespaced_custom_object(
        "asyncrl.io", "v1alpha1", namespace, "rljobs", name, {"spec": spec},
        _content_type="application/merge-patch+json")


def status_of(kube, namespace, name) -> dict:
    return read_job(kube, namespace, name).get("status") or {}


def phase_is(kube, namespace, name, phase):
    def check():
        job = read_job(kube, namespace, name)
        status = check.seen = job.get("status") or {}
        current = status.get("observedGeneration") == job["metadata"]["generation"]
        return status.get("phase") == phase and current and status
    check.seen = None
    return check


def events_about(kube, namespace: str, name: str, reason: str, operator=None) -> list:
    """The Events about RLJob `name`, once one with `reason` is there: the operator patches
    the status first and posts the Event after it, so a test that saw the phase may still be
    a moment early for the Event."""

    def posted():
        events = posted.seen = kube.core.list_namespaced_event(
            namespace, field_selector=f"involvedObject.name={name}").items
        return any(e.reason == reason for e in events) and events
    posted.seen = None
    return wait_for(posted, 30, f"an Event {reason} about {name}", operator)


def children(kube, namespace: str, job: str) -> dict[str, list[str]]:
    selector = f"asyncrl.io/job={job}"
    return {
        "ConfigMap": [o.metadata.name for o in kube.core.list_namespaced_config_map(
            namespace, label_selector=selector).items],
        "Secret": [o.metadata.name for o in kube.core.list_namespaced_secret(
            namespace, label_selector=selector).items],
        "Service": sorted(o.metadata.name for o in kube.core.list_namespaced_service(
            namespace, label_selector=selector).items),
        "PersistentVolumeClaim": [o.metadata.name for o in kube.core
                                  .list_namespaced_persistent_volume_claim(
                                      namespace, label_selector=selector).items],
        "Deployment": sorted(o.metadata.name for o in kube.apps.list_namespaced_deployment(
            namespace, label_selector=selector).items),
        "StatefulSet": sorted(o.metadata.name for o in kube.apps.list_namespaced_stateful_set(
            namespace, label_selector=selector).items),
        "NetworkPolicy": sorted(o.metadata.name for o in kube.networking
                                .list_namespaced_network_policy(
                                    namespace, label_selector=selector).items),
        "Pod": sorted(o.metadata.name for o in kube.core.list_namespaced_pod(
            namespace, label_selector=selector).items),
    }


def pods_of(kube, namespace: str, job: str, component: str):
    return kube.core.list_namespaced_pod(
        namespace, label_selector=f"asyncrl.io/job={job},app.kubernetes.io/component={component}"
    ).items


EXPECTED = {
    "ConfigMap": ["{j}-config"], "Secret": ["{j}-redis"],
    "Service": sorted(["{j}-buffer", "{j}-redis", "{j}-reward", "{j}-rollout",
                       "{j}-trainer-headless"]),
    "PersistentVolumeClaim": ["{j}-run"],
    "Deployment": ["{j}-buffer", "{j}-reward", "{j}-rollout"],
    "StatefulSet": ["{j}-redis", "{j}-trainer"],
    "NetworkPolicy": ["{j}-buffer", "{j}-redis", "{j}-reward", "{j}-trainer"],
}


def expected(job: str) -> dict[str, list[str]]:
    return {kind: sorted(n.format(j=job) for n in names) for kind, names in EXPECTED.items()}


def start_running_job(kube, operator, namespace, name="tiny", **changes) -> dict:
    provide_run_volume(kube, namespace, name)
    create_job(kube, manifest(name, namespace, **changes))
    try:
        # Generous: on a loaded machine the volume binding and kwok's pod stages can lag.
        return wait_for(phase_is(kube, namespace, name, "Running"), 240,
                        f"{name} to be Running", operator)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\nnamespace:\n{namespace_state(kube, namespace)}") from None


def namespace_state(kube, namespace: str) -> str:
    """Why pods are not ready, as `kubectl describe` would tell: claims, pods, warnings."""
    lines = [f"claim {c.metadata.name}: {c.status.phase}"
             for c in kube.core.list_namespaced_persistent_volume_claim(namespace).items]
    for pod in kube.core.list_namespaced_pod(namespace).items:
        conditions = ", ".join(f"{c.type}={c.status}" + (f" ({c.reason})" if c.reason else "")
                               for c in pod.status.conditions or [])
        lines.append(f"pod {pod.metadata.name} on {pod.spec.node_name}: {pod.status.phase}; "
                     f"{conditions}")
    events = sorted(kube.core.list_namespaced_event(namespace).items,
                    key=lambda e: e.last_timestamp or e.event_time or e.metadata.creation_timestamp)
    lines += [f"event {e.type} {e.involved_object.kind}/{e.involved_object.name}: {e.reason}: "
              f"{e.message}" for e in events[-15:]]
    return "\n".join(lines) or "(empty)"
