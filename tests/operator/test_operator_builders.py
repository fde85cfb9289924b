"""The operator's builders and status logic, without a cluster: pure functions in, dicts out."""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
from datetime import datetime, timedelta, timezone

import kopf
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

import asyncrl
from asyncrl.operator import builders
from asyncrl.operator.builders import OperatorConfig, build_children
from asyncrl.operator.status import (
    BufferStats,
    Observation,
    TrainerStatus,
    Workload,
    ComponentFailure,
    compute_status,
    component_failure,
    status_changes,
)
from asyncrl.platform.settings import SGLANG_STARTUP_SECONDS
from asyncrl.spec import load_manifest, parse_manifest
from support import ROOT

CONFIG = OperatorConfig(image="example.org/asyncrl:test", gpu_image="example.org/asyncrl:test-gpu")


def job_from(path: str = "examples/tiny.yaml", namespace: str = "ml", **spec_overrides):
    data = yaml.safe_load((ROOT / path).read_text())
    data["metadata"]["namespace"] = namespace
    for dotted, value in spec_overrides.items():
        node = data["spec"]
        *parents, leaf = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return parse_manifest(data)


def by_kind_name(children):
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


@pytest.fixture
def tiny():
    return job_from()


@pytest.fixture
def gpu():
    return job_from("examples/gpu-cluster.yaml", namespace="ml-research")


#: A file dataset and a python reward, each on a claim of the user's.
ON_VOLUMES = {
    "dataset": {"kind": "file", "path": "/data/arith/train.jsonl",
                "evalPath": "/data/arith/test.jsonl", "volume": "prompts",
                "fields": {"prompt": "question", "answer": "answer"}},
    "reward": {"kind": "python", "python": {"function": "mine.score:reward",
                                            "path": "/rewards/mine", "volume": "reward-code"}},
}


def test_children_of_a_managed_redis_job(tiny):
    children = by_kind_name(build_children(tiny, CONFIG, redis_password="pw"))
    assert set(children) == {
        ("ConfigMap", "tiny-config"), ("Secret", "tiny-redis"), ("Service", "tiny-redis"),
        ("StatefulSet", "tiny-redis"), ("PersistentVolumeClaim", "tiny-run"),
        ("Service", "tiny-buffer"), ("Deployment", "tiny-buffer"),
        ("Service", "tiny-reward"), ("Deployment", "tiny-reward"),
        ("Service", "tiny-trainer-headless"), ("StatefulSet", "tiny-trainer"),
        ("Service", "tiny-rollout"), ("Deployment", "tiny-rollout"),
        ("NetworkPolicy", "tiny-redis"), ("NetworkPolicy", "tiny-buffer"),
        ("NetworkPolicy", "tiny-trainer"), ("NetworkPolicy", "tiny-reward"),
    }
    for child in children.values():
        meta = child["metadata"]
        assert meta["namespace"] == "ml"
        assert meta["labels"]["app.kubernetes.io/instance"] == "tiny"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "asyncrl-operator"
        assert meta["labels"]["asyncrl.io/job"] == "tiny"
        assert meta["labels"]["app.kubernetes.io/name"] == "asyncrl"
        assert "app.kubernetes.io/component" in meta["labels"]


def test_every_child_is_a_valid_kubernetes_object(tiny, gpu):
    for job in (tiny, gpu):
        for child in build_children(job, CONFIG, redis_password="pw"):
            kubernetes_validate.validate(child, latest_version(), strict=True)


