"""The pieces every workload is made of: Services, Deployments, pod templates and specs,
service containers with their probes, security contexts and resources.

Pods run as an unprivileged user with no capabilities, a read-only root filesystem and no
service-account token. Pods of a component that requests GPUs (`placement.gpus` > 0) run
`OperatorConfig.gpu_image` (CUDA torch and SGLang), the others `OperatorConfig.image` (CPU
torch).
"""

from __future__ import annotations

import math
from typing import Any

from asyncrl.operator.builders.common import (
    OperatorConfig,
    child_name,
    labels,
    object_meta,
    selector_labels,
)
from asyncrl.operator.builders.config import CONFIG_HASH, config_hash
from asyncrl.platform.grpc_health import LIVENESS
from asyncrl.spec import GPU_RESOURCE, RLJob

#: Seconds a service container may take to start (loading a model can take minutes) before
#: its startup probe fails and the kubelet restarts it; the probe runs every PROBE_PERIOD.
STARTUP_SECONDS = 600
PROBE_PERIOD = 5

#: Unprivileged uid/gid of the asyncrl image; Redis runs as the official image's redis user.
APP_UID = 10001
REDIS_UID = 999

#: Requests of a component whose spec gives no resources at all (user values always win).
DEFAULT_REQUESTS = {
    "redis": {"cpu": "100m", "memory": "256Mi"},
    "buffer": {"cpu": "200m", "memory": "256Mi"},
    "reward": {"cpu": "500m", "memory": "512Mi"},
    "rollout": {"cpu": "1", "memory": "2Gi"},
    "trainer": {"cpu": "1", "memory": "4Gi"},
}


def build_service(job: RLJob, component: str, ports: list[tuple[str, int]], *,
                  name: str | None = None) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service", "metadata": object_meta(job, component, name),
        "spec": {"selector": selector_labels(job, component),
                 "ports": [{"name": port_name, "port": port, "targetPort": port_name,
                            "protocol": "TCP"} for port_name, port in ports]},
    }


def build_deployment(job: RLJob, config: OperatorConfig, component: str, replicas: int,
                     containers: list[dict], *, placement=None, volumes=()) -> dict[str, Any]:
    pod = pod_spec(job, containers, placement=placement, volumes=volumes,
                   gpu_tolerations=config.gpu_tolerations)
    return {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": object_meta(job, component),
        "spec": {"replicas": replicas, "selector": {"matchLabels": selector_labels(job, component)},
                 "template": pod_template(job, component, pod)},
    }


def pod_template(job: RLJob, component: str, pod: dict) -> dict[str, Any]:
    return {"metadata": {"labels": labels(job, component),
                         "annotations": {CONFIG_HASH: config_hash(job)}},
            "spec": pod}


def pod_spec(job: RLJob, containers: list[dict], *, placement=None, volumes=(),
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


def service_container(job: RLJob, config: OperatorConfig, component: str, args: list[str], *,
                      ports: list[tuple[str, int]], resources: dict, probe: dict, gpus: int = 0,
                      env: list[dict] = (), command: list[str] | None = None,
                      mounts: list[dict] = (), readiness: dict | None = None,
                      startup_seconds: float = STARTUP_SECONDS) -> dict[str, Any]:
    """An asyncrl service's container, with the job file mounted. `probe` checks start-up and
    liveness, and readiness too unless `readiness` is given."""
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
        # A container that fails leaves its last log lines in its status: what the operator
        # quotes when spec.backoffLimit fails the job.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": container_security(read_only_root=True),
        "volumeMounts": [{"name": "config", "mountPath": "/etc/asyncrl", "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}, *mounts],
    }
    return container


def grpc_probes(port: int) -> dict[str, dict]:
    """The kubelet's native gRPC probes of grpc.health.v1 (asyncrl.platform.grpc_health):
    start-up and liveness ask whether the process answers, readiness whether it can work (the
    buffer's Redis, a code job's sandbox), so an outage makes the pod unready, not restarted."""
    return {"probe": {"grpc": {"port": port, "service": LIVENESS}},
            "readiness": {"grpc": {"port": port}}}


def container_security(*, read_only_root: bool) -> dict[str, Any]:
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": read_only_root,
            "capabilities": {"drop": ["ALL"]}}


def resource_requirements(spec_resources, component: str, *, gpus: int,
                          custom: bool = True) -> dict:
    """The spec's requests and limits (DEFAULT_REQUESTS when it gives none, or when `custom`
    is False), plus the GPUs."""
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


def pod_name_env() -> dict[str, Any]:
    return {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}


def add_shared_memory(pod: dict, container: dict) -> None:
    """NCCL and SGLang need a /dev/shm larger than the runtime's 64 MiB default."""
    pod.setdefault("volumes", []).append({"name": "dshm", "emptyDir": {"medium": "Memory"}})
    container["volumeMounts"].append({"name": "dshm", "mountPath": "/dev/shm"})
