"""The Helm chart against the real test control plane (tests/cluster): `helm install`, the
installed operator's ServiceAccount and RBAC doing real work, leader election between two
operator replicas, `helm upgrade` and `helm uninstall`.

The chart's operator pod is scheduled onto a kwok node, which runs no containers; the operator
itself runs here as a process with exactly the installed Deployment's arguments and environment
and the installed ServiceAccount's token, so every API call it makes is authorised by the
chart's RBAC and nothing else.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from cluster.control_plane import bin_dir
from support import ROOT
from support.operator_cluster import (  # noqa: F401 - kube is a fixture
    OperatorProcess,
    _exists,
    children,
    events_about,
    expected,
    kube,
    manifest,
    phase_is,
    provide_run_volume,
    wait_for,
)
from support.ports import free_port

pytestmark = pytest.mark.slow

CHART = ROOT / "charts" / "asyncrl"
ASYNCRL = str(Path(sys.executable).parent / "asyncrl")
RELEASE, RELEASE_NAMESPACE = "asyncrl", "asyncrl-system"
OPERATOR = f"{RELEASE}-asyncrl-operator"  # the chart's fullname: Deployment, SA, Lease


@pytest.fixture(scope="module")
def tools(control_plane) -> dict[str, str]:
    directory = bin_dir()
    env = {**os.environ, "KUBECONFIG": str(control_plane.kubeconfig)}
    return {"helm": str(directory / "helm"), "kubectl": str(directory / "kubectl"),
            "env": env}


def run(tools, tool: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run([tools[tool], *args], capture_output=True, text=True, env=tools["env"],
                         timeout=300)
    if check and out.returncode != 0:
        raise AssertionError(f"{tool} {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")
    return out


@pytest.fixture(scope="module")
def release(tools, kube):
    run(tools, "helm", "install", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE,
        "--create-namespace", "--wait", "--timeout", "180s",
        "--set", "operator.statusInterval=2")
    yield RELEASE
    run(tools, "helm", "uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, "--wait",
        check=False)


class ChartOperator(OperatorProcess):
    """`asyncrl operator` as the chart's Deployment runs it, as the chart's ServiceAccount."""

    def __init__(self, control_plane, kube, workdir: Path, name: str):
        super().__init__(control_plane, workdir / f"{name}.log")
        self.kube, self.name = kube, name
        self.kubeconfig = workdir / f"{name}.kubeconfig"

    def start(self) -> ChartOperator:
        deployment = self.kube.apps.read_namespaced_deployment(OPERATOR, RELEASE_NAMESPACE)
        (container,) = deployment.spec.template.spec.containers
        env = {**os.environ, "KUBECONFIG": str(self._write_kubeconfig(deployment))}
        for item in container.env:
            if item.value is not None:
                env[item.name] = item.value
        env["POD_NAME"], env["POD_NAMESPACE"] = self.name, RELEASE_NAMESPACE
        env.pop("HOME", None)  # the pod's /tmp home; here the test's own is fine
        # Each pod has its own network; these processes share this machine's.
        if "ASYNCRL_OPERATOR_METRICS_PORT" in env:
            env["ASYNCRL_OPERATOR_METRICS_PORT"] = str(free_port())
        args = [a for a in container.args if not a.startswith("--liveness")]
        args.append(f"--liveness=http://127.0.0.1:{free_port()}/healthz")
        assert container.command == ["asyncrl"]
        with open(self.log, "ab") as handle:
            self.process = subprocess.Popen([ASYNCRL, *args, "--verbose"], env=env,
                                            stdout=handle, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL)
        return self

    def _write_kubeconfig(self, deployment) -> Path:
        account = deployment.spec.template.spec.service_account_name
        token = self.kube.core.create_namespaced_service_account_token(
            account, RELEASE_NAMESPACE, {"spec": {"expirationSeconds": 3600}}).status.token
        self.kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "sa",
            "clusters": [{"name": "test", "cluster": {
                "server": self.control_plane.server,
                "certificate-authority": str(self.control_plane.certs / "ca.crt")}}],
            "users": [{"name": "sa", "user": {"token": token}}],
            "contexts": [{"name": "sa", "context": {"cluster": "test", "user": "sa"}}],
        }))
        return self.kubeconfig


def lease_holder(kube) -> str | None:
    from kubernetes import client

    try:
        lease = client.CoordinationV1Api(kube.api).read_namespaced_lease(OPERATOR,
                                                                          RELEASE_NAMESPACE)
    except Exception:  # noqa: BLE001 - not there yet
        return None
    return lease.spec.holder_identity


def new_namespace(kube) -> str:
    name = f"c-{uuid.uuid4().hex[:8]}"
    kube.core.create_namespace({"metadata": {"name": name}})
    wait_for(lambda: _exists(lambda: kube.core.read_namespaced_service_account("default", name)),
             30, "the default service account")
    return name


def apply_job(tools, kube, namespace: str, name: str, tmp_path: Path) -> None:
    """kubectl apply of an RLJob whose GPU rollout lists no tolerations: the chart's
    gpuNodePool defaults must get it onto the tainted GPU pool."""
    data = manifest(name, namespace)
    del data["spec"]["rollout"]["placement"]["tolerations"]
    provide_run_volume(kube, namespace, name)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    run(tools, "kubectl", "apply", "-f", str(path))


# --------------------------------------------------------------------------- tests


def test_install_creates_the_operator_its_rbac_and_the_crd(tools, kube, release):
    deployment = kube.apps.read_namespaced_deployment(OPERATOR, RELEASE_NAMESPACE)
    assert deployment.status.available_replicas == 1
    crd = kube.ext.read_custom_resource_definition("rljobs.asyncrl.io")
    assert any(c.type == "Established" and c.status == "True" for c in crd.status.conditions)
    account = f"system:serviceaccount:{RELEASE_NAMESPACE}:{OPERATOR}"

    def can(*args: str) -> bool:
        out = run(tools, "kubectl", "auth", "can-i", *args, "--as", account, check=False)
        return out.stdout.strip() == "yes"

    assert can("patch", "deployments.apps", "-n", "anywhere")
    assert can("patch", "rljobs.asyncrl.io/status", "-n", "anywhere")
    assert can("update", "leases.coordination.k8s.io", "-n", RELEASE_NAMESPACE)
    assert not can("update", "leases.coordination.k8s.io", "-n", "kube-system")
    assert not can("delete", "deployments.apps", "-n", "anywhere")
    assert not can("create", "pods", "-n", "anywhere")
    assert not can("create", "pods/exec", "-n", "anywhere")
    assert not can("list", "secrets", "-n", "anywhere")


def test_the_installed_operator_reconciles_an_rljob_with_leader_election(
        tools, kube, release, control_plane, tmp_path):
    first = ChartOperator(control_plane, kube, tmp_path, "operator-a").start()
    second = None
    namespace = new_namespace(kube)
    try:
        wait_for(lambda: (lease_holder(kube) or "").startswith("operator-a_"), 60,
                 "operator-a to take the Lease", first)
        second = ChartOperator(control_plane, kube, tmp_path, "operator-b").start()
        apply_job(tools, kube, namespace, "one", tmp_path)
        wait_for(phase_is(kube, namespace, "one", "Running"), 120, "one to be Running", first)
        found = children(kube, namespace, "one")
        found.pop("Pod")
        assert found == expected("one")
        rollout = kube.apps.read_namespaced_deployment("one-rollout", namespace)
        assert [t.key for t in rollout.spec.template.spec.tolerations] == ["nvidia.com/gpu"]
        # The chart's default images: `-gpu` for the GPU rollout, the CPU one elsewhere.
        assert rollout.spec.template.spec.containers[0].image == \
            "ghcr.io/asyncrl/asyncrl:0.1.0-gpu"
        trainer = kube.apps.read_namespaced_stateful_set("one-trainer", namespace)
        assert trainer.spec.template.spec.containers[0].image == "ghcr.io/asyncrl/asyncrl:0.1.0"
        out = run(tools, "kubectl", "get", "rljobs", "-n", namespace)
        assert "Running" in out.stdout
        # Each phase transition is announced once, though handlers and watches race (kwok's
        # pods can be Ready before the first status is written: Starting may be skipped).
        events = events_about(kube, namespace, "one", "Running", first)
        reasons = sorted(e.reason for e in events if e.reason in ("Starting", "Running"))
        assert reasons in (["Running"], ["Running", "Starting"]), reasons
        # The follower campaigns and waits; it does not lead.
        assert "campaigning for lease" in second.tail()
        assert "leading: lease" not in second.tail()
        assert lease_holder(kube).startswith("operator-a_")

        # The leader dies without a goodbye; the follower takes over once the Lease lapses.
        first.stop(signal.SIGKILL)
        wait_for(lambda: (lease_holder(kube) or "").startswith("operator-b_"), 60,
                 "operator-b to take the Lease", second)
        apply_job(tools, kube, namespace, "two", tmp_path)
        wait_for(phase_is(kube, namespace, "two", "Running"), 120, "two to be Running", second)
    finally:
        first.stop()
        if second is not None:
            second.stop()
        kube.core.delete_namespace(namespace)


def test_upgrade_changes_the_operator_and_uninstall_keeps_the_jobs(
        tools, kube, release, control_plane, tmp_path):
    run(tools, "helm", "upgrade", RELEASE, str(CHART), "--namespace", RELEASE_NAMESPACE,
        "--reuse-values", "--set", "operator.replicas=2", "--set", "jobs.image.tag=v2",
        "--wait", "--timeout", "180s")
    deployment = kube.apps.read_namespaced_deployment(OPERATOR, RELEASE_NAMESPACE)
    assert deployment.spec.replicas == 2 and deployment.status.available_replicas == 2
    env = {e.name: e.value for e in deployment.spec.template.spec.containers[0].env}
    assert env["ASYNCRL_IMAGE"] == "ghcr.io/asyncrl/asyncrl:v2"
    history = run(tools, "helm", "history", RELEASE, "-n", RELEASE_NAMESPACE).stdout
    assert "upgrade complete" in history.lower()

    namespace = new_namespace(kube)
    try:
        kube.custom.create_namespaced_custom_object(
            "asyncrl.io", "v1alpha1", namespace, "rljobs", manifest("kept", namespace))
        run(tools, "helm", "uninstall", RELEASE, "--namespace", RELEASE_NAMESPACE, "--wait")
        assert not _exists(lambda: kube.apps.read_namespaced_deployment(OPERATOR,
                                                                         RELEASE_NAMESPACE))
        from kubernetes import client

        rbac = client.RbacAuthorizationV1Api(kube.api)
        assert not _exists(lambda: rbac.read_cluster_role(OPERATOR))
        # The CRD (helm.sh/resource-policy: keep) and so every RLJob survive an uninstall.
        assert _exists(lambda: kube.ext.read_custom_resource_definition("rljobs.asyncrl.io"))
        assert _exists(lambda: kube.custom.get_namespaced_custom_object(
            "asyncrl.io", "v1alpha1", namespace, "rljobs", "kept"))
    finally:
        kube.core.delete_namespace(namespace)
