"""Child objects of an RLJob, as pure functions from the validated job to Kubernetes dicts.

Every builder takes the parsed `RLJob` (and the operator's `OperatorConfig`) and returns one
plain dict, the object the operator applies (server-side apply, so applying the same dict again
changes nothing). Builders never talk to the API server; the handlers add owner references
(`kopf.adopt`) and apply what `build_children` returns. Names are `<job>-<component>`.

What runs where:

    <job>-config    ConfigMap        the resolved job (every default filled in), job.yaml
    <job>-redis     Secret           generated Redis password (managed Redis without a secret)
    <job>-redis     StatefulSet+Svc  managed Redis (absent when spec.buffer.redis.url is set)
    <job>-buffer    Deployment+Svc   staleness gate and batches (gRPC 50051, metrics 9101)
    <job>-reward    Deployment+Svc   scoring, hardened pods (gRPC 50081, metrics 9102); for
                    code rewards root with the sandbox's four capabilities (SANDBOX_CAPABILITIES)
    <job>-rollout   Deployment+Svc   generation; GPUs, node pool, tolerations (HTTP 30000, gRPC 50061)
    <job>-trainer   StatefulSet      PPO updates, nodes x processes via torchrun (gRPC 50071)
    <job>-trainer-headless  Service  stable pod DNS for torch rendezvous (29400) and, with
                                     trainer.weightTransfer distributed, the weight
                                     transfer group's store (29500)
    <job>-run       PVC              checkpoints and weight snapshots: trainer writes, rollout reads
    (the user's)    PVC              spec.dataset.volume, read-only in the rollout and trainer
                                     pods; spec.reward.python.volume, read-only in the reward pods
    <job>-redis, <job>-buffer, <job>-trainer, <job>-reward   NetworkPolicy   only the job's own
                    pods (and the operator, for buffer statistics and trainer status) reach
                    Redis, the buffer and the trainer; reward pods, which may run untrusted
                    programs, make no outgoing connection at all (but to a reward kind
                    http's endpoint)

Pods of a component that requests GPUs (`placement.gpus` > 0) run `OperatorConfig.gpu_image`
(CUDA torch and SGLang), the others `OperatorConfig.image` (CPU torch).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

import yaml

import asyncrl
from asyncrl.platform.grpc_health import LIVENESS
from asyncrl.platform.endpoints import port
from asyncrl.platform.settings import SGLANG_STARTUP_SECONDS
from asyncrl.platform.settings import serve_command
from asyncrl.spec import GPU_RESOURCE, RLJob
from asyncrl.launch.torchrun import torchrun_arguments

MANAGED_BY = "asyncrl-operator"
JOB_LABEL = "asyncrl.io/job"
#: Carried by the operator's own pods (the chart sets it): they may read every job's buffer.
OPERATOR_LABEL = "asyncrl.io/operator"
CONFIG_HASH = "asyncrl.io/config-hash"

JOB_FILE = "/etc/asyncrl/job.yaml"
RUN_DIR = "/run/asyncrl"
#: Pod volumes of the user's own claims, named apart from the job's (config, tmp, run, dshm,
#: data) so that a claim can never take one of their places.
DATASET_VOLUME = "dataset"
REWARD_VOLUME = "reward-python"
PASSWORD_ENV = "ASYNCRL_REDIS_PASSWORD"

# The ports of asyncrl.platform.endpoints, by the names this module uses.
BUFFER_PORT, BUFFER_METRICS = port("buffer", "grpc"), port("buffer", "metrics")
REWARD_PORT, REWARD_METRICS = port("reward", "grpc"), port("reward", "metrics")
ROLLOUT_HTTP, ROLLOUT_GRPC = port("rollout", "http"), port("rollout", "grpc")
TRAINER_PORT, TRAINER_METRICS = port("trainer", "grpc"), port("trainer", "metrics")
RENDEZVOUS_PORT, REDIS_PORT = port("trainer", "rendezvous"), port("redis", "redis")
WEIGHTS_PORT = port("trainer", "weights")

#: Seconds a service container may take to start (loading a model can take minutes) before
#: its startup probe fails and the kubelet restarts it; the probe runs every PROBE_PERIOD.
STARTUP_SECONDS = 600
PROBE_PERIOD = 5

#: Unprivileged uid/gid of the asyncrl image; Redis runs as the official image's redis user.
APP_UID = 10001
REDIS_UID = 999

#: What the code sandbox needs to build its cage as root: namespaces and mounts (SYS_ADMIN;
#: the runtime's default seccomp profile then allows unshare and mount too), a uid of its own
#: per slot (SETUID, SETGID), and the program's files written into that uid's scratch tmpfs
#: (DAC_OVERRIDE). The programs themselves run with none.
SANDBOX_CAPABILITIES = ("SYS_ADMIN", "SETUID", "SETGID", "DAC_OVERRIDE")

#: Requests of a component whose spec gives no resources at all (user values always win).
DEFAULT_REQUESTS = {
    "redis": {"cpu": "100m", "memory": "256Mi"},
    "buffer": {"cpu": "200m", "memory": "256Mi"},
    "reward": {"cpu": "500m", "memory": "512Mi"},
    "rollout": {"cpu": "1", "memory": "2Gi"},
    "trainer": {"cpu": "1", "memory": "4Gi"},
}


@dataclass(frozen=True)
class OperatorConfig:
    """Settings of the operator itself (flags / env of `asyncrl operator`), not of a job."""

    #: Image of the pods that request no GPUs: the Dockerfile's `service` target (CPU torch).
    image: str = f"ghcr.io/asyncrl/asyncrl:{asyncrl.__version__}"
    #: Image of the pods whose component requests GPUs (`placement.gpus` > 0: rollout,
    #: trainer): the `service-gpu` target, with CUDA torch and SGLang.
    gpu_image: str = f"ghcr.io/asyncrl/asyncrl:{asyncrl.__version__}-gpu"
    redis_image: str = "redis:7.4-alpine"
    image_pull_policy: str = "IfNotPresent"
    run_volume_size: str = "20Gi"
    run_volume_storage_class: str | None = None
    redis_volume_size: str = "1Gi"
    #: Trainer restarts (CrashLoopBackOff) after which the job is Failed.
    trainer_max_restarts: int = 5
    #: Create the job's NetworkPolicies (they take effect where the CNI enforces them).
    network_policies: bool = True
    #: Seccomp profile of reward pods: "RuntimeDefault", "Unconfined" or "Localhost:<path>".
    #: The code sandbox creates namespaces (unshare), which some runtimes' default profiles
    #: refuse; the reward service then reports the sandbox unavailable instead of running code.
    reward_seccomp_profile: str = "RuntimeDefault"
    #: Tolerations for GPU pods whose spec lists none: the taint of the cluster's GPU pools.
    gpu_tolerations: tuple[dict[str, Any], ...] = (
        {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"},)


# --------------------------------------------------------------------------- names and labels


def child_name(job: RLJob, component: str) -> str:
    return f"{job.metadata.name}-{component}"


def selector_labels(job: RLJob, component: str) -> dict[str, str]:
    """Stable labels only: a Deployment's selector can never change."""
    return {JOB_LABEL: job.metadata.name, "app.kubernetes.io/component": component}


