"""What every builder shares: the operator's own settings (`OperatorConfig`), the labels and
names of a job's children, their ports, and how many replicas each workload should have."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import asyncrl
from asyncrl.platform.endpoints import port
from asyncrl.spec import GPU_RESOURCE, RLJob

MANAGED_BY = "asyncrl-operator"
JOB_LABEL = "asyncrl.io/job"

JOB_FILE = "/etc/asyncrl/job.yaml"
RUN_DIR = "/run/asyncrl"

# The ports of asyncrl.platform.endpoints, by the names the builders use.
BUFFER_PORT, BUFFER_METRICS = port("buffer", "grpc"), port("buffer", "metrics")
REWARD_PORT, REWARD_METRICS = port("reward", "grpc"), port("reward", "metrics")
ROLLOUT_HTTP, ROLLOUT_GRPC = port("rollout", "http"), port("rollout", "grpc")
TRAINER_PORT, TRAINER_METRICS = port("trainer", "grpc"), port("trainer", "metrics")
RENDEZVOUS_PORT, REDIS_PORT = port("trainer", "rendezvous"), port("redis", "redis")
WEIGHTS_PORT = port("trainer", "weights")


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
    #: The Hub (or mirror) that Hub models are downloaded from: the operator's HF_ENDPOINT,
    #: passed on to the download; None for huggingface_hub's default.
    hub_endpoint: str | None = None


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


def object_meta(job: RLJob, component: str, name: str | None = None) -> dict[str, Any]:
    """A child's metadata: its name (`<job>-<component>` unless given), labels, namespace."""
    meta = {"name": name or child_name(job, component), "labels": labels(job, component)}
    if job.metadata.namespace:
        meta["namespace"] = job.metadata.namespace
    return meta


# --------------------------------------------------------------------------- replicas


def desired_replicas(job: RLJob, component: str) -> int:
    if component == "redis":
        return 1
    if component == "buffer":  # it keeps serving a suspended job (GetStats, the gate)
        return job.spec.buffer.replicas
    if job.spec.suspend:
        return 0
    return getattr(job.spec, component).replicas
