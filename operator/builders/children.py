"""Everything a job owns, in the order it is applied, and the workloads whose readiness
makes it Running."""

from __future__ import annotations

from asyncrl.operator.builders.buffer import buffer_deployment, buffer_service
from asyncrl.operator.builders.common import OperatorConfig
from asyncrl.operator.builders.config import config_map
from asyncrl.operator.builders.network import (
    buffer_network_policy,
    redis_network_policy,
    reward_network_policy,
    rollout_network_policy,
    trainer_network_policy,
)
from asyncrl.operator.builders.redis import (
    manages_redis,
    redis_secret,
    redis_service,
    redis_statefulset,
)
from asyncrl.operator.builders.reward import reward_deployment, reward_service
from asyncrl.operator.builders.rollout import rollout_deployment, rollout_service
from asyncrl.operator.builders.trainer import trainer_headless_service, trainer_statefulset
from asyncrl.operator.builders.volumes import run_volume_claim
from asyncrl.spec import RLJob


def build_children(job: RLJob, config: OperatorConfig, *, redis_password: str) -> list[dict]:
    """Everything the job owns, in the order it is applied (dependencies first)."""
    children = [
        config_map(job),
        redis_network_policy(job, config),
        buffer_network_policy(job, config),
        trainer_network_policy(job, config),
        reward_network_policy(job, config),
        rollout_network_policy(job, config),
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