def labels(job: RLJob, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "asyncrl",
        "app.kubernetes.io/instance": job.metadata.name,
        "app.kubernetes.io/component": component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        "app.kubernetes.io/version": asyncrl.__version__,
        JOB_LABEL: job.metadata.name,
    }


def _meta(job: RLJob, component: str, name: str | None = None) -> dict[str, Any]:
    meta = {"name": name or child_name(job, component), "labels": labels(job, component)}
    if job.metadata.namespace:
        meta["namespace"] = job.metadata.namespace
    return meta


# --------------------------------------------------------------------------- job config


def config_hash(job: RLJob) -> str:
    """Changes when what the pods run changes, but not for replicas or suspend: scaling and
    suspending must not restart the pods that keep running."""
    manifest = job.resolved()
    spec = manifest["spec"]
    spec["suspend"] = False
    for section in ("rollout", "reward", "trainer", "buffer"):
        spec[section]["replicas"] = 1
    return hashlib.sha256(yaml.safe_dump(manifest, sort_keys=True).encode()).hexdigest()[:16]


def config_map(job: RLJob) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(job, "config"),
        "data": {"job.yaml": yaml.safe_dump(job.resolved(), sort_keys=False)},
    }


# --------------------------------------------------------------------------- redis


def manages_redis(job: RLJob) -> bool:
    return job.spec.buffer.redis.url is None


def password_ref(job: RLJob) -> dict[str, str] | None:
    """The Secret key with the Redis password: the spec's, or the generated one (managed)."""
    ref = job.spec.buffer.redis.password_secret
    if ref is not None:
        return {"name": ref.name, "key": ref.key}
    if manages_redis(job):
        return {"name": child_name(job, "redis"), "key": "password"}
    return None


