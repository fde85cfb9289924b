"""The job's Redis, where the buffer keeps all state that must survive a restart: managed (a
StatefulSet, its Service and a generated password Secret) unless spec.buffer.redis.url names
one, and how the services reach it (its URL, the password from a Secret through the
environment)."""

from __future__ import annotations

from typing import Any

from asyncrl.operator.builders.common import (
    REDIS_PORT,
    OperatorConfig,
    child_name,
    desired_replicas,
    labels,
    object_meta,
    selector_labels,
)
from asyncrl.operator.builders.pods import (
    REDIS_UID,
    build_service,
    container_security,
    pod_spec,
    resource_requirements,
)
from asyncrl.spec import RLJob

PASSWORD_ENV = "ASYNCRL_REDIS_PASSWORD"


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


def password_env(job: RLJob) -> dict[str, Any]:
    return {"name": PASSWORD_ENV, "valueFrom": {"secretKeyRef": password_ref(job)}}


def redis_secret(job: RLJob, password: str) -> dict[str, Any] | None:
    """The generated password Secret; None when the spec names one or Redis is external.
    The operator generates `password` once and reuses the stored one ever after."""
    if not manages_redis(job) or job.spec.buffer.redis.password_secret is not None:
        return None
    return {
        "apiVersion": "v1", "kind": "Secret", "type": "Opaque",
        "metadata": object_meta(job, "redis"), "stringData": {"password": password},
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
        "env": [password_env(job)],
        "ports": [{"name": "redis", "containerPort": REDIS_PORT}],
        "readinessProbe": {"tcpSocket": {"port": "redis"}, "periodSeconds": 5},
        "livenessProbe": {"tcpSocket": {"port": "redis"}, "initialDelaySeconds": 10,
                          "periodSeconds": 10, "failureThreshold": 6},
        "resources": resource_requirements(job.spec.buffer.resources, "redis", gpus=0,
                                           custom=False),
        "terminationMessagePolicy": "FallbackToLogsOnError",  # quoted by spec.backoffLimit
        "securityContext": container_security(read_only_root=True),
        "volumeMounts": [{"name": "data", "mountPath": "/data"}],
    }
    pod = pod_spec(job, [container], uid=REDIS_UID)
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
    return {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": object_meta(job, "redis"),
            "spec": spec}


def redis_service(job: RLJob) -> dict[str, Any] | None:
    if not manages_redis(job):
        return None
    return build_service(job, "redis", [("redis", REDIS_PORT)])
