"""Readiness follows grpc.health.v1 in real pods: the buffer pod, as the operator builds it
(the kubelet's native gRPC probes), turns NotReady while its Redis is away, without being
restarted, and Ready again once Redis is back."""

from __future__ import annotations

import uuid

import pytest
import yaml
from kubernetes import client

from asyncrl.operator import builders
from asyncrl.operator.builders import OperatorConfig
from asyncrl.spec import parse_manifest
from support import ROOT
from support.real_pods import base_image, images, wait_for

pytestmark = [pytest.mark.real_node, pytest.mark.timeout(1800)]

#: Deadlines that only catch hangs.
READY_SECONDS = 300


@pytest.fixture(scope="module")
def buffer_and_redis(real_node):
    """A tiny job's Redis (StatefulSet) and buffer (Deployment) in a fresh namespace."""
    service_image, service_tar = images()["service"]
    real_node.import_image(service_tar)
    real_node.import_image(base_image("redis"))
    namespace = f"ready-{uuid.uuid4().hex[:8]}"
    data = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    data["metadata"]["namespace"] = namespace
    job = parse_manifest(data)
    config = OperatorConfig(image=service_image, image_pull_policy="Never",
                            redis_image="asyncrl.local/redis:bookworm")
    manifests = [builders.config_map(job), builders.redis_secret(job, uuid.uuid4().hex),
                 builders.redis_statefulset(job, config), builders.redis_service(job),
                 builders.buffer_deployment(job, config), builders.buffer_service(job)]
    core = client.CoreV1Api(real_node.api_client())
    core.create_namespace({"metadata": {"name": namespace}})
    real_node.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(manifests, sort_keys=False))
    yield real_node, core, job
    core.delete_namespace(namespace)


def buffer_pod(core, job):
    """(ready, restarts) of the buffer's one pod, or None before it has started."""
    selector = ",".join(f"{k}={v}" for k, v in
                        builders.selector_labels(job, "buffer").items())
    pods = [p for p in core.list_namespaced_pod(job.metadata.namespace,
                                                label_selector=selector).items
            if p.metadata.deletion_timestamp is None]
    if len(pods) != 1 or not pods[0].status.container_statuses:
        return None
    (container,) = pods[0].status.container_statuses
    return container.ready, container.restart_count


def scale_redis(cluster, job, replicas: int) -> None:
    cluster.kubectl("-n", job.metadata.namespace, "scale", "statefulset",
                    builders.child_name(job, "redis"), f"--replicas={replicas}")


def test_a_buffer_whose_redis_is_stopped_turns_not_ready_and_back(buffer_and_redis):
    cluster, core, job = buffer_and_redis
    describe = lambda: cluster.kubectl("-n", job.metadata.namespace, "describe", "pods",  # noqa: E731
                                       check=False).stdout
    wait_for(lambda: buffer_pod(core, job) == (True, 0), READY_SECONDS, "a Ready buffer",
             describe)
    scale_redis(cluster, job, 0)
    # Unready (its readiness probe is answered NOT_SERVING), alive: liveness keeps answering.
    wait_for(lambda: buffer_pod(core, job) == (False, 0), READY_SECONDS,
             "the buffer to turn NotReady without Redis", describe)
    scale_redis(cluster, job, 1)
    wait_for(lambda: buffer_pod(core, job) == (True, 0), READY_SECONDS,
             "the buffer to be Ready again with Redis back", describe)