def redis_secret(job: RLJob, password: str) -> dict[str, Any] | None:
    """The generated password Secret; None when the spec names one or Redis is external.
    The handler generates `password` once and reuses the stored one ever after."""
    if not manages_redis(job) or job.spec.buffer.redis.password_secret is not None:
        return None
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": _meta(job, "redis"), "stringData": {"password": password},
    }


def redis_url(job: RLJob) -> str:
    """The URL the buffer uses (its password comes from the environment)."""
    if job.spec.buffer.redis.url is not None:
        return job.spec.buffer.redis.url
    return f"redis://{child_name(job, 'redis')}:{REDIS_PORT}/0"


def redis_url_with_password(job: RLJob) -> str:
    """For services that only take a URL: the password from the environment, expanded by the
    kubelet ($(VAR) in args), never written into an object."""
    url = redis_url(job)
    if password_ref(job) is None:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://:$({PASSWORD_ENV})@{rest}"


def redis_statefulset(job: RLJob, config: OperatorConfig) -> dict[str, Any] | None:
    if not manages_redis(job):
        return None
    aof = job.spec.buffer.redis.persistence == "aof"
    args = ["--port", str(REDIS_PORT), "--requirepass", f"$({PASSWORD_ENV})", "--dir", "/data",
            "--save", ""]
    args += ["--appendonly", "yes", "--appendfsync", "everysec"] if aof else ["--appendonly", "no"]
    container = {
        "name": "redis", "image": config.redis_image,
        "imagePullPolicy": config.image_pull_policy,
        "command": ["redis-server"], "args": args,
        "env": [_password_env(job)],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
        "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "initialDelaySeconds": 10,
                          "periodSeconds": 10, "failureThreshold": 6},
        "resources": _resources(job.spec.buffer.resources, "redis", gpus=0, custom=False),
        "securityContext": _container_security(read_only_root=True),
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    pod = _pod_spec(job, [container], uid=REDIS_UID)
    spec: dict[str, Any] = {
        "serviceName": child_name(job, "redis"), "replicas": desired_replicas(job, "redis"),
        "selector": {"matchLabels": selector_labels(job, "redis")},
        "template": {"metadata": {"labels": labels(job, "redis")}, "spec": pod},
    }
    if aof:
        spec["volumeClaimTemplates"] = [{
            "metadata": {"name": "data", "labels": labels(job, "redis")},
            "spec": {"accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": config.redis_volume_size}}},
        }]
    else:
        pod["volumes"] = [{"name": "data", "emptyDir": {}}]
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(job, "redis"),
            "spec": spec}


def redis_service(job: RLJob) -> dict[str, Any] | None:
    if not manages_redis(job):
        return None
    return _service(job, "redis", [("redis", REDIS_PORT)])


# --------------------------------------------------------------------------- services


def buffer_deployment(job: RLJob, config: OperatorConfig) -> dict[str, Any]:
    args = serve_command("buffer", job_file=JOB_FILE, redis_url=redis_url(job), host="0.0.0.0",
                         grpc_port=BUFFER_PORT, metrics_port=BUFFER_METRICS)
    env = [_password_env(job)] if password_ref(job) else []
    container = _container(job, config, "buffer", args, env=env,
                           ports=[("grpc", BUFFER_PORT), ("metrics", BUFFER_METRICS)],
                           resources=_resources(job.spec.buffer.resources, "buffer", gpus=0),
                           **_grpc_probes(BUFFER_PORT))
    return _deployment(job, config, "buffer", desired_replicas(job, "buffer"), [container])


def buffer_service(job: RLJob) -> dict[str, Any]:
    return _service(job, "buffer", [("grpc", BUFFER_PORT), ("metrics", BUFFER_METRICS)])


def reward_deployment(job: RLJob, config: OperatorConfig) -> dict[str, Any]:
    """Reward pods run untrusted programs (code reward), so they are the most locked down:
    no service-account token, no service links, read-only root, no capabilities but, for code
    rewards, the four the sandbox needs to cage each program (`_run_sandbox_as_root`)."""
    reward = job.spec.reward
    args = serve_command("reward", job_file=JOB_FILE, host="0.0.0.0", grpc_port=REWARD_PORT,
                         metrics_port=REWARD_METRICS)
    volumes, mounts = reward_volumes(job)
    container = _container(job, config, "reward", args, gpus=reward.placement.gpus,
                           ports=[("grpc", REWARD_PORT), ("metrics", REWARD_METRICS)],
                           resources=_resources(reward.resources, "reward",
                                                gpus=reward.placement.gpus),
                           **_grpc_probes(REWARD_PORT), mounts=mounts)
    deployment = _deployment(job, config, "reward", desired_replicas(job, "reward"), [container],
                             placement=reward.placement, volumes=volumes)
    pod = deployment["spec"]["template"]["spec"]
    pod["enableServiceLinks"] = False
    pod["securityContext"]["seccompProfile"] = seccomp_profile(config.reward_seccomp_profile)
    if reward.kind == "code":
        _run_sandbox_as_root(pod, container)
    return deployment


