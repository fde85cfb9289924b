"""Math rewards: extract the final answer, then verify it against the reference with
math-verify in a pool of worker processes, each call under a hard time limit."""

from __future__ import annotations

import sys
import time
from typing import Iterable

from asyncrl.scoring.extract import extract_answer
from asyncrl.scoring.types import Failure, MathReference, ScoreResult
from asyncrl.scoring.worker_pool import WorkerDied, WorkerPool, WorkerTimedOut

# Answers longer than this are not parsed (a wall of LaTeX is not a final answer).
MAX_ANSWER_CHARS = 1000
# How long past its own time limit a worker may take before it is killed.
KILL_GRACE_SECONDS = 1.0


class MathVerifierPool(WorkerPool):
    """`workers` math-verify processes (`asyncrl.scoring.math_worker`). A worker that overruns
    its time limit or dies is killed and replaced in the background."""

    def __init__(self, workers: int, python: str = sys.executable, *,
                 kill_grace: float = KILL_GRACE_SECONDS):
        super().__init__([python, "-I", "-m", "asyncrl.scoring.math_worker"], workers,
                         name="math worker")
        self._kill_grace = kill_grace

    async def verify(self, answer: str, reference: str, timeout: float) -> dict:
        """The worker's reply: {"equal": bool} or {"failure": reason, "detail": ...}."""
        request = {"answer": answer, "reference": reference, "timeout": timeout}
        try:
            return await self.ask(request, timeout + self._kill_grace)
        except WorkerTimedOut:
            return {"failure": "timeout",
                    "detail": f"verification took longer than {timeout:g}s; worker killed"}
        except WorkerDied as exc:
            return {"failure": "verifier_error", "detail": str(exc)}


class MathScorer:
    """Scores one math response: 1 if its final answer (found by `rules`, in order) is
    equivalent to the reference answer."""

    def __init__(self, pool: MathVerifierPool, rules: Iterable[str] = ("boxed",),
                 timeout_seconds: float = 5.0):
        self._pool = pool
        self._rules = tuple(rules)
        self._timeout = timeout_seconds

    async def score(self, task_id: str, response: str, reference: MathReference) -> ScoreResult:
        start = time.perf_counter()

        def result(failure: Failure, detail: str = "") -> ScoreResult:
            seconds = time.perf_counter() - start
            if failure is Failure.NONE:
                return ScoreResult(task_id, 1.0, 1, 1, seconds, Failure.NONE, detail)
            return ScoreResult.failed(task_id, failure, detail, wall_seconds=seconds)

        answer = extract_answer(response, self._rules)
        if answer is None:
            return result(Failure.NO_ANSWER, f"no final answer found by {', '.join(self._rules)}")
        if len(answer) > MAX_ANSWER_CHARS:
            return result(Failure.WRONG_ANSWER, f"the answer has {len(answer)} characters")
        if _plain(answer) == _plain(reference.answer):
            return result(Failure.NONE)
        reply = await self._pool.verify(answer, reference.answer, self._timeout)
        if "failure" in reply:
            return result(Failure[reply["failure"].upper()], reply.get("detail", ""))
        if reply["equal"]:
            return result(Failure.NONE)
        return result(Failure.WRONG_ANSWER, f"{answer!r} is not {reference.answer!r}"[:300])


def _plain(text: str) -> str:
    return "".join(text.split()).strip("$")
