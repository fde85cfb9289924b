"""Experiment tracking (the job's `tracking` section): rank 0 sends every record it writes to
metrics.jsonl, the resolved job as the run's config, and the rollout side's throughput as the
buffer sees it to Weights & Biases, MLflow and TensorBoard. Each tracker is one module behind
`Tracker` and runs on its own thread (asyncrl.trainer.tracking.worker): one that is slow or
down never holds up training; its failures are logged, retried and counted in
asyncrl_trainer_tracking_failures_total. A resumed job continues the same run (run_key)."""

from __future__ import annotations

import hashlib
import importlib.util
import logging
from pathlib import Path
from typing import Protocol

from asyncrl.spec import RLJob, TrackingSpec
from asyncrl.trainer.tracking.rollout import RolloutRate
from asyncrl.trainer.tracking.worker import TrackerThread

log = logging.getLogger(__name__)

#: The module each tracker imports; the extra that installs it has the tracker's name.
MODULES = {"wandb": "wandb", "mlflow": "mlflow", "tensorboard": "tensorboard"}
#: Record fields that are not measurements (the step is the x axis).
_NOT_LOGGED = {"kind", "step", "time"}


class Tracker(Protocol):
    name: str

    def open(self, config: dict, resumed_step: int) -> None:
        """Starts the job's run, or continues it when it exists; `config` is the resolved job.
        `resumed_step`: the step the trainer restarts from (0 on a fresh start)."""

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def missing_trackers(tracking: TrackingSpec) -> list[str]:
    """A line for each tracker asked for whose package is not installed, with its install
    command."""
    return [f"tracking.{name}: the {name} package is not installed; install it with "
            f"pip install 'asyncrl[{name}]'"
            for name in tracking.trackers if importlib.util.find_spec(MODULES[name]) is None]


def run_key(job: RLJob, run_dir: Path, uid: str | None = None) -> str:
    """What names the job's run in every tracker: its name and a digest of its namespace,
    its uid in a cluster (a job deleted and made again is a new run) or else its run
    directory, so a restart or `asyncrl run` of the same folder continues the same run."""
    where = uid or str(run_dir.resolve())
    digest = hashlib.sha256(f"{job.metadata.namespace}/{job.metadata.name}:{where}".encode())
    return f"{job.metadata.name}-{digest.hexdigest()[:12]}"


def values_of(record: dict) -> dict[str, float]:
    """The record's measurements under their metrics.jsonl keys: numbers (flags as 0/1); of
    the per-group staleness list its maximum (its mean is a field already)."""
    values = {key: float(value) for key, value in record.items()
              if key not in _NOT_LOGGED and isinstance(value, (int, float))}
    if record.get("staleness"):
        values["staleness_max"] = float(max(record["staleness"]))
    return values


def build_trackers(job: RLJob, run_dir: Path, key: str) -> list[Tracker]:
    """The trackers the job asks for (their packages are imported when they open)."""
    tracking, name = job.spec.tracking, job.metadata.name
    trackers: list[Tracker] = []
    if "wandb" in tracking.trackers:
        from asyncrl.trainer.tracking.wandb_tracker import WandbTracker

        trackers.append(WandbTracker(tracking.wandb, name, key, run_dir))
    if tracking.mlflow is not None:
        from asyncrl.trainer.tracking.mlflow_tracker import MlflowTracker

        trackers.append(MlflowTracker(tracking.mlflow, name, key))
    if tracking.tensorboard is not None:
        from asyncrl.trainer.tracking.tensorboard_tracker import TensorboardTracker

        trackers.append(TensorboardTracker(run_dir / tracking.tensorboard.dir))
    return trackers


class Tracking:
    """Rank 0's trackers, each on its thread. With none asked for, every call does nothing."""

    def __init__(self, job: RLJob, run_dir: Path, on_error, uid: str | None = None):
        """`on_error(tracker)`: called on each failed call (the Prometheus counter)."""
        missing = missing_trackers(job.spec.tracking)
        if missing:
            raise RuntimeError("; ".join(missing))
        self.job = job
        self.threads = [TrackerThread(tracker, on_error)
                        for tracker in build_trackers(job, run_dir, run_key(job, run_dir, uid))]
        self.rollout = RolloutRate(job.spec.algorithm.group_size)

    @property
    def active(self) -> bool:
        return bool(self.threads)

    def start(self, resumed_step: int) -> None:
        config = self.job.resolved()
        for thread in self.threads:
            thread.start(config, resumed_step)

    def log(self, record: dict) -> None:
        """A record as written to metrics.jsonl, at its step."""
        self._log(record["step"], values_of(record))

    def log_rollout(self, step: int, buffer_stats, now: float) -> None:
        """The rollout side's throughput since the last step (asyncrl.trainer.tracking.rollout)."""
        self._log(step, self.rollout.observe(buffer_stats, now))

    def _log(self, step: int, values: dict[str, float]) -> None:
        for thread in self.threads:
            thread.log(step, values)

    def close(self, timeout: float = 30.0) -> None:
        """Sends what is queued and closes each run, waiting at most `timeout` seconds in all."""
        for thread in self.threads:
            thread.stop()
        for thread in self.threads:
            thread.join(timeout / max(len(self.threads), 1))
