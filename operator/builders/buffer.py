"""The buffer's Deployment and Service: the staleness gate and batches, in front of Redis
(gRPC 50051, metrics 9101). It keeps serving a suspended job."""

from __future__ import annotations

from typing import Any

from asyncrl.operator.builders.common import (
    BUFFER_METRICS,
    BUFFER_PORT,
    JOB_FILE,
    OperatorConfig,
    desired_replicas,
)
from asyncrl.operator.builders.pods import (
    build_deployment,
    build_service,
    grpc_probes,
    resource_requirements,
    service_container,
)
from asyncrl.operator.builders.redis import password_env, password_ref, redis_url
from asyncrl.platform.settings import serve_command
from asyncrl.spec import RLJob


def buffer_deployment(job: RLJob, config: OperatorConfig) -> dict[str, Any]:
    args = serve_command("buffer", job_file=JOB_FILE, redis_url=redis_url(job), host="0.0.0.0",
                         grpc_port=BUFFER_PORT, metrics_port=BUFFER_METRICS)
    env = [password_env(job)] if password_ref(job) else []
    container = service_container(
        job, config, "buffer", args, env=env,
        ports=[("grpc", BUFFER_PORT), ("metrics", BUFFER_METRICS)],
        resources=resource_requirements(job.spec.buffer.resources, "buffer", gpus=0),
        **grpc_probes(BUFFER_PORT))
    return build_deployment(job, config, "buffer", desired_replicas(job, "buffer"), [container])


def buffer_service(job: RLJob) -> dict[str, Any]:
    return build_service(job, "buffer", [("grpc", BUFFER_PORT), ("metrics", BUFFER_METRICS)])
