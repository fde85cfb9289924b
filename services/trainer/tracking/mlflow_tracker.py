"""MLflow: one run per job in the experiment, tagged with the job's run key; a restarted
trainer finds it by the tag and continues it (steps after the restored checkpoint get a
second point at the same step). The resolved job is the run's parameters, flattened
(spec.algorithm.learningRate), set once when the run is made: MLflow refuses to change one."""

from __future__ import annotations

import json
import os
import time

from asyncrl.spec.job import MlflowTracking

#: The tag that finds the job's run again.
RUN_KEY_TAG = "asyncrl.run_key"
_PARAM_VALUE_MAX = 6000  # MLflow's limit on a parameter's value
_BATCH = 100  # MLflow's limit on parameters per log_batch


class MlflowTracker:
    name = "mlflow"

    def __init__(self, spec: MlflowTracking, job_name: str, key: str):
        self.spec, self.job_name, self.key = spec, job_name, key
        self.client = None
        self.run_id: str | None = None

    def open(self, config: dict, resumed_step: int) -> None:
        # Our thread retries on its own terms: MLflow's own default (7 retries, doubling
        # pauses) would hold each entry for minutes while a server is down.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        from mlflow import MlflowClient
        from mlflow.entities import Param

        client = MlflowClient(tracking_uri=self.spec.tracking_uri)
        experiment_id = _experiment_id(client, self.spec.experiment or self.job_name)
        found = client.search_runs([experiment_id], f"tags.`{RUN_KEY_TAG}` = '{self.key}'",
                                   max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
        else:
            run = client.create_run(experiment_id, run_name=self.job_name,
                                    tags={RUN_KEY_TAG: self.key, "asyncrl.job": self.job_name})
            self.run_id = run.info.run_id
            params = [Param(k, v) for k, v in flatten(config).items()]
            for start in range(0, len(params), _BATCH):
                client.log_batch(self.run_id, params=params[start:start + _BATCH])
        self.client = client

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(key, value, now, step)
                                                    for key, value in values.items()])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _experiment_id(client, name: str) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name)
    except Exception:  # another job made it meanwhile
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def flatten(config: dict, prefix: str = "") -> dict[str, str]:
    """Nested keys joined with dots; lists and empty sections as JSON; values cut to MLflow's
    limit."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{name}."))
        else:
            text = value if isinstance(value, str) else json.dumps(value)
            flat[name] = text[:_PARAM_VALUE_MAX]
    return flat
