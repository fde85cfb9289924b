"""The job's ConfigMap (the resolved job, every default filled in, as the services read it)
and the hash of it that pod templates carry, so that a change of what the pods run rolls
them."""

from __future__ import annotations

import hashlib
from typing import Any

import yaml

from asyncrl.operator.builders.common import object_meta
from asyncrl.spec import RLJob

CONFIG_HASH = "asyncrl.io/config-hash"


def config_hash(job: RLJob) -> str:
    """Changes when what the pods run changes, but not for replicas or suspend: scaling and
    suspending must not restart the pods that keep running."""
    manifest = job.resolved()
    spec = manifest["spec"]
    spec["suspend"] = False
    for section in ("rollout", "reward", "trainer", "buffer"):
        spec[section]["replicas"] = 1
    return hashlib.sha256(yaml.safe_dump(manifest, sort_keys=True).encode()).hexdigest()[:16]


def config_map(job: RLJob) -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": object_meta(job, "config"),
        "data": {"job.yaml": yaml.safe_dump(job.resolved(), sort_keys=False)},
    }
