"""The rollout workers' Deployment and Service (HTTP 30000, gRPC 50061): generation, on GPUs
from the job's node pool where it asks for them, spread over its nodes."""

from __future__ import annotations

from typing import Any

from asyncrl.operator.builders.common import (
    BUFFER_PORT,
    JOB_FILE,
    REWARD_PORT,
    ROLLOUT_GRPC,
    ROLLOUT_HTTP,
    WEIGHTS_PORT,
    OperatorConfig,
    child_name,
    desired_replicas,
    selector_labels,
)
from asyncrl.operator.builders.pods import (
    STARTUP_SECONDS,
    add_shared_memory,
    build_deployment,
    build_service,
    pod_name_env,
    resource_requirements,
    service_container,
)
from asyncrl.operator.builders.model import hub_env, wait_for_model_container
from asyncrl.operator.builders.redis import password_env, password_ref, redis_url_with_password
from asyncrl.operator.builders.trainer import distributed_weights, trainer_rendezvous_host
from asyncrl.operator.builders.volumes import (
    dataset_volumes,
    run_mount,
    run_volume,
    workflow_volumes,
)
from asyncrl.platform.settings import SGLANG_STARTUP_SECONDS, serve_command
from asyncrl.spec import RLJob


def rollout_deployment(job: RLJob, config: OperatorConfig) -> dict[str, Any]:
    rollout = job.spec.rollout
    args = serve_command(
        "rollout", job_file=JOB_FILE, host="0.0.0.0", http_port=ROLLOUT_HTTP,
        grpc_port=ROLLOUT_GRPC, buffer_address=f"{child_name(job, 'buffer')}:{BUFFER_PORT}",
        reward_address=f"{child_name(job, 'reward')}:{REWARD_PORT}",
        redis_url=redis_url_with_password(job), worker="$(POD_NAME)",
        weights_address=(f"{trainer_rendezvous_host(job)}:{WEIGHTS_PORT}"
                         if distributed_weights(job) else None))
    env = [pod_name_env(), *hub_env(job)] + ([password_env(job)] if password_ref(job) else [])
    health = {"httpGet": {"path": "/health", "port": "http"}}
    # Not ready while Redis is down (no weight updates can reach it), yet not restarted.
    ready = {"httpGet": {"path": "/ready", "port": "http"}}
    data_volumes, data_mounts = dataset_volumes(job)  # the training prompts
    episode_volumes, episode_mounts = workflow_volumes(job)  # an episode job's module
    container = service_container(job, config, "rollout", args, env=env,
                                  gpus=rollout.placement.gpus,
                                  ports=[("http", ROLLOUT_HTTP), ("grpc", ROLLOUT_GRPC)],
                                  resources=resource_requirements(rollout.resources, "rollout",
                                                                  gpus=rollout.placement.gpus),
                                  probe=health, readiness=ready,
                                  startup_seconds=rollout_startup_seconds(job),
                                  mounts=[run_mount(read_only=True), *data_mounts,
                                          *episode_mounts])
    deployment = build_deployment(job, config, "rollout", desired_replicas(job, "rollout"),
                                  [container], placement=rollout.placement,
                                  volumes=[run_volume(job), *data_volumes, *episode_volumes])
    pod = deployment["spec"]["template"]["spec"]
    wait = wait_for_model_container(job, config, rollout.placement.gpus)
    if wait is not None:
        pod["initContainers"] = [wait]
    if rollout.placement.gpus:
        add_shared_memory(pod, container)
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
    return build_service(job, "rollout", [("http", ROLLOUT_HTTP), ("grpc", ROLLOUT_GRPC)])
