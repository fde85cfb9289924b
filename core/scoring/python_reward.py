"""Python rewards (reward.kind: python): the job's own function scores each response, in a
pool of `asyncrl.scoring.python_worker` processes, never in the service's process.

A function that raises scores 0 (EXCEPTION), one that returns no usable number scores 0
(INVALID_SCORE), one that runs past reward.python.timeoutSeconds is killed (TIMEOUT), one
that takes its worker down (os._exit, a segfault) scores 0 (KILLED); the worker is replaced
and the service goes on.
"""

from __future__ import annotations

import os
import sys
import time

from asyncrl.scoring.types import Failure, RowReference, ScoreResult
from asyncrl.scoring.worker_pool import WorkerDied, WorkerPool, WorkerTimedOut


def python_worker_command(function: str, path: str | None, python: str = sys.executable
                          ) -> list[str]:
    """Not isolated (-I): the function imports like any program of the user's, with
    PYTHONPATH and the working directory; `path` (made absolute here) goes first."""
    command = [python, "-m", "asyncrl.scoring.python_worker", function]
    return command + [os.path.abspath(path)] if path else command


class PythonScorer:
    def __init__(self, pool: WorkerPool, timeout_seconds: float):
        self.pool = pool
        self._timeout = timeout_seconds

    @classmethod
    def from_spec(cls, python, workers: int) -> PythonScorer:
        """From spec.reward.python (asyncrl.spec.PythonReward)."""
        command = python_worker_command(python.function, python.path)
        return cls(WorkerPool(command, workers, name="python reward worker"),
                   python.timeout_seconds)

    async def start(self) -> None:
        """Starts the workers; WorkerStartError says why the function cannot be loaded."""
        await self.pool.start()

    async def score(self, task_id: str, response: str, reference: RowReference) -> ScoreResult:
        start = time.perf_counter()
        request = {"response": response, "row_json": reference.row_json}
        try:
            reply = await self.pool.ask(request, self._timeout)
        except WorkerTimedOut:
            return ScoreResult.failed(
                task_id, Failure.TIMEOUT, f"the reward function took longer than "
                f"{self._timeout:g}s (reward.python.timeoutSeconds); worker killed",
                wall_seconds=time.perf_counter() - start)
        except WorkerDied as exc:
            return ScoreResult.failed(task_id, Failure.KILLED, str(exc),
                                      wall_seconds=time.perf_counter() - start)
        seconds = time.perf_counter() - start
        if "failure" in reply:
            return ScoreResult.failed(task_id, Failure[reply["failure"].upper()],
                                      reply.get("detail", ""), wall_seconds=seconds)
        return ScoreResult(task_id, reply["score"], 1, 1, seconds, extras=reply["extras"])

    def health(self) -> tuple[bool, str]:
        return True, ""

    async def close(self) -> None:
        await self.pool.close()