def _run_sandbox_as_root(pod: dict, container: dict) -> None:
    """Non-root, the sandbox would need a user namespace, and there the kernel refuses the
    fresh /proc of each run under the runtime's masked /proc paths whatever the seccomp
    profile (`procMount: Unmasked` needs `hostUsers: false`, which few runtimes support). As
    root with SANDBOX_CAPABILITIES it builds its namespaces; each program runs as a dedicated
    uid with no capabilities and no-new-privs."""
    pod["securityContext"].update(runAsNonRoot=False, runAsUser=0, runAsGroup=0, fsGroup=0)
    container["securityContext"]["capabilities"]["add"] = list(SANDBOX_CAPABILITIES)


def seccomp_profile(text: str) -> dict[str, str]:
    kind, _, path = text.partition(":")
    if kind in ("RuntimeDefault", "Unconfined") and not path:
        return {"type": kind}
    if kind == "Localhost" and path:
        return {"type": "Localhost", "localhostProfile": path}
    raise ValueError(f"seccomp profile {text!r}: expected RuntimeDefault, Unconfined or "
                     "Localhost:<profile path relative to the kubelet's seccomp folder>")


def reward_service(job: RLJob) -> dict[str, Any]:
    return _service(job, "reward", [("grpc", REWARD_PORT), ("metrics", REWARD_METRICS)])


def rollout_deployment(job: RLJob, config: OperatorConfig) -> dict[str, Any]:
    rollout = job.spec.rollout
    args = serve_command(
        "rollout", job_file=JOB_FILE, host="0.0.0.0", http_port=ROLLOUT_HTTP,
        grpc_port=ROLLOUT_GRPC, buffer_address=f"{child_name(job, 'buffer')}:{BUFFER_PORT}",
        reward_address=f"{child_name(job, 'reward')}:{REWARD_PORT}",
        redis_url=redis_url_with_password(job), worker="$(POD_NAME)",
        weights_address=(f"{trainer_rendezvous_host(job)}:{WEIGHTS_PORT}"
                         if distributed_weights(job) else None))
    env = [_pod_name_env()] + ([_password_env(job)] if password_ref(job) else [])
    health = {"httpGet": {"path": "/health", "port": "http"}}
    # Not ready while Redis is down (no weight updates can reach it), yet not restarted.
    ready = {"httpGet": {"path": "/ready", "port": "http"}}
    data_volumes, data_mounts = dataset_volumes(job)  # the training prompts
    container = _container(job, config, "rollout", args, env=env, gpus=rollout.placement.gpus,
                           ports=[("http", ROLLOUT_HTTP), ("grpc", ROLLOUT_GRPC)],
                           resources=_resources(rollout.resources, "rollout",
                                                gpus=rollout.placement.gpus),
                           probe=health, readiness=ready,
                           startup_seconds=rollout_startup_seconds(job),
                           mounts=[_run_mount(read_only=True), *data_mounts])
    deployment = _deployment(job, config, "rollout", desired_replicas(job, "rollout"), [container],
                             placement=rollout.placement,
                             volumes=[_run_volume(job), *data_volumes])
    pod = deployment["spec"]["template"]["spec"]
    if rollout.placement.gpus:
        _add_shared_memory(pod, container)
        # Spread replicas over the GPU pool's nodes.
        pod["affinity"] = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100,
            "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                "labelSelector": {"matchLabels": selector_labels(job, "rollout")}},
        }]}}
    # New weights reach workers in place; a config change replaces them one at a time.
    deployment["spec"]["strategy"] = {"type": "RollingUpdate",
                                      "rollingUpdate": {"maxUnavailable": 1, "maxSurge": 0}}
    return deployment


def rollout_startup_seconds(job: RLJob) -> float:
    """How long a rollout worker may take to answer /health. With engine sglang it answers only
    once the SGLang server it launched is healthy, which it allows SGLANG_STARTUP_SECONDS: the
    probe waits for the worker's own start plus that."""
    if job.spec.rollout.engine == "sglang":
        return STARTUP_SECONDS + SGLANG_STARTUP_SECONDS
    return STARTUP_SECONDS


def rollout_service(job: RLJob) -> dict[str, Any]:
    return _service(job, "rollout", [("http", ROLLOUT_HTTP), ("grpc", ROLLOUT_GRPC)])