def test_network_policies_admit_only_the_jobs_own_pods(tiny):
    children = by_kind_name(build_children(tiny, CONFIG, redis_password="pw"))
    own_pods = {"podSelector": {"matchLabels": {"asyncrl.io/job": "tiny"}}}

    def ports(rule):
        return {p["port"] for p in rule.get("ports", [])}

    redis = children[("NetworkPolicy", "tiny-redis")]["spec"]
    assert redis["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "redis"
    assert redis["ingress"] == [{"from": [own_pods], "ports": [{"protocol": "TCP", "port": 6379}]}]

    operator = {"podSelector": {"matchLabels": {"asyncrl.io/operator": "true"}},
                "namespaceSelector": {}}
    buffer = children[("NetworkPolicy", "tiny-buffer")]["spec"]
    grpc_rules = [r for r in buffer["ingress"] if builders.BUFFER_PORT in ports(r)]
    # gRPC: the job's pods and the operator (buffer statistics); never an open rule.
    assert all(r.get("from") for r in grpc_rules)
    assert operator in [f for r in grpc_rules for f in r["from"]]
    assert [r for r in buffer["ingress"] if "from" not in r] == [
        {"ports": [{"protocol": "TCP", "port": builders.BUFFER_METRICS}]}]

    trainer = children[("NetworkPolicy", "tiny-trainer")]["spec"]
    assert trainer["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "trainer"
    # The job's pods on every port (rendezvous, then torch.distributed's own ports), the
    # operator on the status port only (trainer status), metrics from anywhere.
    assert {"from": [own_pods]} in trainer["ingress"]
    assert {"from": [operator], "ports": [{"protocol": "TCP", "port": builders.TRAINER_PORT}]} \
        in trainer["ingress"]
    assert [r for r in trainer["ingress"] if "from" not in r] == [
        {"ports": [{"protocol": "TCP", "port": builders.TRAINER_METRICS}]}]
    assert len(trainer["ingress"]) == 3

    reward = children[("NetworkPolicy", "tiny-reward")]["spec"]
    assert reward["policyTypes"] == ["Ingress", "Egress"] and "egress" not in reward  # none
    assert reward["ingress"][0] == {"from": [own_pods],
                                    "ports": [{"protocol": "TCP", "port": builders.REWARD_PORT}]}


def test_http_reward_pods_may_reach_their_endpoint_and_no_others_egress():
    http = job_from(reward={"kind": "http", "http": {"url": "http://judge.ml:8000/score"}})
    (policy,) = [c for c in build_children(http, CONFIG, redis_password="pw")
                 if c["kind"] == "NetworkPolicy" and c["metadata"]["name"] == "tiny-reward"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    python = job_from(**ON_VOLUMES)
    (policy,) = [c for c in build_children(python, CONFIG, redis_password="pw")
                 if c["kind"] == "NetworkPolicy" and c["metadata"]["name"] == "tiny-reward"]
    assert policy["spec"]["policyTypes"] == ["Ingress", "Egress"]


def test_network_policies_follow_the_operator_setting_and_external_redis(tiny):
    off = OperatorConfig(image="example.org/asyncrl:test", network_policies=False)
    assert not [c for c in build_children(tiny, off, redis_password="pw")
                if c["kind"] == "NetworkPolicy"]
    external = job_from(buffer__redis={"url": "redis://redis.example:6379/0"})
    names = {c["metadata"]["name"] for c in build_children(external, CONFIG, redis_password="pw")
             if c["kind"] == "NetworkPolicy"}
    assert names == {"tiny-buffer", "tiny-trainer", "tiny-reward"}  # no Redis of ours to guard


#: An episode job whose episode code is on a claim of the user's.
EPISODE = {"kind": "episode", "function": "tools.search:episode", "path": "/episodes/tools",
           "volume": "episode-code"}


def episode_job(workflow=None, **spec_overrides):
    """examples/tiny.yaml as an episode job (its micro-batches hold a whole conversation)."""
    return job_from(rollout__workflow=workflow or EPISODE, trainer__microBatchMaxTokens=2048,
                    **spec_overrides)


def rollout_policy(job, config=CONFIG):
    policies = [c for c in build_children(job, config, redis_password="pw")
                if c["kind"] == "NetworkPolicy" and c["metadata"]["name"] == "tiny-rollout"]
    return policies[0] if policies else None


def test_an_episode_jobs_rollout_pods_reach_only_dns_and_the_jobs_own_services():
    policy = rollout_policy(episode_job())
    kubernetes_validate.validate(policy, latest_version(), strict=True)
    assert policy["metadata"]["namespace"] == "ml"
    spec = policy["spec"]
    assert spec["podSelector"] == {"matchLabels": {
        "asyncrl.io/job": "tiny", "app.kubernetes.io/component": "rollout"}}
    assert spec["policyTypes"] == ["Egress"]  # who may reach the workers is unchanged

    def pods(component):
        return [{"podSelector": {"matchLabels": {
            "asyncrl.io/job": "tiny", "app.kubernetes.io/component": component}}}]

    assert spec["egress"] == [
        {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
        {"to": pods("redis"), "ports": [{"protocol": "TCP", "port": builders.REDIS_PORT}]},
        {"to": pods("buffer"), "ports": [{"protocol": "TCP", "port": builders.BUFFER_PORT}]},
        {"to": pods("reward"), "ports": [{"protocol": "TCP", "port": builders.REWARD_PORT}]},
    ]

    # Distributed weights: the trainer and the other workers form one torch.distributed
    # group with each worker, on ports it picks at run time.
    distributed = rollout_policy(episode_job(trainer__weightTransfer="distributed"))
    assert distributed["spec"]["egress"][4:] == [{"to": pods("trainer")},
                                                 {"to": pods("rollout")}]


def test_an_episode_jobs_egress_cidrs_are_added_to_its_rollout_policy():
    policy = rollout_policy(episode_job({**EPISODE, "egress": ["10.20.0.0/16",
                                                              "2001:db8::/32"]}))
    assert policy["spec"]["egress"][-1] == {"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}},
                                                   {"ipBlock": {"cidr": "2001:db8::/32"}}]}
    assert len(policy["spec"]["egress"]) == 5
    kubernetes_validate.validate(policy, latest_version(), strict=True)


@pytest.mark.parametrize(("url", "rule"), [
    ("redis://10.1.2.3:6380/0", {"to": [{"ipBlock": {"cidr": "10.1.2.3/32"}}],
                                 "ports": [{"protocol": "TCP", "port": 6380}]}),
    ("redis://[fd00::7]/0", {"to": [{"ipBlock": {"cidr": "fd00::7/128"}}],
                             "ports": [{"protocol": "TCP", "port": 6379}]}),
    # A host name's addresses are not known to a policy: its port, anywhere.
    ("rediss://redis.example:6380/0", {"ports": [{"protocol": "TCP", "port": 6380}]}),
])
def test_an_episode_jobs_rollout_pods_reach_an_external_redis_on_its_port(url, rule):
    job = episode_job(buffer__redis={"url": url, "tls": url.startswith("rediss")})
    assert rollout_policy(job)["spec"]["egress"][1] == rule


def test_single_turn_jobs_and_policies_off_get_no_rollout_policy(tiny):
    assert rollout_policy(tiny) is None
    assert rollout_policy(job_from(rollout__workflow={"kind": "single_turn"})) is None
    off = OperatorConfig(image="example.org/asyncrl:test", network_policies=False)
    assert rollout_policy(episode_job(), off) is None


def test_gpu_pods_without_tolerations_get_the_operators_gpu_tolerations():
    job = job_from("examples/gpu-cluster.yaml", rollout__placement__tolerations=[])
    custom = ({"key": "gpu-pool", "operator": "Equal", "value": "a100", "effect": "NoSchedule"},)
    for config, expected in ((CONFIG, list(CONFIG.gpu_tolerations)),
                             (OperatorConfig(gpu_tolerations=custom), list(custom))):
        rollout = builders.rollout_deployment(job, config)["spec"]["template"]["spec"]
        assert rollout["tolerations"] == expected
    # The spec's own tolerations win; CPU pods get none.
    gpu_job = job_from("examples/gpu-cluster.yaml")
    trainer = builders.trainer_statefulset(gpu_job, CONFIG)["spec"]["template"]["spec"]
    assert trainer["tolerations"] == [t.model_dump(mode="json", by_alias=True, exclude_none=True)
                                      for t in gpu_job.spec.trainer.placement.tolerations]
    assert "tolerations" not in builders.buffer_deployment(gpu_job, CONFIG)["spec"]["template"]["spec"]


@pytest.mark.parametrize("text, profile", [
    ("RuntimeDefault", {"type": "RuntimeDefault"}), ("Unconfined", {"type": "Unconfined"}),
    ("Localhost:profiles/sandbox.json",
     {"type": "Localhost", "localhostProfile": "profiles/sandbox.json"}),
])
def test_reward_pods_take_the_configured_seccomp_profile(tiny, text, profile):
    config = OperatorConfig(reward_seccomp_profile=text)
    reward = builders.reward_deployment(tiny, config)["spec"]["template"]["spec"]
    assert reward["securityContext"]["seccompProfile"] == profile
    buffer = builders.buffer_deployment(tiny, config)["spec"]["template"]["spec"]
    assert buffer["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


@pytest.mark.parametrize("seccomp", ["RuntimeDefault", "Unconfined"])
def test_code_reward_pods_run_as_root_with_only_the_sandboxs_capabilities(seccomp):
    # tests/e2e/test_e2e_code_reward.py shows why on a real node: non-root, no seccomp profile
    # lets the sandbox build its cage.
    code = job_from("examples/code.yaml")
    config = OperatorConfig(reward_seccomp_profile=seccomp)
    pod = builders.reward_deployment(code, config)["spec"]["template"]["spec"]
    assert pod["securityContext"] == {"runAsNonRoot": False, "runAsUser": 0, "runAsGroup": 0,
                                      "fsGroup": 0, "seccompProfile": {"type": seccomp}}
    assert pod["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"], "add": ["SYS_ADMIN", "SETUID", "SETGID",
                                                  "DAC_OVERRIDE"]}}
    assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False
    # Only the reward pods of code jobs: every other pod stays non-root.
    others = [child for child in build_children(code, config, redis_password="pw")
              if child["kind"] in ("Deployment", "StatefulSet")
              and child["metadata"]["name"] != builders.child_name(code, "reward")]
    assert len(others) == 4
    for child in others:
        assert child["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


@pytest.mark.parametrize("text", ["", "Localhost", "Localhost:", "unconfined", "Unconfined:x"])
def test_a_bad_seccomp_profile_names_the_accepted_forms(text):
    with pytest.raises(ValueError, match="expected RuntimeDefault, Unconfined or Localhost"):
        builders.seccomp_profile(text)


def test_building_twice_gives_the_same_objects(tiny):
    assert build_children(tiny, CONFIG, redis_password="pw") == \
        build_children(tiny, CONFIG, redis_password="pw")


def test_config_map_holds_the_resolved_job(tiny):
    data = builders.config_map(tiny)["data"]["job.yaml"]
    resolved = yaml.safe_load(data)
    assert resolved["metadata"] == {"name": "tiny", "namespace": "ml"}
    assert resolved["spec"]["algorithm"]["clipEps"] == 0.2  # a default, filled in
    # The job as written, with the weight transfer path its pods take.
    assert tiny.spec.trainer.weight_transfer == "auto"
    assert parse_manifest(resolved).spec == tiny.spec.model_copy(update={
        "trainer": tiny.spec.trainer.model_copy(update={"weight_transfer": "disk"})})


@pytest.mark.parametrize(("asked", "taken"), [
    ("auto", "disk"), ("disk", "disk"), ("distributed", "distributed"),
    ("ipc", "disk"),  # which the API server refuses before the operator sees it
])
def test_config_map_says_the_weight_transfer_path_the_pods_take(asked, taken):
    job = job_from(trainer__weightTransfer=asked)
    data = yaml.safe_load(builders.config_map(job)["data"]["job.yaml"])
    assert data["spec"]["trainer"]["weightTransfer"] == taken
    # The pods run the same job whether it says auto or disk: no restart between the two.
    assert builders.config_hash(job) == builders.config_hash(
        job_from(trainer__weightTransfer=taken))


def test_what_only_the_operator_reads_does_not_restart_the_pods():
    same = builders.config_hash(job_from())
    for change in ({"rollout__replicas": 3}, {"suspend": True}, {"backoffLimit": 2},
                   {"activeDeadlineSeconds": 600}, {"ttlSecondsAfterFinished": 60},
                   {"rollout__autoscale": {"maxReplicas": 3, "targetTrainerIdle": 0.5}}):
        assert builders.config_hash(job_from(**change)) == same, change
    # What the pods run does.
    assert builders.config_hash(job_from(algorithm__maxStaleness=0)) != same


def test_pods_run_the_serve_commands_with_the_job_file(tiny):
    children = by_kind_name(build_children(tiny, CONFIG, redis_password="pw"))
    for kind, name, component in [("Deployment", "tiny-buffer", "buffer"),
                                  ("Deployment", "tiny-reward", "reward"),
                                  ("Deployment", "tiny-rollout", "rollout"),
                                  ("StatefulSet", "tiny-trainer", "trainer")]:
        pod = children[(kind, name)]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["image"] == "example.org/asyncrl:test"
        assert container["command"] == ["asyncrl"]
        assert container["args"][:4] == ["serve", component, "--job-file", "/etc/asyncrl/job.yaml"]
        assert {"name": "config", "configMap": {"name": "tiny-config"}} in pod["volumes"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert probe in container
        assert container["resources"]["requests"]  # defaults when the spec gives none
    rollout = children[("Deployment", "tiny-rollout")]["spec"]["template"]["spec"]["containers"][0]
    args = rollout["args"]
    assert args[args.index("--buffer-address") + 1] == "tiny-buffer:50051"
    assert args[args.index("--reward-address") + 1] == "tiny-reward:50081"
    assert args[args.index("--redis-url") + 1] == \
        "redis://:$(ASYNCRL_REDIS_PASSWORD)@tiny-redis:6379/0"
    trainer = children[("StatefulSet", "tiny-trainer")]["spec"]["template"]["spec"]
    assert {"name": "run", "mountPath": "/run/asyncrl", "readOnly": False} in \
        trainer["containers"][0]["volumeMounts"]
    assert {"name": "run", "mountPath": "/run/asyncrl", "readOnly": True} in \
        rollout["volumeMounts"]


def test_redis_password_comes_from_the_generated_secret(tiny):
    secret = builders.redis_secret(tiny, "s3cret")
    assert secret["stringData"] == {"password": "s3cret"}
    redis = builders.redis_statefulset(tiny, CONFIG)
    container = redis["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "ASYNCRL_REDIS_PASSWORD",
            "valueFrom": {"secretKeyRef": {"name": "tiny-redis", "key": "password"}}} in \
        container["env"]
    assert "--requirepass" in container["args"]
    # persistence: none keeps the data in an emptyDir, no claim template.
    assert "volumeClaimTemplates" not in redis["spec"]
    assert redis["spec"]["template"]["spec"]["volumes"] == [{"name": "data", "emptyDir": {}}]


def test_redis_aof_gets_a_volume_claim_template():
    job = job_from(buffer__redis__persistence="aof")
    redis = builders.redis_statefulset(job, CONFIG)
    (template,) = redis["spec"]["volumeClaimTemplates"]
    assert template["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert "--appendonly" in redis["spec"]["template"]["spec"]["containers"][0]["args"]


def test_external_redis_creates_no_redis_and_uses_the_named_secret(gpu):
    children = by_kind_name(build_children(gpu, CONFIG, redis_password="unused"))
    assert not [key for key in children if key[1] == "qwen-math-redis"]
    buffer = children[("Deployment", "qwen-math-buffer")]["spec"]["template"]["spec"]
    container = buffer["containers"][0]
    args = container["args"]
    assert args[args.index("--redis-url") + 1] == "rediss://redis.data.svc.cluster.local:6380/0"
    assert {"name": "ASYNCRL_REDIS_PASSWORD",
            "valueFrom": {"secretKeyRef": {"name": "redis-auth", "key": "password"}}} in \
        container["env"]
    assert [kind for kind, _ in builders.workloads(gpu)] == \
        ["Deployment", "Deployment", "StatefulSet", "Deployment"]


def test_gpu_rollout_requests_gpus_on_the_pool(gpu):
    rollout = builders.rollout_deployment(gpu, CONFIG)
    assert rollout["spec"]["replicas"] == 4
    pod = rollout["spec"]["template"]["spec"]
    resources = pod["containers"][0]["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == "1" == resources["limits"]["nvidia.com/gpu"]
    assert resources["requests"]["cpu"] == "8"
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-l4",
                                   "node-pool": "rollout"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                   "effect": "NoSchedule"}]
    assert "podAntiAffinity" in pod["affinity"]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]


def test_cpu_rollout_has_no_gpus_and_no_pool(tiny):
    pod = builders.rollout_deployment(tiny, CONFIG)["spec"]["template"]["spec"]
    resources = pod["containers"][0]["resources"]
    assert "nvidia.com/gpu" not in resources.get("requests", {})
    assert "nodeSelector" not in pod and "tolerations" not in pod and "affinity" not in pod


def test_multi_node_trainer_runs_under_torchrun(gpu):
    trainer = builders.trainer_statefulset(gpu, CONFIG)
    spec = trainer["spec"]
    assert spec["replicas"] == 2 and spec["podManagementPolicy"] == "Parallel"
    assert spec["serviceName"] == "qwen-math-trainer-headless"
    container = spec["template"]["spec"]["containers"][0]
    assert container["command"][0] == "torchrun"
    assert "--nnodes=2" in container["command"] and "--nproc-per-node=8" in container["command"]
    assert ("--rdzv-endpoint=qwen-math-trainer-0.qwen-math-trainer-headless:29400"
            in container["command"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
    headless = builders.trainer_headless_service(gpu)
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True


def test_distributed_weights_open_the_trainer_store_to_rollout_workers(tiny):
    def ports(container_or_service, key):
        return {p["name"]: p[key] for p in container_or_service["ports"]}

    def weights_address(job):
        args = builders.rollout_deployment(job, CONFIG)["spec"]["template"]["spec"][
            "containers"][0]["args"]
        return args[args.index("--weights-address") + 1] if "--weights-address" in args else None

    assert weights_address(tiny) is None  # disk, the default: nothing more is opened
    trainer = builders.trainer_statefulset(tiny, CONFIG)["spec"]["template"]["spec"]
    assert "weights" not in ports(trainer["containers"][0], "containerPort")

    job = job_from(trainer__weightTransfer="distributed")
    assert weights_address(job) == "tiny-trainer-0.tiny-trainer-headless:29500"
    trainer = builders.trainer_statefulset(job, CONFIG)["spec"]["template"]["spec"]
    assert ports(trainer["containers"][0], "containerPort")["weights"] == 29500
    assert ports(builders.trainer_headless_service(job)["spec"], "port")["weights"] == 29500


def test_single_process_trainer_runs_asyncrl_directly(tiny):
    pod = builders.trainer_statefulset(tiny, CONFIG)["spec"]["template"]["spec"]
    assert pod["containers"][0]["command"] == ["asyncrl"]
    assert "initContainers" not in pod


def test_gpu_pods_run_the_gpu_image_and_the_others_the_cpu_image(gpu, tiny):
    def images(job):
        found = {}
        for child in build_children(job, CONFIG, redis_password="pw"):
            if child["kind"] in ("Deployment", "StatefulSet"):
                pod = child["spec"]["template"]["spec"]
                for container in pod.get("initContainers", []) + pod["containers"]:
                    found[(child["metadata"]["name"], container["name"])] = container["image"]
        return found

    # SGLang rollout and the multi-node trainer (its init container too) request GPUs.
    assert images(gpu) == {
        ("qwen-math-buffer", "buffer"): "example.org/asyncrl:test",
        ("qwen-math-reward", "reward"): "example.org/asyncrl:test",
        ("qwen-math-trainer", "wait-for-rendezvous"): "example.org/asyncrl:test-gpu",
        ("qwen-math-trainer", "trainer"): "example.org/asyncrl:test-gpu",
        ("qwen-math-rollout", "rollout"): "example.org/asyncrl:test-gpu",
    }
    # A CPU job runs the CPU image everywhere; a torch rollout on a GPU is a GPU pod.
    assert set(images(tiny).values()) == {"example.org/asyncrl:test", "redis:7.4-alpine"}
    on_gpu = job_from(rollout__placement={"gpus": 1, "nodeSelector": {"pool": "gpu"}})
    assert images(on_gpu)[("tiny-rollout", "rollout")] == "example.org/asyncrl:test-gpu"
    assert images(on_gpu)[("tiny-trainer", "trainer")] == "example.org/asyncrl:test"


def test_default_gpu_image_is_the_service_gpu_tag():
    defaults = OperatorConfig()
    assert defaults.gpu_image == f"{defaults.image}-gpu"
    assert defaults.image == f"ghcr.io/asyncrl/asyncrl:{asyncrl.__version__}"


def test_a_rollout_worker_is_unready_but_alive_while_redis_is_down(tiny):
    (rollout,) = builders.rollout_deployment(tiny, CONFIG)["spec"]["template"]["spec"]["containers"]
    assert rollout["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    for probe in ("startupProbe", "livenessProbe"):
        assert rollout[probe]["httpGet"] == {"path": "/health", "port": "http"}


def startup_window(container) -> float:
    probe = container["startupProbe"]
    return probe["periodSeconds"] * probe["failureThreshold"]


def test_an_sglang_rollout_may_take_sglangs_start_up_allowance(gpu, tiny):
    # The worker serves /health only once SGLang is healthy, which it allows this long.
    (sglang,) = builders.rollout_deployment(gpu, CONFIG)["spec"]["template"]["spec"]["containers"]
    assert startup_window(sglang) >= builders.STARTUP_SECONDS + SGLANG_STARTUP_SECONDS
    assert sglang["readinessProbe"]["periodSeconds"] == sglang["startupProbe"]["periodSeconds"]
    # The torch engine (CPU or GPU) and every other service keep the 600 s.
    torch_on_gpu = job_from("examples/gpu-cluster.yaml", rollout__engine="torch")
    for job in (tiny, torch_on_gpu):
        for child in build_children(job, CONFIG, redis_password="pw"):
            if child["kind"] in ("Deployment", "StatefulSet") and \
                    not child["metadata"]["name"].endswith("-redis"):
                (container,) = child["spec"]["template"]["spec"]["containers"]
                assert startup_window(container) == 600, child["metadata"]["name"]


def test_a_single_pod_trainer_runs_torchrun_standalone():
    job = job_from(trainer__processesPerReplica=4)
    pod = builders.trainer_statefulset(job, CONFIG)["spec"]["template"]["spec"]
    command = pod["containers"][0]["command"]
    assert command == ["torchrun", "--nnodes=1", "--nproc-per-node=4", "--standalone",
                       "-m", "asyncrl.cli"]
    assert "initContainers" not in pod


def test_a_multi_pod_trainer_waits_for_its_rendezvous(gpu):
    pod = builders.trainer_statefulset(gpu, CONFIG)["spec"]["template"]["spec"]
    (wait,) = pod["initContainers"]
    assert wait["command"][:2] == ["python", "-c"]
    assert wait["command"][3:] == ["qwen-math-trainer-0.qwen-math-trainer-headless", "29400"]
    assert "$(" not in wait["command"][2]  # the kubelet would expand it
    assert {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}} in \
        wait["env"]
    assert wait["securityContext"]["readOnlyRootFilesystem"] is True
    assert "resources" in wait and "limits" not in wait["resources"]  # no GPU for the wait


def run_wait(host: str, port: int, pod_ip: str, timeout: float) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", builders.WAIT_FOR_RENDEZVOUS, host, str(port)]
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, "POD_IP": pod_ip})
    except subprocess.TimeoutExpired as exc:  # still waiting; its output is bytes here
        return subprocess.CompletedProcess(command, None, (exc.stdout or b"").decode(),
                                           (exc.stderr or b"").decode())


def test_the_rendezvous_wait_ends_when_the_store_accepts_connections():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        assert run_wait("127.0.0.1", port, "10.0.0.9", timeout=20).returncode == 0
    # Nothing listens any more: the other pods keep waiting for pod 0's store.
    waiting = run_wait("127.0.0.1", port, "10.0.0.9", timeout=3)
    assert waiting.returncode is None
    assert f"waiting for the trainer rendezvous at 127.0.0.1:{port}" in waiting.stdout


def test_the_rendezvous_host_waits_until_its_name_resolves_to_itself():
    # Pod 0 hosts the store: its name must resolve to its own address before torchrun starts.
    me = socket.gethostname()
    address = socket.getaddrinfo(me, 0)[0][4][0]
    assert run_wait(me, 29400, address, timeout=20).returncode == 0
    # Still an old address (or none) in DNS: wait, and never connect to anyone.
    assert run_wait(me, 29400, "10.255.255.254", timeout=3).returncode is None


def test_every_pod_is_unprivileged_and_reward_is_locked_down(tiny):
    for child in build_children(tiny, CONFIG, redis_password="pw"):
        if child["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = child["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        for container in pod["containers"]:
            security = container["securityContext"]
            assert security["allowPrivilegeEscalation"] is False
            assert security["capabilities"] == {"drop": ["ALL"]}
            assert security["readOnlyRootFilesystem"] is True
    reward = builders.reward_deployment(tiny, CONFIG)["spec"]["template"]["spec"]
    assert reward["enableServiceLinks"] is False
    assert not [v for v in reward["volumes"] if "persistentVolumeClaim" in v]


def pod_of(workload: dict) -> tuple[dict, dict]:
    pod = workload["spec"]["template"]["spec"]
    return pod, pod["containers"][0]


def test_the_users_claims_are_mounted_read_only_where_their_files_are_read():
    job = job_from(**ON_VOLUMES)
    children = by_kind_name(build_children(job, CONFIG, redis_password="pw"))
    dataset = {"name": "dataset", "persistentVolumeClaim": {"claimName": "prompts",
                                                            "readOnly": True}}
    # Training prompts in the rollout pods, evaluation prompts in the trainer pods.
    for key in [("Deployment", "tiny-rollout"), ("StatefulSet", "tiny-trainer")]:
        pod, container = pod_of(children[key])
        assert dataset in pod["volumes"], key
        assert {"name": "dataset", "mountPath": "/data", "readOnly": True} in \
            container["volumeMounts"], key
        assert not [v for v in pod["volumes"] if v["name"] == "reward-python"], key
    # The reward's module, imported from reward.python.path, in the reward pods alone.
    pod, container = pod_of(children[("Deployment", "tiny-reward")])
    assert {"name": "reward-python", "persistentVolumeClaim": {
        "claimName": "reward-code", "readOnly": True}} in pod["volumes"]
    assert {"name": "reward-python", "mountPath": "/rewards", "readOnly": True} in \
        container["volumeMounts"]
    assert dataset not in pod["volumes"]
    for child in children.values():
        kubernetes_validate.validate(child, latest_version(), strict=True)
        if child["kind"] in ("Deployment", "StatefulSet"):
            pod, container = pod_of(child)
            # No volume takes the name or the folder of another.
            names = [v["name"] for v in pod.get("volumes", [])]
            folders = [m["mountPath"] for m in container.get("volumeMounts", [])]
            assert len(set(names)) == len(names) and len(set(folders)) == len(folders), names


def test_the_episode_code_claim_is_mounted_read_only_in_the_rollout_pods_alone():
    job = episode_job()
    children = by_kind_name(build_children(job, CONFIG, redis_password="pw"))
    pod, container = pod_of(children[("Deployment", "tiny-rollout")])
    assert {"name": "workflow", "persistentVolumeClaim": {
        "claimName": "episode-code", "readOnly": True}} in pod["volumes"]
    assert {"name": "workflow", "mountPath": "/episodes", "readOnly": True} in \
        container["volumeMounts"]
    for key, child in children.items():
        kubernetes_validate.validate(child, latest_version(), strict=True)
        if child["kind"] in ("Deployment", "StatefulSet") and key[1] != "tiny-rollout":
            pod, _ = pod_of(child)
            assert not [v for v in pod.get("volumes", []) if v["name"] == "workflow"], key


def test_the_dataset_and_the_episode_code_on_one_claim_are_mounted_once():
    dataset = {**ON_VOLUMES["dataset"], "volume": "shared"}
    shared = episode_job({**EPISODE, "path": "/data/episodes", "volume": "shared"},
                         dataset=dataset)
    pod, container = pod_of(builders.rollout_deployment(shared, CONFIG))
    assert [v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
            if "persistentVolumeClaim" in v] == ["tiny-run", "shared"]
    assert [m["mountPath"] for m in container["volumeMounts"]].count("/data") == 1
    # The same claim under two folders: mounted at both.
    apart = episode_job({**EPISODE, "volume": "shared"}, dataset=dataset)
    pod, container = pod_of(builders.rollout_deployment(apart, CONFIG))
    assert {(m["name"], m["mountPath"]) for m in container["volumeMounts"]} >= {
        ("dataset", "/data"), ("workflow", "/episodes")}


@pytest.mark.parametrize("overrides", [
    {},
    {"dataset": {**ON_VOLUMES["dataset"], "volume": None}},
    {"reward": {"kind": "python", "python": {"function": "mine.score:reward",
                                             "path": "/rewards/mine"}}},
    {"rollout": {"workflow": {**EPISODE, "volume": None}},
     "trainer": {"microBatchMaxTokens": 2048}},
], ids=["arith", "file-in-the-image", "python-in-the-image", "episode-in-the-image"])
def test_nothing_of_the_users_is_mounted_without_a_volume(overrides):
    job = job_from(**overrides)
    for child in build_children(job, CONFIG, redis_password="pw"):
        if child["kind"] in ("Deployment", "StatefulSet"):
            pod, container = pod_of(child)
            claims = [v["persistentVolumeClaim"]["claimName"] for v in pod.get("volumes", [])
                      if "persistentVolumeClaim" in v]
            assert claims in ([], ["tiny-run"]), child["metadata"]["name"]
            assert not {"dataset", "reward-python", "workflow"} & {
                m["name"] for m in container["volumeMounts"]}, child["metadata"]["name"]


def test_suspend_scales_workers_to_zero_and_keeps_state(tiny):
    suspended = job_from(suspend=True)
    before = by_kind_name(build_children(tiny, CONFIG, redis_password="pw"))
    after = by_kind_name(build_children(suspended, CONFIG, redis_password="pw"))
    for key in [("Deployment", "tiny-rollout"), ("Deployment", "tiny-reward"),
                ("StatefulSet", "tiny-trainer")]:
        assert after[key]["spec"]["replicas"] == 0, key
    assert after[("StatefulSet", "tiny-redis")]["spec"]["replicas"] == 1
    assert after[("Deployment", "tiny-buffer")]["spec"]["replicas"] == 1
    assert after[("PersistentVolumeClaim", "tiny-run")] == \
        before[("PersistentVolumeClaim", "tiny-run")]
    # Suspending is not a configuration change: templates (and so pods) stay the same.
    assert after[("StatefulSet", "tiny-trainer")]["spec"]["template"] == \
        before[("StatefulSet", "tiny-trainer")]["spec"]["template"]


def test_scaling_changes_replicas_only(tiny):
    scaled = job_from(rollout__replicas=3)
    a = builders.rollout_deployment(tiny, CONFIG)
    b = builders.rollout_deployment(scaled, CONFIG)
    assert (a["spec"]["replicas"], b["spec"]["replicas"]) == (1, 3)
    assert a["spec"]["template"] == b["spec"]["template"]


def test_buffer_replicas_scale_the_buffer_alone(tiny):
    scaled = job_from(buffer__replicas=3)
    a, b = builders.buffer_deployment(tiny, CONFIG), builders.buffer_deployment(scaled, CONFIG)
    assert (a["spec"]["replicas"], b["spec"]["replicas"]) == (1, 3)
    assert builders.desired_replicas(scaled, "buffer") == 3
    # More buffer pods restart none of the job's pods, the buffer's own included.
    assert a["spec"]["template"] == b["spec"]["template"]
    assert builders.trainer_statefulset(tiny, CONFIG)["spec"]["template"] == \
        builders.trainer_statefulset(scaled, CONFIG)["spec"]["template"]
    # A suspended job's buffer keeps serving, with all its replicas.
    suspended = job_from(buffer__replicas=3, suspend=True)
    assert builders.buffer_deployment(suspended, CONFIG)["spec"]["replicas"] == 3
    assert builders.desired_replicas(suspended, "buffer") == 3


def test_a_config_change_rolls_the_pods(tiny):
    changed = job_from(algorithm__learningRate=0.5)
    a = builders.trainer_statefulset(tiny, CONFIG)["spec"]["template"]["metadata"]
    b = builders.trainer_statefulset(changed, CONFIG)["spec"]["template"]["metadata"]
    assert a["annotations"][builders.CONFIG_HASH] != b["annotations"][builders.CONFIG_HASH]


def test_kopf_adopt_gives_owner_references(tiny):
    owner = {"apiVersion": "asyncrl.io/v1alpha1", "kind": "RLJob",
             "metadata": {"name": "tiny", "namespace": "ml", "uid": "1234",
                          "labels": {"team": "x"}}}
    child = builders.rollout_deployment(tiny, CONFIG)
    kopf.adopt(child, owner=owner)
    (ref,) = child["metadata"]["ownerReferences"]
    assert ref["uid"] == "1234" and ref["kind"] == "RLJob" and ref["controller"] is True
    assert child["metadata"]["labels"]["team"] == "x"


def test_examples_all_build(tmp_path):
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        job = load_manifest(path)
        if job.metadata.namespace is None:
            job = job.model_copy(update={"metadata": job.metadata.model_copy(
                update={"namespace": "default"})})
        assert build_children(job, CONFIG, redis_password="pw")


# --------------------------------------------------------------------------- status

NOW = datetime(2026, 1, 1, tzinfo=timezone.utc)


def observation(**overrides):
    ready = [Workload(c, 1, exists=True, replicas=1, ready=1)
             for c in ("redis", "buffer", "reward", "trainer", "rollout")]
    values = dict(generation=3, suspend=False, max_steps=10, workloads=tuple(ready), now=NOW)
    values.update(overrides)
    return Observation(**values)


def condition(status, kind):
    return next(c for c in status["conditions"] if c["type"] == kind)


def test_all_ready_is_running():
    status = compute_status(observation(), None)
    assert status["phase"] == "Running"
    assert status["observedGeneration"] == 3
    assert condition(status, "Ready")["status"] == "True"
    assert condition(status, "BufferReachable")["status"] == "False"
    assert status["rolloutReplicas"] == 1


def test_nothing_created_is_pending_and_some_missing_is_starting():
    nothing = tuple(Workload(c, 1) for c in ("buffer", "rollout"))
    assert compute_status(observation(workloads=nothing), None)["phase"] == "Pending"
    some = (Workload("buffer", 1, exists=True, replicas=1, ready=0), Workload("rollout", 2))
    status = compute_status(observation(workloads=some), None)
    assert status["phase"] == "Starting"
    assert condition(status, "Ready")["reason"] == "ChildrenNotCreated"


def test_not_ready_names_the_workloads():
    waiting = (Workload("rollout", 2, exists=True, replicas=2, ready=1),)
    status = compute_status(observation(workloads=waiting), None)
    assert status["phase"] == "Starting"
    assert condition(status, "Ready")["message"] == "rollout 1/2 ready."


def test_counts_from_before_the_latest_spec_are_not_ready():
    # A resume's status read before the controller saw it: the counts are the old ones.
    stale = (Workload("rollout", 1, exists=True, replicas=1, ready=1, current=False),)
    status = compute_status(observation(workloads=stale), None)
    assert status["phase"] == "Starting"
    assert condition(status, "Ready")["message"] == \
        "rollout 1/1 ready, its new spec not yet seen by its controller."


def test_invalid_spec_is_failed_with_the_message():
    status = compute_status(observation(invalid="spec.rollout.replicas: must be >= 1"), None)
    assert status["phase"] == "Failed"
    valid = condition(status, "Valid")
    assert (valid["status"], valid["reason"]) == ("False", "InvalidSpec")
    assert "spec.rollout.replicas" in valid["message"]


def test_suspended_and_succeeded():
    assert compute_status(observation(suspend=True), None)["phase"] == "Suspended"
    stats = BufferStats(trainer_version=10, trainer_step=10, accepted_total=80,
                        consumed_total=80, staleness_counts=(2, 1, 1))
    status = compute_status(observation(stats=stats), None)
    assert status["phase"] == "Succeeded"
    assert status["policyVersion"] == 10
    assert status["stalenessMean"] == 0.75


def test_completion_is_judged_by_the_step_not_the_version():
    # A trainer restarted from an older checkpoint publishes under newer versions: version 12
    # at step 9 of 10 is not done, version 13 at step 10 is.
    ahead = BufferStats(trainer_version=12, trainer_step=9, accepted_total=80, consumed_total=80)
    status = compute_status(observation(stats=ahead), None)
    assert status["phase"] == "Running" and status["policyVersion"] == 12
    assert condition(status, "Complete")["status"] == "False"
    done = BufferStats(trainer_version=13, trainer_step=10, accepted_total=88, consumed_total=88)
    status = compute_status(observation(stats=done), {"trainerStep": 9})
    assert status["phase"] == "Succeeded"
    # The step comes from the buffer too: a finished trainer may exit before it is asked.
    assert status["trainerStep"] == 10
    assert condition(status, "Complete")["message"] == "Step 10 of 10 published."


def test_a_job_whose_dataset_is_used_up_succeeds_before_max_steps():
    running = BufferStats(trainer_version=4, trainer_step=4, accepted_total=40,
                          consumed_total=32)
    assert compute_status(observation(stats=running), None)["phase"] == "Running"
    ended = BufferStats(trainer_version=4, trainer_step=4, accepted_total=40, consumed_total=32,
                        trainer_finished=True)
    status = compute_status(observation(stats=ended), None)
    assert status["phase"] == "Succeeded"
    complete = condition(status, "Complete")
    assert (complete["status"], complete["reason"]) == ("True", "DatasetUsedUp")
    assert complete["message"] == "Step 4 of 10 published. The dataset's epochs are used up."


def test_a_component_failure_fails_the_job_until_the_spec_changes():
    crashed = ComponentFailure("rollout", "rollout pods restarted 7 times, more than "
                               "backoffLimit 6; pod x last exited: Error, code 1.")
    status = compute_status(observation(failure=crashed), None)
    assert status["phase"] == "Failed"
    failed = condition(status, "Failed")
    assert failed["reason"] == "RolloutFailed"
    assert failed["message"].startswith("rollout pods restarted 7 times")
    assert "Its workers are stopped and its state kept" in failed["message"]
    assert status["failure"] == {"reason": "RolloutFailed", "component": "rollout",
                                 "message": failed["message"], "generation": 3}
    assert status["completionTime"] == "2026-01-01T00:00:00Z"
    # The workers stop, so the crash is no longer seen: the job stays Failed ...
    again = compute_status(observation(), copy.deepcopy(status))
    assert again["phase"] == "Failed" and again["failure"] == status["failure"]
    # ... until the spec changes.
    edited = compute_status(observation(generation=4), copy.deepcopy(status))
    assert edited["phase"] == "Running" and edited["failure"] is None
    assert edited["completionTime"] is None


def test_the_deadline_counts_from_the_start_and_again_after_a_resume():
    started = compute_status(observation(active_deadline_seconds=60), None)
    assert (started["phase"], started["startTime"]) == ("Running", "2026-01-01T00:00:00Z")
    minute = NOW + timedelta(seconds=59)
    assert compute_status(observation(active_deadline_seconds=60, now=minute),
                          copy.deepcopy(started))["phase"] == "Running"
    late = compute_status(observation(active_deadline_seconds=60,
                                      now=NOW + timedelta(seconds=61)), copy.deepcopy(started))
    failed = condition(late, "Failed")
    assert (late["phase"], failed["reason"]) == ("Failed", "DeadlineExceeded")
    assert failed["message"].startswith("The job ran 61 s since 2026-01-01T00:00:00Z, past "
                                        "activeDeadlineSeconds 60.")
    # Suspended, the clock stops; resumed, it starts again.
    suspended = compute_status(observation(suspend=True, active_deadline_seconds=60,
                                           now=minute), copy.deepcopy(started))
    assert suspended["startTime"] is None
    resumed = compute_status(observation(active_deadline_seconds=60,
                                         now=NOW + timedelta(seconds=100)), suspended)
    assert (resumed["phase"], resumed["startTime"]) == ("Running", "2026-01-01T00:01:40Z")
    # A finished job has no deadline.
    done = BufferStats(trainer_version=10, trainer_step=10, accepted_total=80, consumed_total=80)
    finished = compute_status(observation(stats=done, active_deadline_seconds=60,
                                          now=NOW + timedelta(seconds=61)), copy.deepcopy(started))
    assert finished["phase"] == "Succeeded"
    assert finished["completionTime"] == "2026-01-01T00:01:01Z"


def test_transition_time_only_moves_when_a_condition_flips():
    first = compute_status(observation(), None)
    later = compute_status(observation(now=datetime(2026, 1, 2, tzinfo=timezone.utc)),
                           copy.deepcopy(first))
    assert condition(later, "Ready")["lastTransitionTime"] == "2026-01-01T00:00:00Z"
    assert status_changes(first, later) == {}
    flipped = compute_status(observation(suspend=True,
                                         now=datetime(2026, 1, 3, tzinfo=timezone.utc)), first)
    assert condition(flipped, "Suspended")["lastTransitionTime"] == "2026-01-03T00:00:00Z"
    # Suspended, the deadline's clock stops (startTime goes).
    assert set(status_changes(first, flipped)) == {"phase", "conditions", "startTime"}


def pod(component: str, name: str, restarts: int = 0, exit_code: int = 1,
        message: str = "", phase: str = "Running", deleting: bool = False) -> dict:
    meta = {"name": name, "labels": {"app.kubernetes.io/component": component}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    terminated = {"reason": "Error" if exit_code else "Completed", "exitCode": exit_code,
                  "message": message}
    return {"metadata": meta, "status": {"phase": phase, "containerStatuses": [{
        "restartCount": restarts, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": terminated} if restarts else {}}]}}


def test_restarts_are_counted_per_component_against_the_backoff_limit():
    logs = "\n".join(f"line {i}" for i in range(20)) + "\nValueError: boom"
    # Two rollout pods restarted 4 and 3 times: 7 for the component, more than 6.
    pods = [pod("rollout", "j-rollout-a", 4), pod("rollout", "j-rollout-b", 3, message=logs),
            pod("trainer", "j-trainer-0", 6), pod("reward", "j-reward-a", 5)]
    failure = component_failure(pods, 6)
    assert (failure.component, failure.reason) == ("rollout", "RolloutFailed")
    assert failure.message.startswith("rollout pods restarted 7 times, more than backoffLimit 6;"
                                      " pod j-rollout-b last exited: Error, code 1. Its last "
                                      "log lines:\nline 13\n")
    assert failure.message.endswith("line 19\nValueError: boom")
    assert component_failure(pods, 7) is None
    assert component_failure([], 0) is None
    # The trainer first, whatever the order of the pods.
    assert component_failure(pods + [pod("trainer", "j-trainer-1", 2)], 6).component == "trainer"


def test_what_does_not_count_as_a_failure():
    # Exit code 0 is a finished trainer; a pod being deleted was stopped on purpose.
    assert component_failure([pod("trainer", "j-trainer-0", 9, exit_code=0)], 5) is None
    assert component_failure([pod("rollout", "j-rollout-a", 9, deleting=True)], 5) is None
    stopping = pod("trainer", "j-trainer-0", phase="Failed", deleting=True)
    assert component_failure([stopping], 5) is None
    failed = component_failure([pod("buffer", "j-buffer-a", phase="Failed")], 5)
    assert (failed.reason, failed.message) == ("BufferFailed",
                                               "buffer pod j-buffer-a failed: its container "
                                               "exited.")


def test_a_finished_job_stays_succeeded_whatever_its_trainer_pod_does():
    stats = BufferStats(trainer_version=10, trainer_step=10, accepted_total=80,
                        consumed_total=80, staleness_counts=(2, 1, 1))
    crashed = ComponentFailure("trainer", "trainer pod x crashed")
    status = compute_status(observation(stats=stats, failure=crashed), None)
    assert status["phase"] == "Succeeded"
    assert condition(status, "Failed")["status"] == "False"
    unfinished = BufferStats(trainer_version=9, trainer_step=9, accepted_total=72,
                             consumed_total=72, staleness_counts=(2, 1, 1))
    assert compute_status(observation(stats=unfinished, failure=crashed),
                          None)["phase"] == "Failed"


# --------------------------------------------------------------------------- buffer stats


def test_buffer_stats_from_a_real_buffer(redis_server, tiny):
    import grpc
    from support.buffer import BufferThread

    from asyncrl.buffer.store import JobConfig
    from asyncrl.operator.observe import buffer_stats
    from asyncrl.v1 import buffer_pb2, buffer_pb2_grpc

    server = BufferThread(redis_server.url, [JobConfig.from_job(tiny)]).start()
    try:
        with grpc.insecure_channel(server.address) as channel:
            buffer_pb2_grpc.BufferStub(channel).SetVersion(
                buffer_pb2.SetVersionRequest(job="tiny", version=3, weights_uri="/w/3",
                                             trainer_step=2))
        stats, error = buffer_stats(tiny, address=server.address)
    finally:
        server.stop()
    assert error is None
    assert (stats.trainer_version, stats.trainer_step, stats.accepted_total) == (3, 2, 0)
    status = compute_status(observation(stats=stats), None)
    assert status["policyVersion"] == 3
    assert next(c for c in status["conditions"] if c["type"] == "BufferReachable")["status"] \
        == "True"


def test_buffer_stats_says_why_when_unreachable(tiny):
    from asyncrl.operator.observe import buffer_stats
    from support.ports import free_port

    stats, error = buffer_stats(tiny, address=f"127.0.0.1:{free_port()}", timeout=0.5)
    assert stats is None
    assert "UNAVAILABLE" in error or "DEADLINE_EXCEEDED" in error, error


# --------------------------------------------------------------------------- trainer status


def test_trainer_figures_are_written_from_its_status():
    trainer = TrainerStatus(step=12, phase="waiting_for_batch", tokens_per_second=812.54,
                            reward_mean=0.62512, eval_accuracy=0.40625, eval_stderr=0.038815)
    status = compute_status(observation(trainer=trainer), None)
    assert (status["trainerStep"], status["tokensPerSecond"], status["rewardMean"],
            status["evalAccuracy"], status["evalStderr"]) == (12, 812.5, 0.6251, 0.4062, 0.0388)
    reachable = condition(status, "TrainerReachable")
    assert (reachable["status"], reachable["reason"]) == ("True", "GetStatusAnswered")
    assert reachable["message"] == "Step 12 of 10 (waiting for batch)."


def test_trainer_figures_wait_for_the_first_step_and_evaluation():
    starting = TrainerStatus(step=0, phase="evaluating")
    status = compute_status(observation(trainer=starting), None)
    assert status["trainerStep"] == 0
    assert not {"tokensPerSecond", "rewardMean", "evalAccuracy", "evalStderr"} & set(status)


def test_an_unreachable_trainer_keeps_the_figures_and_says_why():
    trainer = TrainerStatus(step=3, phase="training", tokens_per_second=100.0, reward_mean=0.5,
                            eval_accuracy=0.25, eval_stderr=0.05)
    first = compute_status(observation(trainer=trainer), None)
    later = compute_status(observation(trainer_error="tiny-trainer-0...:50071: UNAVAILABLE"),
                           copy.deepcopy(first))
    for key in ("trainerStep", "tokensPerSecond", "rewardMean", "evalAccuracy", "evalStderr"):
        assert later[key] == first[key], key
    unreachable = condition(later, "TrainerReachable")
    assert (unreachable["status"], unreachable["reason"]) == ("False", "GetStatusFailed")
    assert unreachable["message"] == "tiny-trainer-0...:50071: UNAVAILABLE"
    assert condition(compute_status(observation(), None), "TrainerReachable")["message"] == \
        "The trainer has not answered yet."


def test_trainer_status_from_a_real_trainer_status_server(tiny):
    from support.trainer_status import TrainerStatusThread

    from asyncrl.operator.observe import trainer_status
    from asyncrl.trainer.service import Status

    served = Status(version=5, step=4, max_steps=10, phase="training",
                    trained_tokens_per_second=250.0, reward_mean=0.75, eval_accuracy=-1.0)
    with TrainerStatusThread(served) as server:
        found, error = trainer_status(tiny, [server.address])
        assert error is None
        assert found == TrainerStatus(step=4, phase="training", tokens_per_second=250.0,
                                      reward_mean=0.75, eval_accuracy=None, eval_stderr=None)
        served.eval_accuracy, served.eval_stderr = 0.5, 0.0395  # the trainer evaluated
        evaluated = trainer_status(tiny, [server.address])[0]
        assert (evaluated.eval_accuracy, evaluated.eval_stderr) == (0.5, 0.0395)
    status = compute_status(observation(trainer=found), None)
    assert (status["trainerStep"], status["tokensPerSecond"], status["rewardMean"]) == \
        (4, 250.0, 0.75)


def test_trainer_status_comes_from_the_leader_whichever_pod_it_is_on(tiny):
    from support.trainer_status import TrainerStatusThread

    from asyncrl.operator.observe import trainer_status
    from support.ports import free_port
    from asyncrl.trainer.service import Status

    # Under torchrun every pod serves its first process's status; the rendezvous may put the
    # leader (global rank 0) on any pod, and the others follow it with no figures of their own.
    follower = Status(step=0, max_steps=10, phase="following")
    leader = Status(step=6, max_steps=10, phase="training", trained_tokens_per_second=90.0,
                    reward_mean=0.5)
    with TrainerStatusThread(follower) as pod0, TrainerStatusThread(leader) as pod1:
        found, error = trainer_status(tiny, [pod0.address, pod1.address])
        assert error is None and (found.step, found.phase) == (6, "training")
        found, error = trainer_status(tiny, [pod0.address, f"127.0.0.1:{free_port()}"],
                                      timeout=0.5)
        assert found is None
        assert error.startswith(f"{pod0.address}: a following rank; 127.0.0.1:"), error


def test_trainer_status_says_why_when_unreachable(tiny):
    from asyncrl.operator.observe import trainer_status
    from support.ports import free_port

    found, error = trainer_status(tiny, [f"127.0.0.1:{free_port()}"], timeout=0.5)
    assert found is None
    assert "UNAVAILABLE" in error or "DEADLINE_EXCEEDED" in error, error
    # By default: every trainer pod in order, through the headless Service.
    two = job_from(trainer__replicas=2)
    found, error = trainer_status(two, timeout=0.5)
    assert found is None
    first, second = error.split("; ")
    assert first.startswith("tiny-trainer-0.tiny-trainer-headless.ml.svc:50071: "), error
    assert second.startswith("tiny-trainer-1.tiny-trainer-headless.ml.svc:50071: "), error


def test_a_tracked_job_gives_the_trainer_its_tracker_settings_and_the_key_from_its_secret(tiny):
    def env(job, builder=builders.trainer_statefulset):
        container = builder(job, CONFIG)["spec"]["template"]["spec"]["containers"][0]
        return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}

    assert not {"WANDB_API_KEY", "MLFLOW_TRACKING_URI", "ASYNCRL_JOB_UID"} & set(env(tiny))
    data = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    data["metadata"].update(namespace="ml", uid="0b8a-uid")
    data["spec"]["tracking"] = {
        "wandb": {"project": "arith", "apiKeySecret": {"name": "wandb", "key": "api-key"}},
        "mlflow": {"trackingUri": "http://mlflow.mlflow:5000"}, "tensorboard": {"dir": "tb"}}
    job = parse_manifest(data)
    trainer = env(job)
    assert trainer["WANDB_API_KEY"] == {"secretKeyRef": {"name": "wandb", "key": "api-key"}}
    assert trainer["MLFLOW_TRACKING_URI"] == "http://mlflow.mlflow:5000"
    assert trainer["ASYNCRL_JOB_UID"] == "0b8a-uid"  # names the run: a new job, a new run
    # The event files go under the run directory, which is the run volume's mount.
    pod = builders.trainer_statefulset(job, CONFIG)["spec"]["template"]["spec"]
    container = pod["containers"][0]
    run_dir = container["args"][container["args"].index("--run-dir") + 1]
    assert {"name": "run", "mountPath": run_dir, "readOnly": False} in container["volumeMounts"]
    assert any(v["name"] == "run" and "persistentVolumeClaim" in v for v in pod["volumes"])
    # The key stays with the trainer.
    assert "WANDB_API_KEY" not in env(job, builders.rollout_deployment)
