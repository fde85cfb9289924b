"""A Hub model in a cluster (model.source <org>/<name>): the trainer pods' init container
downloads it into the run volume's Hugging Face cache (`python -m asyncrl.model.hub`, with the
token of model.hubTokenSecret and the operator's HF_ENDPOINT) and then writes a ready file; the
rollout pods' init container waits for that file. Both services then load the model from the
volume with the Hub switched off, so every pod runs the one snapshot downloaded once.

A download the Hub refuses (no such model or revision, gated) exits PERMANENT_EXIT and fails
the job at once; one that cannot reach the Hub is retried by the kubelet like a crashing
container. Its last log line, the reason, is the container's termination message, which the
job's status repeats (asyncrl.operator.status.model_failure)."""

from __future__ import annotations

import hashlib
from typing import Any

from asyncrl.operator.builders.common import RUN_DIR, OperatorConfig
from asyncrl.operator.builders.pods import container_security, image_for
from asyncrl.operator.builders.volumes import run_mount
from asyncrl.spec import RLJob

#: The Hugging Face cache on the run volume (HF_HUB_CACHE of every pod that reads the model).
HUB_CACHE = f"{RUN_DIR}/hub"
FETCH_CONTAINER = "fetch-model"
WAIT_CONTAINER = "wait-for-model"

#: Run by `wait_for_model_container` as `python -c WAIT_FOR_MODEL <ready file>`.
WAIT_FOR_MODEL = """\
import os, sys, time
while not os.path.exists(sys.argv[1]):
    print(f"waiting for the trainer pods to download the model ({sys.argv[1]})", flush=True)
    time.sleep(5)
"""


def ready_file(job: RLJob) -> str:
    """Written once the model at model.revision is complete in the volume's cache; named by
    source and revision, so a job given another model waits for that one."""
    model = job.spec.model
    key = hashlib.sha256(f"{model.hub_id}@{model.revision}".encode()).hexdigest()[:16]
    return f"{HUB_CACHE}/ready/{key}"


def hub_env(job: RLJob) -> list[dict[str, Any]]:
    """Environment of a service loading a Hub model: the volume's cache, the Hub off."""
    if job.spec.model.hub_id is None:
        return []
    return [{"name": "HF_HUB_CACHE", "value": HUB_CACHE}, {"name": "HF_HUB_OFFLINE", "value": "1"}]


def fetch_model_container(job: RLJob, config: OperatorConfig, gpus: int) -> dict | None:
    """The trainer pods' download of the job's Hub model (None for any other source)."""
    model = job.spec.model
    if model.hub_id is None:
        return None
    env = [{"name": "HOME", "value": "/tmp"}, {"name": "HF_HOME", "value": "/tmp/hf"},
           {"name": "HF_HUB_CACHE", "value": HUB_CACHE},
           {"name": "PYTHONUNBUFFERED", "value": "1"}]
    if config.hub_endpoint:
        env.append({"name": "HF_ENDPOINT", "value": config.hub_endpoint})
    if model.hub_token_secret is not None:
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": model.hub_token_secret.name, "key": model.hub_token_secret.key}}})
    return {
        "name": FETCH_CONTAINER, "image": image_for(config, gpus),
        "imagePullPolicy": config.image_pull_policy,
        "command": ["python", "-m", "asyncrl.model.hub", model.hub_id, model.revision,
                    ready_file(job)],
        "env": env,
        # The error is the last line printed: it becomes the termination message.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "resources": {"requests": {"cpu": "100m", "memory": "512Mi"}},
        "securityContext": container_security(read_only_root=True),
        "volumeMounts": [run_mount(), {"name": "tmp", "mountPath": "/tmp"}],
    }


def wait_for_model_container(job: RLJob, config: OperatorConfig, gpus: int) -> dict | None:
    """The rollout pods' wait for the trainer pods' download (None for any other source)."""
    if job.spec.model.hub_id is None:
        return None
    return {
        "name": WAIT_CONTAINER, "image": image_for(config, gpus),
        "imagePullPolicy": config.image_pull_policy,
        "command": ["python", "-c", WAIT_FOR_MODEL, ready_file(job)],
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}},
        "securityContext": container_security(read_only_root=True),
        "volumeMounts": [run_mount(read_only=True)],
    }