def trainer_statefulset(job: RLJob, config: OperatorConfig) -> dict[str, Any]:
    """Trainer pods: `replicas` nodes x `processesPerReplica` processes. More than one process
    in all runs under torchrun: on its own in a single pod (`--standalone`), else meeting at
    pod 0 through the headless Service, each pod starting torchrun only once that rendezvous
    can work (`rendezvous_wait_container`). A template change restarts the pods, and the
    trainer resumes from the last checkpoint in the run volume."""
    trainer = job.spec.trainer
    serve = serve_command(
        "trainer", job_file=JOB_FILE, host="0.0.0.0", grpc_port=TRAINER_PORT,
        metrics_port=TRAINER_METRICS, buffer_address=f"{child_name(job, 'buffer')}:{BUFFER_PORT}",
        reward_address=f"{child_name(job, 'reward')}:{REWARD_PORT}", run_dir=RUN_DIR,
        consumer="$(POD_NAME)")
    env = [_pod_name_env(),
           {"name": "ASYNCRL_NNODES", "value": str(trainer.replicas)},
           {"name": "ASYNCRL_NPROC_PER_NODE", "value": str(trainer.processes_per_replica)}]
    command = None
    rendezvous_host = trainer_rendezvous_host(job) if trainer.replicas > 1 else None
    if trainer.replicas * trainer.processes_per_replica > 1:
        # A rank that dies stops the pod's torchrun (no --max-restarts); the pod restarts and
        # every node resumes from the last checkpoint.
        command = ["torchrun", *torchrun_arguments(
            trainer.processes_per_replica, nnodes=trainer.replicas,
            rendezvous_endpoint=(f"{rendezvous_host}:{RENDEZVOUS_PORT}" if rendezvous_host
                                 else None),
            rendezvous_id=job.metadata.name)]
    data_volumes, data_mounts = dataset_volumes(job)  # the evaluation prompts
    container = _container(job, config, "trainer", serve, env=env, command=command,
                           gpus=trainer.placement.gpus,
                           ports=trainer_ports(job),
                           resources=_resources(trainer.resources, "trainer",
                                                gpus=trainer.placement.gpus),
                           **_grpc_probes(TRAINER_PORT), mounts=[_run_mount(), *data_mounts])
    pod = _pod_spec(job, [container], placement=trainer.placement,
                    volumes=[_run_volume(job), *data_volumes],
                    gpu_tolerations=config.gpu_tolerations)
    if trainer.placement.gpus:
        _add_shared_memory(pod, container)
    if rendezvous_host:
        pod["initContainers"] = [rendezvous_wait_container(
            rendezvous_host, image=image_for(config, trainer.placement.gpus),
            pull_policy=config.image_pull_policy)]
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": _meta(job, "trainer"),
        "spec": {
            "serviceName": child_name(job, "trainer-headless"),
            "replicas": desired_replicas(job, "trainer"),
            # All nodes of a torch job start together; none waits for another to be Ready.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector_labels(job, "trainer")},
            "template": _template(job, "trainer", pod),
        },
    }


def distributed_weights(job: RLJob) -> bool:
    return job.spec.trainer.weight_transfer == "distributed"


def trainer_ports(job: RLJob) -> list[tuple[str, int]]:
    """The trainer's ports; with distributed weights also the transfer group's store, where
    rollout workers join (through the headless Service: pod 0's stable name)."""
    ports = [("grpc", TRAINER_PORT), ("metrics", TRAINER_METRICS), ("rendezvous", RENDEZVOUS_PORT)]
    return ports + ([("weights", WEIGHTS_PORT)] if distributed_weights(job) else [])


def trainer_rendezvous_host(job: RLJob) -> str:
    """Trainer pod 0's name under the headless Service: torchrun's rendezvous across pods."""
    return f"{child_name(job, 'trainer')}-0.{child_name(job, 'trainer-headless')}"


#: Run by `rendezvous_wait_container` as `python -c WAIT_FOR_RENDEZVOUS <host> <port>`.
WAIT_FOR_RENDEZVOUS = """\
import os, socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
hosting = host.split(".")[0] == socket.gethostname()
while True:
    try:
        if hosting:
            if os.environ["POD_IP"] in {a[4][0] for a in socket.getaddrinfo(host, port)}:
                break
        else:
            socket.create_connection((host, port), timeout=5).close()
            break
    except OSError:
        pass
    print(f"waiting for the trainer rendezvous at {host}:{port}", flush=True)
    time.sleep(2)
"""


