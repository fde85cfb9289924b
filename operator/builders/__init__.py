"""Child objects of an RLJob, as pure functions from the validated job to Kubernetes dicts.

Every builder takes the parsed `RLJob` (and the operator's `OperatorConfig`) and returns one
plain dict, the object the operator applies (server-side apply, so applying the same dict again
changes nothing). Builders never talk to the API server; `asyncrl.operator.reconcile` adds
owner references (`kopf.adopt`) and applies what `build_children` returns. Names are
`<job>-<component>`.

What runs where, and which module builds it:

    <job>-config    ConfigMap        the resolved job (every default filled in, the weight
                                     transfer path taken: auto is disk), job.yaml (config)
    <job>-redis     Secret           generated Redis password (managed Redis without a secret)
    <job>-redis     StatefulSet+Svc  managed Redis (absent when spec.buffer.redis.url is set)
                                     (redis)
    <job>-buffer    Deployment+Svc   staleness gate and batches (gRPC 50051, metrics 9101)
                                     (buffer)
    <job>-reward    Deployment+Svc   scoring, hardened pods (gRPC 50081, metrics 9102); for
                    code rewards root with the sandbox's four capabilities (SANDBOX_CAPABILITIES)
                                     (reward)
    <job>-rollout   Deployment+Svc   generation; GPUs, node pool, tolerations (HTTP 30000, gRPC 50061)
                                     (rollout)
    <job>-trainer   StatefulSet      PPO updates, nodes x processes via torchrun (gRPC 50071)
    <job>-trainer-headless  Service  stable pod DNS for torch rendezvous (29400) and, with
                                     trainer.weightTransfer distributed, the weight
                                     transfer group's store (29500) (trainer)
    <job>-run       PVC              checkpoints and weight snapshots: trainer writes, rollout reads
    (the user's)    PVC              spec.dataset.volume, read-only in the rollout and trainer
                                     pods; spec.reward.python.volume, read-only in the reward pods;
                                     spec.rollout.workflow.volume, read-only in the rollout pods
                                     (volumes)
    <job>-redis, <job>-buffer, <job>-trainer, <job>-reward   NetworkPolicy   only the job's own
                    pods (and the operator, for buffer statistics and trainer status) reach
                    Redis, the buffer and the trainer; reward pods, which may run untrusted
                    programs, make no outgoing connection at all (but to a reward kind
                    http's endpoint); <job>-rollout, episode jobs only: their rollout pods
                    reach DNS, the job's own services and rollout.workflow.egress (network)

`common` holds the operator's settings, names, labels, ports and replica counts; `pods` the
pieces every workload is made of (containers, probes, pod specs, Services, Deployments);
`children` the whole list in the order it is applied.

Pods of a component that requests GPUs (`placement.gpus` > 0) run `OperatorConfig.gpu_image`
(CUDA torch and SGLang), the others `OperatorConfig.image` (CPU torch).
"""

from asyncrl.operator.builders.buffer import buffer_deployment, buffer_service
from asyncrl.operator.builders.children import WORKLOADS, build_children, workloads
from asyncrl.operator.builders.common import (
    BUFFER_METRICS,
    BUFFER_PORT,
    JOB_FILE,
    JOB_LABEL,
    MANAGED_BY,
    REDIS_PORT,
    RENDEZVOUS_PORT,
    REWARD_METRICS,
    REWARD_PORT,
    ROLLOUT_GRPC,
    ROLLOUT_HTTP,
    RUN_DIR,
    TRAINER_METRICS,
    TRAINER_PORT,
    WEIGHTS_PORT,
    OperatorConfig,
    child_name,
    desired_replicas,
    labels,
    selector_labels,
)
from asyncrl.operator.builders.config import CONFIG_HASH, config_hash, config_map
from asyncrl.operator.builders.network import (
    OPERATOR_LABEL,
    buffer_network_policy,
    redis_network_policy,
    reward_network_policy,
    rollout_network_policy,
    trainer_network_policy,
)
from asyncrl.operator.builders.pods import (
    APP_UID,
    DEFAULT_REQUESTS,
    PROBE_PERIOD,
    REDIS_UID,
    STARTUP_SECONDS,
    image_for,
)
from asyncrl.operator.builders.redis import (
    PASSWORD_ENV,
    manages_redis,
    password_ref,
    redis_secret,
    redis_service,
    redis_statefulset,
    redis_url,
    redis_url_with_password,
)
from asyncrl.operator.builders.reward import (
    SANDBOX_CAPABILITIES,
    reward_deployment,
    reward_service,
    seccomp_profile,
)
from asyncrl.operator.builders.rollout import (
    rollout_deployment,
    rollout_service,
    rollout_startup_seconds,
)
from asyncrl.operator.builders.trainer import (
    WAIT_FOR_RENDEZVOUS,
    distributed_weights,
    rendezvous_wait_container,
    trainer_headless_service,
    trainer_ports,
    trainer_rendezvous_host,
    trainer_statefulset,
)
from asyncrl.operator.builders.volumes import (
    DATASET_VOLUME,
    REWARD_VOLUME,
    WORKFLOW_VOLUME,
    dataset_volumes,
    mount_folder,
    reward_volumes,
    run_volume_claim,
    workflow_volumes,
)

__all__ = [
    "APP_UID", "BUFFER_METRICS", "BUFFER_PORT", "CONFIG_HASH", "DATASET_VOLUME",
    "DEFAULT_REQUESTS", "JOB_FILE", "JOB_LABEL", "MANAGED_BY", "OPERATOR_LABEL",
    "OperatorConfig", "PASSWORD_ENV", "PROBE_PERIOD", "REDIS_PORT", "REDIS_UID",
    "RENDEZVOUS_PORT", "REWARD_METRICS", "REWARD_PORT", "REWARD_VOLUME", "ROLLOUT_GRPC",
    "ROLLOUT_HTTP", "RUN_DIR", "SANDBOX_CAPABILITIES", "STARTUP_SECONDS", "TRAINER_METRICS",
    "TRAINER_PORT", "WAIT_FOR_RENDEZVOUS", "WEIGHTS_PORT", "WORKFLOW_VOLUME", "WORKLOADS",
    "buffer_deployment", "buffer_network_policy", "buffer_service", "build_children",
    "child_name", "config_hash", "config_map", "dataset_volumes", "desired_replicas",
    "distributed_weights", "image_for", "labels", "manages_redis", "mount_folder",
    "password_ref", "redis_network_policy", "redis_secret", "redis_service",
    "redis_statefulset", "redis_url", "redis_url_with_password", "rendezvous_wait_container",
    "reward_deployment", "reward_network_policy", "reward_service", "reward_volumes",
    "rollout_deployment", "rollout_network_policy", "rollout_service",
    "rollout_startup_seconds", "run_volume_claim", "seccomp_profile", "selector_labels",
    "trainer_headless_service", "trainer_network_policy", "trainer_ports",
    "trainer_rendezvous_host", "trainer_statefulset", "workflow_volumes", "workloads",
]
