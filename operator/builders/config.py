"""The job's ConfigMap (the resolved job, every default filled in, as the services read it)
and the hash of it that pod templates carry, so that a change of what the pods run rolls
them."""

from __future__ import annotations

import hashlib
from typing import Any

import yaml

from asyncrl.operator.builders.common import object_meta
from asyncrl.spec import RLJob
from asyncrl.weights.paths import with_transfer_path

CONFIG_HASH = "asyncrl.io/config-hash"

#: Why a cluster never shares a GPU between trainer and rollout (trainer.weightTransfer auto
#: is disk here; the API server refuses ipc).
DIFFERENT_PODS = "in a cluster trainer and rollout are different pods"


def job_as_run(job: RLJob) -> dict[str, Any]:
    """The job as the pods read it: resolved, with the weight transfer path they take."""
    return with_transfer_path(job, apart=DIFFERENT_PODS)[0].resolved()


#: Fields only the operator reads: changing them must not restart the pods.
OPERATOR_ONLY = ("suspend", "backoffLimit", "activeDeadlineSeconds", "ttlSecondsAfterFinished")


def config_hash(job: RLJob) -> str:
    """Changes when what the pods run changes, but not for what only the operator reads
    (replicas, rollout.autoscale, suspend, the lifetime rules): scaling, retuning the
    autoscaler and suspending must not restart the pods that keep running."""
    manifest = job_as_run(job)
    spec = manifest["spec"]
    for field in OPERATOR_ONLY:
        spec.pop(field, None)
    spec["rollout"].pop("autoscale", None)
    for section in ("rollout", "reward", "trainer", "buffer"):
        spec[section]["replicas"] = 1
    return hashlib.sha256(yaml.safe_dump(manifest, sort_keys=True).encode()).hexdigest()[:16]


def config_map(job: RLJob) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": object_meta(job, "config"),
        "data": {"job.yaml": yaml.safe_dump(job_as_run(job), sort_keys=False)},
    }
