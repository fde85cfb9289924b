"""`RewardScorer`: scores batches of tasks concurrently. The gRPC servicer calls it, and so
can a rollout workflow that scores in-process.

Math answers are verified in a pool of math-verify worker processes, programs run in the
sandbox's pool of slots; both are sized to the CPUs and started on first use (or up front
with `start()`). Row tasks go to the job's own reward: its Python function (a pool of worker
processes like math's) or its HTTP endpoint. Whatever a response does, its task gets a
`ScoreResult`; only a scorer that cannot work at all is an error of the whole call (a sandbox
that refuses to run code, `SandboxUnavailable`; a reward function that cannot be loaded,
`WorkerStartError`), and an unreachable HTTP endpoint holds the call instead.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Sequence

from asyncrl.scoring.code_reward import CodeScorer
from asyncrl.scoring.http_reward import HttpScorer
from asyncrl.scoring.math_reward import MathScorer, MathVerifierPool
from asyncrl.scoring.metrics import RewardMetrics
from asyncrl.scoring.python_reward import PythonScorer
from asyncrl.scoring.sandbox import Sandbox, SandboxLimits, SandboxUnavailable
from asyncrl.scoring.types import Failure, MathReference, RowReference, ScoreResult, ScoreTask
from asyncrl.scoring.worker_pool import WorkerStartError

log = logging.getLogger(__name__)


class UnsupportedTask(ValueError):
    """A task this service cannot score (a row task for a job without a python or http
    reward)."""


class RewardScorer:
    def __init__(self, math: MathScorer, code: CodeScorer, *, pool: MathVerifierPool,
                 sandbox: Sandbox, metrics: RewardMetrics | None = None,
                 custom: PythonScorer | HttpScorer | None = None, kind: str = "math"):
        self.math = math
        self.code = code
        self.pool = pool
        self.sandbox = sandbox
        self.metrics = metrics
        # The job's python or http reward, which scores row tasks; None for math and code jobs.
        self.custom = custom
        self.kind = kind

    @classmethod
    def from_spec(cls, reward, *, workers: int | None = None,
                  metrics: RewardMetrics | None = None, http_options: dict | None = None,
                  **sandbox_options) -> RewardScorer:
        """From the RLJob's `spec.reward` (asyncrl.spec.RewardSpec). `workers` sizes the math
        verifier pool, the sandbox and a python reward's pool (default: the CPU count);
        `http_options` go to `HttpScorer` (its delays), `sandbox_options` to `Sandbox`
        (uid_base, python, root). Nothing starts here."""
        workers = workers or os.cpu_count() or 1
        custom = None
        if reward.kind == "python":
            custom = PythonScorer.from_spec(reward.python, workers)
        elif reward.kind == "http":
            custom = HttpScorer.from_spec(reward.http, **(http_options or {}))
        pool = MathVerifierPool(workers)
        sandbox = Sandbox(
            SandboxLimits.from_spec(reward.code), workers=workers,
            allow_unsafe=reward.code.allow_unsafe_no_network_namespace,
            on_run=metrics.observe_run if metrics else None, **sandbox_options,
        )
        return cls(
            MathScorer(pool, reward.math.extract, reward.math.timeout_seconds),
            CodeScorer(sandbox, reward.code.extract),
            pool=pool, sandbox=sandbox, metrics=metrics, custom=custom, kind=reward.kind,
        )

    async def start(self, kinds: Sequence[str] = ("math", "code")) -> None:
        """Starts what scores `kinds` now rather than on first use: the math workers, the
        sandbox (probed), the job's python workers (WorkerStartError if its function cannot
        be loaded) or its HTTP client."""
        if "math" in kinds:
            await self.pool.start()
        if "code" in kinds:
            await self.sandbox.start()
            if self.metrics:
                self.metrics.sandbox_available.set(0 if self.sandbox.unavailable else 1)
        if self.custom is not None and self.kind in kinds:
            await self.custom.start()

    async def score(self, tasks: Sequence[ScoreTask]) -> list[ScoreResult]:
        """One result per task, in order; tasks are scored concurrently."""
        for task in tasks:
            if isinstance(task.reference, RowReference) and self.custom is None:
                raise UnsupportedTask(
                    f"task {task.task_id!r} carries a dataset row, which only a python or "
                    f"http reward scores; this service scores reward kind {self.kind}")
        return list(await asyncio.gather(*(self.score_one(task) for task in tasks)))

    async def score_one(self, task: ScoreTask) -> ScoreResult:
        try:
            if isinstance(task.reference, MathReference):
                result = await self.math.score(task.task_id, task.response, task.reference)
            elif isinstance(task.reference, RowReference):
                result = await self.custom.score(task.task_id, task.response, task.reference)
            else:
                result = await self.code.score(task.task_id, task.response, task.reference)
        except (SandboxUnavailable, WorkerStartError):
            raise
        except Exception as exc:  # noqa: BLE001 - one task's bug never fails the batch
            log.exception("scoring task %s failed", task.task_id)
            result = ScoreResult.failed(task.task_id, Failure.VERIFIER_ERROR,
                                        f"{type(exc).__name__}: {exc}")
        if self.metrics:
            self.metrics.observe_result(self.kind_of(task), result)
        return result

    def kind_of(self, task: ScoreTask) -> str:
        """The reward kind that scores `task`: math, code, or the job's python or http."""
        return self.kind if isinstance(task.reference, RowReference) else task.kind

    def health(self) -> tuple[bool, str]:
        """Whether the job's own kind of reward can score now, and why not."""
        if self.kind == "code":
            return self.sandbox.health()
        if self.custom is not None:
            return self.custom.health()
        return True, ""

    async def ready(self) -> bool:
        """`health()` for the gRPC health check; an unreachable HTTP endpoint is asked again."""
        if isinstance(self.custom, HttpScorer):
            return await self.custom.ready()
        return self.health()[0]

    async def close(self) -> None:
        await self.pool.close()
        await self.sandbox.close()
        if self.custom is not None:
            await self.custom.close()