def rendezvous_wait_container(host: str, *, image: str, pull_policy: str) -> dict[str, Any]:
    """Init container of a multi-pod trainer. torch's c10d rendezvous picks the pod that hosts
    its store by resolving the endpoint's name when torchrun starts, and the other pods give
    up after 60 s without a store: pod 0 waits until its name under the headless Service
    resolves to its own address, the others until pod 0's store accepts connections (pod 0
    may still be pulling the image). Otherwise torchrun fails and the pod restarts, and a
    trainer restarting `trainer_max_restarts` times fails the job."""
    return {
        "name": "wait-for-rendezvous", "image": image, "imagePullPolicy": pull_policy,
        "command": ["python", "-c", WAIT_FOR_RENDEZVOUS, host, str(RENDEZVOUS_PORT)],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}},
        "securityContext": _container_security(read_only_root=True),
    }


def trainer_headless_service(job: RLJob) -> dict[str, Any]:
    ports = [p for p in trainer_ports(job) if p[0] != "metrics"]
    service = _service(job, "trainer", ports, name=child_name(job, "trainer-headless"))
    service["spec"]["clusterIP"] = "None"
    # Rendezvous happens before any trainer is Ready.
    service["spec"]["publishNotReadyAddresses"] = True
    return service


def run_volume_claim(job: RLJob, config: OperatorConfig) -> dict[str, Any]:
    """Checkpoints, metrics and weight snapshots. The trainer writes, every rollout worker
    reads the snapshot a new version announces, so the claim is ReadWriteMany. Kept across
    suspend (it is the job's state) and deleted with the job."""
    spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"],
                            "resources": {"requests": {"storage": config.run_volume_size}}}
    if config.run_volume_storage_class:
        spec["storageClassName"] = config.run_volume_storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": _meta(job, "run"),
            "spec": spec}


# --------------------------------------------------------------------------- network policies


def _network_policy(job: RLJob, component: str, *, ingress: list[dict],
                    deny_egress: bool = False) -> dict[str, Any]:
    spec: dict[str, Any] = {"podSelector": {"matchLabels": selector_labels(job, component)},
                            "policyTypes": ["Ingress"], "ingress": ingress}
    if deny_egress:
        # Egress listed with no egress rules denies it all. (An explicit `egress: []` is
        # dropped by the API server, so every apply would change the object again.)
        spec["policyTypes"].append("Egress")
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": _meta(job, component), "spec": spec}


def _from_own_pods(job: RLJob, ports: list[int] | None) -> dict[str, Any]:
    """From the job's own pods, on `ports` (None: every port)."""
    rule: dict[str, Any] = {
        "from": [{"podSelector": {"matchLabels": {JOB_LABEL: job.metadata.name}}}]}
    if ports is not None:
        rule["ports"] = [{"protocol": "TCP", "port": port} for port in ports]
    return rule


def _from_operator(port: int) -> dict[str, Any]:
    """The operator's pods, in whatever namespace the chart put them, read the figures of
    status (buffer statistics, trainer status)."""
    return {"from": [{"namespaceSelector": {},
                      "podSelector": {"matchLabels": {OPERATOR_LABEL: "true"}}}],
            "ports": [{"protocol": "TCP", "port": port}]}


def _from_anywhere(ports: list[int]) -> dict[str, Any]:
    """Metrics: Prometheus runs wherever the platform team put it."""
    return {"ports": [{"protocol": "TCP", "port": port} for port in ports]}


def redis_network_policy(job: RLJob, config: OperatorConfig) -> dict[str, Any] | None:
    if not config.network_policies or not manages_redis(job):
        return None
    return _network_policy(job, "redis", ingress=[_from_own_pods(job, [REDIS_PORT])])


def buffer_network_policy(job: RLJob, config: OperatorConfig) -> dict[str, Any] | None:
    if not config.network_policies:
        return None
    return _network_policy(job, "buffer", ingress=[
        _from_own_pods(job, [BUFFER_PORT]), _from_operator(BUFFER_PORT),
        _from_anywhere([BUFFER_METRICS])])


def trainer_network_policy(job: RLJob, config: OperatorConfig) -> dict[str, Any] | None:
    """The job's own pods on every port (torchrun's rendezvous, then the process group's
    ports, which torch.distributed picks at run time); the operator on the status port."""
    if not config.network_policies:
        return None
    return _network_policy(job, "trainer", ingress=[
        _from_own_pods(job, None), _from_operator(TRAINER_PORT),
        _from_anywhere([TRAINER_METRICS])])


