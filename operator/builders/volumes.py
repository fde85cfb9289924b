"""The job's run volume (a PersistentVolumeClaim it owns) and the pod volumes and mounts of
it and of the user's own claims (spec.dataset.volume, spec.reward.python.volume,
spec.rollout.workflow.volume)."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from asyncrl.operator.builders.common import RUN_DIR, OperatorConfig, child_name, object_meta
from asyncrl.spec import RLJob

#: Pod volumes of the user's own claims, named apart from the job's (config, tmp, run, dshm,
#: data) so that a claim can never take one of their places.
DATASET_VOLUME = "dataset"
REWARD_VOLUME = "reward-python"
WORKFLOW_VOLUME = "workflow"


def run_volume_claim(job: RLJob, config: OperatorConfig) -> dict[str, Any]:
    """Checkpoints, metrics and weight snapshots. The trainer writes, every rollout worker
    reads the snapshot a new version announces, so the claim is ReadWriteMany. Kept across
    suspend (it is the job's state) and deleted with the job."""
    spec: dict[str, Any] = {"accessModes": ["ReadWriteMany"],
                            "resources": {"requests": {"storage": config.run_volume_size}}}
    if config.run_volume_storage_class:
        spec["storageClassName"] = config.run_volume_storage_class
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": object_meta(job, "run"), "spec": spec}


def run_volume(job: RLJob) -> dict[str, Any]:
    return {"name": "run", "persistentVolumeClaim": {"claimName": child_name(job, "run")}}


def run_mount(read_only: bool = False) -> dict[str, Any]:
    return {"name": "run", "mountPath": RUN_DIR, "readOnly": read_only}


def dataset_volumes(job: RLJob) -> tuple[list[dict], list[dict]]:
    """The pod volume and container mount of spec.dataset.volume (none without one): at the
    first folder of dataset.path, where the spec has both path and evalPath."""
    dataset = job.spec.dataset
    if dataset.volume is None:
        return [], []
    return read_only_claim(DATASET_VOLUME, dataset.volume, mount_folder(dataset.path))


def reward_volumes(job: RLJob) -> tuple[list[dict], list[dict]]:
    """The pod volume and container mount of spec.reward.python.volume (none without one): at
    the first folder of reward.python.path, the folder the reward's module is imported from."""
    python = job.spec.reward.python
    if python is None:
        return [], []
    return code_volumes(REWARD_VOLUME, python.volume, python.path)


def workflow_volumes(job: RLJob) -> tuple[list[dict], list[dict]]:
    """The pod volume and container mount of spec.rollout.workflow.volume (none without one,
    or when it is the dataset's claim at the same folder, which dataset_volumes mounts
    already): at the first folder of workflow.path, where the episode's module is imported
    from."""
    workflow, dataset = job.spec.rollout.workflow, job.spec.dataset
    if (workflow.volume is not None and workflow.volume == dataset.volume
            and mount_folder(workflow.path) == mount_folder(dataset.path)):
        return [], []
    return code_volumes(WORKFLOW_VOLUME, workflow.volume, workflow.path)


def code_volumes(name: str, claim: str | None, path: str | None) -> tuple[list[dict],
                                                                           list[dict]]:
    """A user's module on their own claim (none without one), mounted read-only at the first
    folder of the path it is imported from (the spec makes that path absolute)."""
    if claim is None or path is None:
        return [], []
    return read_only_claim(name, claim, mount_folder(path))


def mount_folder(path: str) -> str:
    """The first folder of an absolute path: /data/gsm8k/train.jsonl is mounted at /data."""
    return "/" + PurePosixPath(path).parts[1]


def read_only_claim(name: str, claim: str, mount_path: str) -> tuple[list[dict], list[dict]]:
    """A user's claim, read-only twice over: the volume (so a ReadOnlyMany claim attaches, and
    one claim can serve many jobs) and the mount (the job never writes the user's files)."""
    return ([{"name": name, "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}],
            [{"name": name, "mountPath": mount_path, "readOnly": True}])
