"""The Helm chart without a cluster: `helm lint`, `helm template` output checked against the
Kubernetes schemas, the CRD kept equal to `asyncrl crd`, values checked by the chart's schema,
and RBAC held to what the operator really does."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from asyncrl.crd import build_crd
from asyncrl.operator import handlers

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "asyncrl"


@pytest.fixture(scope="module")
def helm() -> str:
    from cluster.control_plane import bin_dir

    path = bin_dir() / "helm"
    if not path.exists():
        pytest.fail(f"helm is missing from {path.parent}; fetch it (cached) with: "
                    f"bash tests/cluster/build.sh", pytrace=False)
    return str(path)


def render(helm: str, *sets: str) -> list[dict]:
    args = [helm, "template", "rel", str(CHART), "--namespace", "asyncrl-system"]
    for item in sets:
        args += ["--set", item]
    out = subprocess.run(args, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def by_kind(objects: list[dict]) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for obj in objects:
        found.setdefault(obj["kind"], []).append(obj)
    return found


def test_helm_lint_is_clean(helm):
    for sets in ([], ["monitoring.podMonitor.enabled=true", "operator.replicas=2"]):
        args = [helm, "lint", "--strict", str(CHART)] + [a for s in sets for a in ("--set", s)]
        out = subprocess.run(args, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "[WARNING]" not in out.stdout and "[ERROR]" not in out.stdout, out.stdout


def test_every_rendered_object_is_valid_against_the_kubernetes_schemas(helm):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    from kubernetes_validate.utils import latest_version

    objects = render(helm, "monitoring.podMonitor.enabled=true")
    kinds = by_kind(objects)
    assert set(kinds) == {"CustomResourceDefinition", "ServiceAccount", "ClusterRole",
                          "ClusterRoleBinding", "Role", "RoleBinding", "Deployment",
                          "ConfigMap", "PodMonitor"}
    for obj in objects:
        if obj["kind"] == "PodMonitor":  # the prometheus-operator's CRD: checked below
            continue
        kubernetes_validate.validate(obj, latest_version(), strict=True)
    (monitor,) = kinds["PodMonitor"]
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert {e["port"] for e in monitor["spec"]["podMetricsEndpoints"]} == {"metrics", "http"}
    assert monitor["spec"]["selector"]["matchLabels"]["app.kubernetes.io/managed-by"] == \
        "asyncrl-operator"


def test_chart_crd_is_asyncrl_crd_output():
    shipped = yaml.safe_load((CHART / "files" / "rljobs.asyncrl.io.yaml").read_text())
    assert shipped == build_crd(), (
        "charts/asyncrl/files/rljobs.asyncrl.io.yaml is out of date; regenerate it with: "
        ".venv/bin/asyncrl crd > charts/asyncrl/files/rljobs.asyncrl.io.yaml")


def test_the_rendered_crd_is_kept_on_uninstall_unless_asked(helm):
    (kept,) = by_kind(render(helm))["CustomResourceDefinition"]
    assert kept["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    assert kept["spec"] == build_crd()["spec"]
    (plain,) = by_kind(render(helm, "crds.keep=false"))["CustomResourceDefinition"]
    assert "annotations" not in plain["metadata"]
    assert "CustomResourceDefinition" not in by_kind(render(helm, "crds.install=false"))


def test_rbac_grants_only_what_the_operator_uses(helm):
    kinds = by_kind(render(helm))
    (cluster_role,) = kinds["ClusterRole"]
    grants = {(group, resource): set(rule["verbs"])
              for rule in cluster_role["rules"]
              for group in rule["apiGroups"] for resource in rule["resources"]}
    # Nothing wide: no wildcards, no deletes (children go by garbage collection), no pods/exec.
    for (group, resource), verbs in grants.items():
        assert "*" not in verbs and group != "*" and resource != "*"
        assert not verbs & {"delete", "deletecollection", "escalate", "bind", "impersonate"}
    assert not any(resource.startswith("pods/") for _, resource in grants)
    # Every kind the operator applies (server-side apply is a patch that may create).
    plural = {"ConfigMap": ("", "configmaps"), "Secret": ("", "secrets"),
              "Service": ("", "services"), "PersistentVolumeClaim": ("", "persistentvolumeclaims"),
              "Deployment": ("apps", "deployments"), "StatefulSet": ("apps", "statefulsets"),
              "NetworkPolicy": ("networking.k8s.io", "networkpolicies")}
    assert set(plural) == set(handlers._APPLY_METHODS)
    for kind, key in plural.items():
        assert grants[key] == {"get", "create", "patch"}, kind
    assert grants[("asyncrl.io", "rljobs")] == {"get", "list", "watch", "patch"}
    assert grants[("asyncrl.io", "rljobs/status")] == {"get", "patch"}
    assert grants[("", "pods")] == {"list"}
    assert grants[("", "events")] == {"create"}
    # Exactly these; a new grant must be added here, deliberately.
    assert set(grants) == {*plural.values(), ("asyncrl.io", "rljobs"),
                           ("asyncrl.io", "rljobs/status"), ("asyncrl.io", "rljobs/finalizers"),
                           ("", "pods"), ("", "events"),
                           ("apiextensions.k8s.io", "customresourcedefinitions"),
                           ("", "namespaces")}
    (role,) = kinds["Role"]
    assert role["metadata"]["namespace"] == "asyncrl-system"
    assert role["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                              "verbs": ["get", "create", "update"]}]
    no_policies = by_kind(render(helm, "networkPolicies.enabled=false"))["ClusterRole"][0]
    assert "networkpolicies" not in {r for rule in no_policies["rules"] for r in rule["resources"]}


def test_operator_deployment_runs_the_leader_elected_operator_with_the_values(helm):
    objects = render(helm, "operator.replicas=2", "jobs.image.tag=v9",
                     "jobs.runVolume.storageClass=nfs", "networkPolicies.enabled=false",
                     "rewardSandbox.seccompProfile=Localhost:profiles/sandbox.json")
    (deployment,) = by_kind(objects)["Deployment"]
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["labels"]["asyncrl.io/operator"] == "true"
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["asyncrl"]
    assert container["args"][:2] == ["operator", "--leader-election"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["ASYNCRL_IMAGE"] == "ghcr.io/asyncrl/asyncrl:v9"
    assert env["ASYNCRL_STORAGE_CLASS"] == "nfs"
    assert env["ASYNCRL_OPERATOR_NETWORK_POLICIES"] == "0"
    assert env["ASYNCRL_REWARD_SECCOMP_PROFILE"] == "Localhost:profiles/sandbox.json"
    assert json.loads(env["ASYNCRL_GPU_TOLERATIONS"]) == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert "POD_NAMESPACE" in env  # the Lease lives in the operator's own namespace
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_dashboard_config_map_carries_the_sidecar_label_and_the_json(helm):
    (config_map,) = by_kind(render(helm))["ConfigMap"]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(config_map["data"]["asyncrl.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "asyncrl.json").read_text())
    assert "ConfigMap" not in by_kind(render(helm, "monitoring.grafanaDashboard.enabled=false"))


@pytest.mark.parametrize("setting, message", [
    ("operator.replicas=two", "/operator/replicas"),
    ("operator.replica=2", "additional properties 'replica' not allowed"),
    ("rewardSandbox.seccompProfile=Loose", "/rewardSandbox/seccompProfile"),
    ("jobs.runVolume.size=lots", "/jobs/runVolume/size"),
])
def test_bad_values_are_refused_naming_the_key(helm, setting, message):
    out = subprocess.run([helm, "template", "rel", str(CHART), "--set", setting],
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert message in out.stderr