def reward_network_policy(job: RLJob, config: OperatorConfig) -> dict[str, Any] | None:
    """Reward pods may run untrusted programs: no egress at all (not even DNS), and only the
    job's own pods may ask for scores. Reward kind http runs none, and calls its endpoint
    wherever it is served: its egress stays open."""
    if not config.network_policies:
        return None
    return _network_policy(job, "reward", deny_egress=job.spec.reward.kind != "http", ingress=[
        _from_own_pods(job, [REWARD_PORT]), _from_anywhere([REWARD_METRICS])])


def build_children(job: RLJob, config: OperatorConfig, *, redis_password: str) -> list[dict]:
    """Everything the job owns, in the order it is applied (dependencies first)."""
    children = [
        config_map(job),
        redis_network_policy(job, config),
        buffer_network_policy(job, config),
        trainer_network_policy(job, config),
        reward_network_policy(job, config),
        redis_secret(job, redis_password),
        redis_service(job),
        redis_statefulset(job, config),
        run_volume_claim(job, config),
        buffer_service(job),
        buffer_deployment(job, config),
        reward_service(job),
        reward_deployment(job, config),
        trainer_headless_service(job),
        trainer_statefulset(job, config),
        rollout_service(job),
        rollout_deployment(job, config),
    ]
    return [child for child in children if child is not None]


#: Workloads whose readiness makes the job Running: (kind, component).
WORKLOADS = (("StatefulSet", "redis"), ("Deployment", "buffer"), ("Deployment", "reward"),
             ("StatefulSet", "trainer"), ("Deployment", "rollout"))


def workloads(job: RLJob) -> list[tuple[str, str]]:
    return [(kind, component) for kind, component in WORKLOADS
            if component != "redis" or manages_redis(job)]


def desired_replicas(job: RLJob, component: str) -> int:
    if component == "redis":
        return 1
    if component == "buffer":  # it keeps serving a suspended job (GetStats, the gate)
        return job.spec.buffer.replicas
    if job.spec.suspend:
        return 0
    return getattr(job.spec, component).replicas


# --------------------------------------------------------------------------- pieces


def _service(job: RLJob, component: str, ports: list[tuple[str, int]], *,
             name: str | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": _meta(job, component, name),
        "spec": {"selector": selector_labels(job, component),
                 "ports": [{"name": port_name, "port": port, "targetPort": port_name,
                            "protocol": "TCP"} for port_name, port in ports]},
    }


def _deployment(job: RLJob, config: OperatorConfig, component: str, replicas: int,
                containers: list[dict], *, placement=None, volumes=()) -> dict[str, Any]:
    pod = _pod_spec(job, containers, placement=placement, volumes=volumes,
                    gpu_tolerations=config.gpu_tolerations)
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": _meta(job, component),
        "spec": {"replicas": replicas, "selector": {"matchLabels": selector_labels(job, component)},
                 "template": _template(job, component, pod)},
    }


def _template(job: RLJob, component: str, pod: dict) -> dict[str, Any]:
    return {"metadata": {"labels": labels(job, component),
                         "annotations": {CONFIG_HASH: config_hash(job)}},
            "spec": pod}


def _pod_spec(job: RLJob, containers: list[dict], *, placement=None, volumes=(),
              uid: int = APP_UID, gpu_tolerations=()) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid,
                            "fsGroup": uid, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": containers,
    }
    mounts_config = any(m["name"] == "config" for c in containers
                        for m in c.get("volumeMounts", []))
    all_volumes = list(volumes)
    if mounts_config:
        all_volumes = [{"name": "config", "configMap": {"name": child_name(job, "config")}},
                       {"name": "tmp", "emptyDir": {}}, *all_volumes]
    if all_volumes:
        pod["volumes"] = all_volumes
    if placement is not None:
        if placement.node_selector:
            pod["nodeSelector"] = dict(placement.node_selector)
        if placement.tolerations:
            pod["tolerations"] = [
                t.model_dump(mode="json", by_alias=True, exclude_none=True, exclude_defaults=False)
                for t in placement.tolerations]
            for toleration in pod["tolerations"]:
                if toleration.get("effect") == "":
                    del toleration["effect"]
        elif placement.gpus and gpu_tolerations:
            pod["tolerations"] = [dict(t) for t in gpu_tolerations]
    return pod


def image_for(config: OperatorConfig, gpus: int) -> str:
    """The GPU image (CUDA torch, SGLang) for a component that requests GPUs, else the CPU
    one."""
    return config.gpu_image if gpus else config.image


