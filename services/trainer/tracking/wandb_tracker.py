"""Weights & Biases: one run per job, its id the job's run key, opened with resume="allow",
so a restarted trainer continues it (W&B keeps the first value of a step it already has: the
steps after the restored checkpoint, logged again, keep their first values). Offline mode
writes under the run directory's wandb/ folder, for `wandb sync`."""

from __future__ import annotations

from pathlib import Path

from asyncrl.spec.job import WandbTracking


class WandbTracker:
    name = "wandb"

    def __init__(self, spec: WandbTracking, job_name: str, key: str, run_dir: Path):
        self.spec, self.job_name, self.key, self.run_dir = spec, job_name, key, run_dir
        self.run = None

    def open(self, config: dict, resumed_step: int) -> None:
        import wandb

        spec = self.spec
        self.run = wandb.init(
            project=spec.project, entity=spec.entity, name=spec.name or self.job_name,
            tags=spec.tags or None, group=spec.group, mode=spec.mode, id=self.key,
            resume="allow", dir=str(self.run_dir), config=config,
            # The trainer's output stays its own: W&B would capture the process's console.
            settings=wandb.Settings(console="off", quiet=True))

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()
