"""The trainer pods' environment for experiment tracking (the job's tracking): the W&B API key
from the job's Secret, MLflow's tracking URI, and the job's uid, which names its run in each
tracker (a job deleted and made again is a new run). TensorBoard needs nothing here: its
folder is under the run directory, on the run volume every trainer pod mounts."""

from __future__ import annotations

from typing import Any

from asyncrl.spec import RLJob


def tracking_env(job: RLJob) -> list[dict[str, Any]]:
    tracking = job.spec.tracking
    if not tracking.trackers:
        return []
    env = []
    if job.metadata.uid:
        env.append({"name": "ASYNCRL_JOB_UID", "value": job.metadata.uid})
    if tracking.wandb is not None and tracking.wandb.api_key_secret is not None:
        secret = tracking.wandb.api_key_secret
        env.append({"name": "WANDB_API_KEY", "valueFrom": {"secretKeyRef": {
            "name": secret.name, "key": secret.key}}})
    if tracking.mlflow is not None:
        env.append({"name": "MLFLOW_TRACKING_URI", "value": tracking.mlflow.tracking_uri})
    return env
