"""`RewardScorer`: scores batches of math and code tasks concurrently. The gRPC servicer
calls it, and so can a rollout workflow that scores in-process.

Math answers are verified in a pool of math-verify worker processes, programs run in the
sandbox's pool of slots; both are sized to the CPUs and started on first use (or up front
with `start()`). Whatever a response does, its task gets a `ScoreResult`; only a sandbox that
refuses to run code at all (`SandboxUnavailable`) is an error of the whole call.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Sequence

from asyncrl.reward.code_reward import CodeScorer
from asyncrl.reward.math_reward import MathScorer, MathVerifierPool
from asyncrl.reward.metrics import RewardMetrics
from asyncrl.reward.sandbox import Sandbox, SandboxLimits, SandboxUnavailable
from asyncrl.reward.types import (
    CodeReference,
    Failure,
    MathReference,
    ScoreResult,
    ScoreTask,
)

log = logging.getLogger(__name__)


class RewardScorer:
    def __init__(self, math: MathScorer, code: CodeScorer, *, pool: MathVerifierPool,
                 sandbox: Sandbox, metrics: RewardMetrics | None = None):
        self.math = math
        self.code = code
        self.pool = pool
        self.sandbox = sandbox
        self.metrics = metrics

    @classmethod
    def from_spec(cls, reward, *, workers: int | None = None,
                  metrics: RewardMetrics | None = None, **sandbox_options) -> RewardScorer:
        """From the RLJob's `spec.reward` (asyncrl.spec.RewardSpec). `workers` sizes both the
        math verifier pool and the sandbox (default: the CPU count); `sandbox_options` go to
        `Sandbox` (uid_base, python, root)."""
        workers = workers or os.cpu_count() or 1
        pool = MathVerifierPool(workers)
        sandbox = Sandbox(
            SandboxLimits.from_spec(reward.code), workers=workers,
            allow_unsafe=reward.code.allow_unsafe_no_network_namespace,
            on_run=metrics.observe_run if metrics else None, **sandbox_options,
        )
        return cls(
            MathScorer(pool, reward.math.extract, reward.math.timeout_seconds),
            CodeScorer(sandbox, reward.code.extract),
            pool=pool, sandbox=sandbox, metrics=metrics,
        )

    async def start(self, kinds: Sequence[str] = ("math", "code")) -> None:
        """Starts the math workers and probes the sandbox now rather than on first use."""
        if "math" in kinds:
            await self.pool.start()
        if "code" in kinds:
            await self.sandbox.start()
            if self.metrics:
                self.metrics.sandbox_available.set(0 if self.sandbox.unavailable else 1)

    async def score(self, tasks: Sequence[ScoreTask]) -> list[ScoreResult]:
        """One result per task, in order; tasks are scored concurrently."""
        return list(await asyncio.gather(*(self.score_one(task) for task in tasks)))

    async def score_one(self, task: ScoreTask) -> ScoreResult:
        try:
            if isinstance(task.reference, MathReference):
                result = await self.math.score(task.task_id, task.response, task.reference)
            else:
                result = await self.code.score(task.task_id, task.response, task.reference)
        except SandboxUnavailable:
            raise
        except Exception as exc:  # noqa: BLE001 - one task's bug never fails the batch
            log.exception("scoring task %s failed", task.task_id)
            result = ScoreResult.failed(task.task_id, Failure.VERIFIER_ERROR,
                                        f"{type(exc).__name__}: {exc}")
        if self.metrics:
            self.metrics.observe_result(task.kind, result)
        return result

    def health(self) -> tuple[bool, str]:
        return self.sandbox.health()

    async def close(self) -> None:
        await self.pool.close()
        await self.sandbox.close()
