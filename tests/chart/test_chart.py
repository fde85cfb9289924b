"""The Helm chart without a cluster: `helm lint`, `helm template` output checked against the
Kubernetes schemas, the CRD kept equal to `asyncrl crd`, values checked by the chart's schema,
and RBAC held to what the operator really does."""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml

from asyncrl.spec.crd import build_crd
from asyncrl.operator import builders, handlers
from asyncrl.operator.builders import OperatorConfig
from asyncrl.spec import load_manifest
from support import ROOT

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
    import kubernetes_validate  # a dev dependency: missing must fail, not skip
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
    monitors = {m["metadata"]["name"]: m for m in kinds["PodMonitor"]}
    [jobs] = [m for name, m in monitors.items() if name.endswith("-jobs")]
    [operator] = [m for name, m in monitors.items() if name.endswith("-operator")]
    assert {m["apiVersion"] for m in monitors.values()} == {"monitoring.coreos.com/v1"}
    assert {e["port"] for e in jobs["spec"]["podMetricsEndpoints"]} == {"metrics", "http"}
    assert jobs["spec"]["selector"]["matchLabels"]["app.kubernetes.io/managed-by"] == \
        "asyncrl-operator"
    # The operator's own pods, on the port its Deployment names and serves /metrics on.
    (deployment,) = kinds["Deployment"]
    [container] = deployment["spec"]["template"]["spec"]["containers"]
    [endpoint] = operator["spec"]["podMetricsEndpoints"]
    port = next(p for p in container["ports"] if p["name"] == endpoint["port"])
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["ASYNCRL_OPERATOR_METRICS_PORT"] == str(port["containerPort"])
    assert operator["spec"]["selector"]["matchLabels"].items() <= \
        deployment["spec"]["template"]["metadata"]["labels"].items()


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
    # Nothing wide: no wildcards, no deletes (children go by garbage collection) but of an
    # RLJob past its ttlSecondsAfterFinished, no pods/exec.
    for (group, resource), verbs in grants.items():
        assert "*" not in verbs and group != "*" and resource != "*"
        assert not verbs & {"deletecollection", "escalate", "bind", "impersonate"}
        assert "delete" not in verbs or (group, resource) in (
            ("asyncrl.io", "rljobs"), ("kueue.x-k8s.io", "workloads"))
    assert not any(resource.startswith("pods/") for _, resource in grants)
    # Every kind the operator applies (server-side apply is a patch that may create).
    plural = {"ConfigMap": ("", "configmaps"), "Secret": ("", "secrets"),
              "Service": ("", "services"), "PersistentVolumeClaim": ("", "persistentvolumeclaims"),
              "Deployment": ("apps", "deployments"), "StatefulSet": ("apps", "statefulsets"),
              "NetworkPolicy": ("networking.k8s.io", "networkpolicies")}
    job = load_manifest(ROOT / "examples" / "tiny.yaml")  # a managed Redis: its Secret too
    applied = {c["kind"] for c in builders.build_children(job, OperatorConfig(),
                                                          redis_password="x")}
    assert set(plural) == applied
    # Children are watched (filtered by the job label), except Secrets: never listed.
    watched = {*handlers._CHILD_RESOURCES, "networkpolicies"}
    for kind, key in plural.items():
        verbs = {"get", "create", "patch"} | ({"list", "watch"} if key[1] in watched else set())
        assert grants[key] == verbs, kind
    assert grants[("", "secrets")] == {"get", "create", "patch"}
    assert grants[("asyncrl.io", "rljobs")] == {"get", "list", "watch", "patch", "delete"}
    assert grants[("asyncrl.io", "rljobs/status")] == {"get", "patch"}
    assert grants[("", "pods")] == {"list", "watch"}
    assert grants[("", "events")] == {"create"}
    assert grants[("kueue.x-k8s.io", "workloads")] == {"get", "list", "watch", "create",
                                                       "patch", "delete"}
    assert grants[("kueue.x-k8s.io", "workloads/status")] == {"patch"}
    # Exactly these; a new grant must be added here, deliberately.
    assert set(grants) == {*plural.values(), ("asyncrl.io", "rljobs"),
                           ("asyncrl.io", "rljobs/status"), ("asyncrl.io", "rljobs/finalizers"),
                           ("", "pods"), ("", "events"),
                           ("apiextensions.k8s.io", "customresourcedefinitions"),
                           ("", "namespaces"), ("kueue.x-k8s.io", "workloads"),
                           ("kueue.x-k8s.io", "workloads/status")}
    (role,) = kinds["Role"]
    assert role["metadata"]["namespace"] == "asyncrl-system"
    assert role["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                              "verbs": ["get", "create", "update"]}]
    no_policies = by_kind(render(helm, "networkPolicies.enabled=false"))["ClusterRole"][0]
    assert "networkpolicies" not in {r for rule in no_policies["rules"] for r in rule["resources"]}


def test_operator_deployment_runs_the_leader_elected_operator_with_the_values(helm):
    objects = render(helm, "operator.replicas=2", "jobs.image.tag=v9",
                     "jobs.gpuImage.repository=registry.example/asyncrl-cuda",
                     "jobs.runVolume.storageClass=nfs", "networkPolicies.enabled=false",
                     "rewardSandbox.seccompProfile=Localhost:profiles/sandbox.json",
                     "jobs.hubEndpoint=https://hf-mirror.example")
    (deployment,) = by_kind(objects)["Deployment"]
    assert deployment["spec"]["replicas"] == 2
    pod = deployment["spec"]["template"]
    assert pod["metadata"]["labels"]["asyncrl.io/operator"] == "true"
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["asyncrl"]
    assert container["args"][:2] == ["operator", "--leader-election"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["ASYNCRL_IMAGE"] == "ghcr.io/asyncrl/asyncrl:v9"
    # GPU pods' image: its own repository and tag (default: <appVersion>-gpu).
    assert env["ASYNCRL_GPU_IMAGE"] == "registry.example/asyncrl-cuda:0.1.0-gpu"
    assert env["ASYNCRL_STORAGE_CLASS"] == "nfs"
    assert env["ASYNCRL_OPERATOR_NETWORK_POLICIES"] == "0"
    assert env["ASYNCRL_REWARD_SECCOMP_PROFILE"] == "Localhost:profiles/sandbox.json"
    assert json.loads(env["ASYNCRL_GPU_TOLERATIONS"]) == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert "POD_NAMESPACE" in env  # the Lease lives in the operator's own namespace
    # Jobs' Hub models come from the mirror (the fetch-model init containers' HF_ENDPOINT).
    assert env["HF_ENDPOINT"] == "https://hf-mirror.example"
    assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_default_job_images_are_the_operators_defaults(helm):
    """Without values, the chart names the images `asyncrl operator` would pick itself: the
    `service` target for CPU pods, the `service-gpu` target (tag `-gpu`) for GPU pods."""
    (deployment,) = by_kind(render(helm))["Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    defaults = OperatorConfig()
    assert env["ASYNCRL_IMAGE"] == defaults.image
    assert env["ASYNCRL_GPU_IMAGE"] == defaults.gpu_image
    assert "HF_ENDPOINT" not in env  # huggingface_hub's own default
    tagged = by_kind(render(helm, "jobs.gpuImage.tag=v9-cu130"))["Deployment"][0]
    env = {e["name"]: e.get("value")
           for e in tagged["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["ASYNCRL_GPU_IMAGE"] == "ghcr.io/asyncrl/asyncrl:v9-cu130"


def test_every_setting_the_chart_passes_is_an_operator_option(helm):
    """Each variable the chart sets on the operator container is read by an option of
    `asyncrl operator` (a misspelt name would be silently ignored)."""
    import typer.main

    from asyncrl.cli import app

    command = typer.main.get_command(app).commands["operator"]
    read = {param.envvar for param in command.params if param.envvar}
    (deployment,) = by_kind(render(helm, "jobs.runVolume.storageClass=nfs",
                                   "jobs.hubEndpoint=https://hf-mirror.example"))["Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    passed = {e["name"] for e in container["env"]}
    # POD_NAME names the leader-election identity (operator/leader.py); HOME is the pod's /tmp.
    assert passed - read == {"POD_NAME", "HOME"}


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
    ("jobs.gpuImage.repo=example.org/asyncrl", "additional properties 'repo' not allowed"),
    ("jobs.gpuImages.tag=v1", "additional properties 'gpuImages' not allowed"),
    ("jobs.hubEndpoint=hf-mirror.example", "/jobs/hubEndpoint"),
])
def test_bad_values_are_refused_naming_the_key(helm, setting, message):
    out = subprocess.run([helm, "template", "rel", str(CHART), "--set", setting],
                         capture_output=True, text=True)
    assert out.returncode != 0
    assert message in out.stderr


# Every key of values.yaml misspelt, one at a time, must fail the install naming it. Keys of a
# map whose keys are the user's own (labels, annotations) are the only ones a typo can't reach.
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())
USER_KEYS = {("monitoring", "grafanaDashboard", "labels", "grafana_dashboard")}


def value_keys(tree, path: tuple = ()):
    """The path of every key in a values tree, list items by index (leaves and objects alike)."""
    for key, value in (tree.items() if isinstance(tree, dict) else enumerate(tree)):
        if isinstance(tree, dict):
            yield path + (key,)
        if isinstance(value, (dict, list)):
            yield from value_keys(value, path + (key,))


def misspelt(key: str) -> str:
    return key[:-2] + key[-1]   # limits -> limis, cpu -> cu, tag -> tg


def misspelt_setting(path: tuple) -> tuple[str, str]:
    """A `--set-json` that writes the value at `path` under its misspelt key, and the schema
    error that must name it. Inside a list the whole list is set (helm replaces lists)."""
    *parent, key = path
    typo = misspelt(key)
    lists = [i for i, part in enumerate(parent) if isinstance(part, int)]
    at = lists[-1] if lists else len(parent)
    target, rest = parent[:at], path[at:]
    value = VALUES
    for part in target:
        value = value[part]
    if rest[:-1]:           # rename inside a copy of the list holding the key
        value = json.loads(json.dumps(value))
        holder = value
        for part in rest[:-1]:
            holder = holder[part]
        holder[typo] = holder.pop(key)
        name = ".".join(target)
    else:
        value = value[key]
        name = ".".join([*target, typo])
    where = "/" + "/".join(str(part) for part in parent)
    return f"{name}={json.dumps(value)}", f"at '{where if parent else ''}': " \
        f"additional properties '{typo}' not allowed"


@pytest.mark.parametrize("path", list(value_keys(VALUES)),
                         ids=lambda path: ".".join(map(str, path)))
def test_a_misspelt_key_anywhere_in_values_yaml_fails_naming_it(helm, path):
    siblings = VALUES
    for part in path[:-1]:
        siblings = siblings[part]
    assert misspelt(path[-1]) not in siblings and "." not in path[-1]
    setting, message = misspelt_setting(path)
    for command in (["template", "rel"], ["lint", "--strict"]):
        out = subprocess.run([helm, *command, str(CHART), "--set-json", setting],
                             capture_output=True, text=True)
        if path in USER_KEYS:   # the user's own map: any key is fine
            assert out.returncode == 0, out.stdout + out.stderr
        else:
            assert out.returncode != 0, f"{setting} was accepted"
            assert message in out.stdout + out.stderr, out.stdout + out.stderr


def test_values_yaml_keys_are_all_covered():
    """The walk above reaches into lists and empty maps too, not only the first level."""
    paths = set(value_keys(VALUES))
    assert {("operator", "resources", "limits", "memory"), ("operator", "affinity"),
            ("gpuNodePool", "tolerations", 0, "effect"), ("monitoring", "grafanaDashboard",
                                                          "annotations")} <= paths
    assert USER_KEYS <= paths and len(paths) > 50


@pytest.mark.parametrize("setting, message", [
    ("operator.resources.limts.cpu=1", "at '/operator/resources': additional properties 'limts'"),
    ("operator.resources.limits.cpuu=1",
     "at '/operator/resources/limits': additional properties 'cpuu'"),
    ("operator.resources.requests.memory=lots", "at '/operator/resources/requests/memory'"),
    ("operator.affinity.nodeAfinity.x=1", "at '/operator/affinity': additional properties "
                                          "'nodeAfinity'"),
    ("operator.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution"
     ".nodeSelectorTerms[0].matchExpressions[0].operater=In",
     "at '/operator/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution"
     "/nodeSelectorTerms/0/matchExpressions/0': additional properties 'operater'"),
    ("operator.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution[0]"
     ".podAffinityTerm.topologyKy=zone",
     "at '/operator/affinity/podAntiAffinity/preferredDuringSchedulingIgnoredDuringExecution/0"
     "/podAffinityTerm': additional properties 'topologyKy'"),
    ("operator.tolerations[0].efect=NoSchedule",
     "at '/operator/tolerations/0': additional properties 'efect'"),
    ("operator.imagePullSecrets[0].nme=regcred",
     "at '/operator/imagePullSecrets/0': additional properties 'nme'"),
])
def test_misspellings_inside_kubernetes_typed_values_are_refused(helm, setting, message):
    out = subprocess.run([helm, "template", "rel", str(CHART), "--set", setting],
                         capture_output=True, text=True)
    assert out.returncode != 0, f"{setting} was accepted"
    assert message in out.stderr, out.stderr


def test_kubernetes_typed_values_accept_what_kubernetes_accepts(helm):
    """A full affinity, resources with an extended resource and hugepages, and tolerations pass
    the values schema and render a Deployment valid against the Kubernetes schemas."""
    import kubernetes_validate
    from kubernetes_validate.utils import latest_version

    term = {"labelSelector": {"matchLabels": {"app": "x"},
                              "matchExpressions": [{"key": "tier", "operator": "NotIn",
                                                    "values": ["a"]}]},
            "namespaceSelector": {}, "namespaces": ["ns"], "topologyKey": "zone",
            "matchLabelKeys": ["pod-template-hash"], "mismatchLabelKeys": ["other"]}
    node_term = {"matchExpressions": [{"key": "kubernetes.io/arch", "operator": "In",
                                       "values": ["amd64"]}],
                 "matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["n"]}]}
    operator = {
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    node_term]},
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {"weight": 10, "preference": node_term}]},
            "podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]},
            "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 100, "podAffinityTerm": term}]}},
        "resources": {"requests": {"cpu": "250m", "memory": "1Gi", "ephemeral-storage": "1G",
                                   "hugepages-2Mi": "64Mi"},
                      "limits": {"cpu": 2, "memory": "2Gi", "example.com/widget": 1,
                                 "hugepages-2Mi": "64Mi"},
                      "claims": [{"name": "gpu", "request": "one"}]},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops",
                         "effect": "NoExecute", "tolerationSeconds": 30}],
        "imagePullSecrets": [{"name": "regcred"}]}
    out = subprocess.run([helm, "template", "rel", str(CHART), "--namespace", "asyncrl-system",
                          "--set-json", f"operator={json.dumps(operator)}"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    (deployment,) = by_kind([d for d in yaml.safe_load_all(out.stdout) if d])["Deployment"]
    kubernetes_validate.validate(deployment, latest_version(), strict=True)
    pod = deployment["spec"]["template"]["spec"]
    assert pod["affinity"] == operator["affinity"]
    assert pod["containers"][0]["resources"] == operator["resources"]
    assert pod["tolerations"] == operator["tolerations"]


def test_kubernetes_typed_values_have_exactly_the_kubernetes_fields():
    """Where a value is a Kubernetes type, the values schema lists the same fields as
    Kubernetes' own schema, at every depth, and refuses any other."""
    from kubernetes_validate.utils import latest_version, schema_contents

    version = latest_version()
    theirs_root = schema_contents(
        f"kubernetes-json-schema/v{version}-local-strict/_definitions.json", version)
    ours_root = json.loads((CHART / "values.schema.json").read_text())

    def resolve(schema: dict, root: dict, prefix: str) -> dict:
        while "$ref" in schema:
            schema = root[prefix][schema["$ref"].split("/")[-1]]
        return schema

    def walk(ours: dict, theirs: dict, where: str) -> None:
        ours = resolve(ours, ours_root, "definitions")
        theirs = resolve(theirs, theirs_root, "$defs")
        if "properties" in theirs:
            assert ours.get("additionalProperties") is False, where
            assert set(ours["properties"]) == set(theirs["properties"]), where
            assert set(ours.get("required", [])) >= set(theirs.get("required", [])), where
            for name, field in theirs["properties"].items():
                walk(ours["properties"][name], field, f"{where}.{name}")
        elif "items" in theirs:
            assert ours["type"] == "array", where
            walk(ours["items"], theirs["items"], f"{where}[]")
        elif isinstance(theirs.get("additionalProperties"), dict):   # a map
            (values,) = ours.get("patternProperties", {}).values() or \
                [ours["additionalProperties"]]
            walk(values, theirs["additionalProperties"], f"{where}{{}}")

    core = "io.k8s.api.core.v1."
    operator = ours_root["properties"]["operator"]["properties"]
    for ours, kind, where in [
            (operator["resources"], "ResourceRequirements", "operator.resources"),
            (operator["affinity"], "Affinity", "operator.affinity"),
            (operator["tolerations"]["items"], "Toleration", "operator.tolerations[]"),
            (operator["imagePullSecrets"]["items"], "LocalObjectReference",
             "operator.imagePullSecrets[]"),
            (ours_root["properties"]["gpuNodePool"]["properties"]["tolerations"]["items"],
             "Toleration", "gpuNodePool.tolerations[]")]:
        walk(ours, {"$ref": f"#/$defs/{core}{kind}"}, where)