def _container(job: RLJob, config: OperatorConfig, component: str, args: list[str], *,
               ports: list[tuple[str, int]], resources: dict, probe: dict, gpus: int = 0,
               env: list[dict] = (), command: list[str] | None = None,
               mounts: list[dict] = (), readiness: dict | None = None,
               startup_seconds: float = STARTUP_SECONDS) -> dict[str, Any]:
    """`probe` checks start-up and liveness, and readiness too unless `readiness` is given."""
    container = {
        "name": component, "image": image_for(config, gpus),
        "imagePullPolicy": config.image_pull_policy,
        "command": command or ["asyncrl"], "args": args,
        "env": [{"name": "HOME", "value": "/tmp"}, {"name": "PYTHONUNBUFFERED", "value": "1"},
                *env],
        "ports": [{"name": name, "containerPort": port, "protocol": "TCP"}
                  for name, port in ports],
        # Model loading can take minutes; the startup probe holds the others off until then.
        "startupProbe": {**probe, "periodSeconds": PROBE_PERIOD,
                         "failureThreshold": math.ceil(startup_seconds / PROBE_PERIOD)},
        "readinessProbe": {**(readiness or probe), "periodSeconds": PROBE_PERIOD,
                           "failureThreshold": 3},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 6},
        "resources": resources,
        "securityContext": _container_security(read_only_root=True),
        "volumeMounts": [{"name": "config", "mountPath": "/etc/asyncrl", "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}, *mounts],
    }
    return container


def _grpc_probes(port: int) -> dict[str, dict]:
    """The kubelet's native gRPC probes of grpc.health.v1 (asyncrl.platform.grpc_health): start-up and
    liveness ask whether the process answers, readiness whether it can work (the buffer's
    Redis, a code job's sandbox), so an outage makes the pod unready, not restarted."""
    return {"probe": {"grpc": {"port": port, "service": LIVENESS}},
            "readiness": {"grpc": {"port": port}}}


def _container_security(*, read_only_root: bool) -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": read_only_root,
            "capabilities": {"drop": ["ALL"]}}


def _resources(spec_resources, component: str, *, gpus: int, custom: bool = True) -> dict:
    requests = dict(spec_resources.requests) if custom else {}
    limits = dict(spec_resources.limits) if custom else {}
    if not requests and not limits:
        requests = dict(DEFAULT_REQUESTS[component])
    if gpus:
        # Extended resources: requests must equal limits.
        requests[GPU_RESOURCE] = gpus
        limits[GPU_RESOURCE] = gpus
    out: dict[str, Any] = {}
    if requests:
        out["requests"] = {k: str(v) for k, v in requests.items()}
    if limits:
        out["limits"] = {k: str(v) for k, v in limits.items()}
    return out


def _password_env(job: RLJob) -> dict[str, Any]:
    return {"name": PASSWORD_ENV, "valueFrom": {"secretKeyRef": password_ref(job)}}


def _pod_name_env() -> dict[str, Any]:
    return {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}


def _run_volume(job: RLJob) -> dict[str, Any]:
    return {"name": "run", "persistentVolumeClaim": {"claimName": child_name(job, "run")}}


def _run_mount(read_only: bool = False) -> dict[str, Any]:
    return {"name": "run", "mountPath": RUN_DIR, "readOnly": read_only}


def dataset_volumes(job: RLJob) -> tuple[list[dict], list[dict]]:
    """The pod volume and container mount of spec.dataset.volume (none without one): at the
    first folder of dataset.path, where the spec has both path and evalPath."""
    dataset = job.spec.dataset
    if dataset.volume is None:
        return [], []
    return _claim_read_only(DATASET_VOLUME, dataset.volume, mount_folder(dataset.path))


def reward_volumes(job: RLJob) -> tuple[list[dict], list[dict]]:
    """The pod volume and container mount of spec.reward.python.volume (none without one): at
    the first folder of reward.python.path, the folder the reward's module is imported from."""
    python = job.spec.reward.python
    if python is None or python.volume is None:
        return [], []
    return _claim_read_only(REWARD_VOLUME, python.volume, mount_folder(python.path))


def mount_folder(path: str) -> str:
    """The first folder of an absolute path: /data/gsm8k/train.jsonl is mounted at /data."""
    return "/" + PurePosixPath(path).parts[1]


def _claim_read_only(name: str, claim: str, mount_path: str) -> tuple[list[dict], list[dict]]:
    """A user's claim, read-only twice over: the volume (so a ReadOnlyMany claim attaches, and
    one claim can serve many jobs) and the mount (the job never writes the user's files)."""
    return ([{"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}],
            [{"name": name, "mountPath": mount_path, "readOnly": True}])


def _add_shared_memory(pod: dict, container: dict) -> None:
    """NCCL and SGLang need a /dev/shm larger than the runtime's 64 MiB default."""
    pod.setdefault("volumes", []).append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
