"""Math rewards: extract the final answer, then verify it against the reference with
math-verify in a pool of worker processes, each call under a hard time limit."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from typing import Iterable

from asyncrl.reward.extract import extract_answer
from asyncrl.reward.types import Failure, MathReference, ScoreResult

log = logging.getLogger(__name__)

# Answers longer than this are not parsed (a wall of LaTeX is not a final answer).
MAX_ANSWER_CHARS = 1000
# Loading sympy in a fresh worker takes a second or two, longer on a busy machine.
WORKER_START_SECONDS = 120.0
# How long past its own time limit a worker may take before it is killed.
KILL_GRACE_SECONDS = 1.0


class _Worker:
    """One `asyncrl.reward.math_worker` process, answering one request at a time."""

    def __init__(self, process: asyncio.subprocess.Process):
        self.process = process

    @classmethod
    async def start(cls, python: str) -> _Worker:
        process = await asyncio.create_subprocess_exec(
            python, "-I", "-m", "asyncrl.reward.math_worker",
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            limit=1 << 20,
        )
        worker = cls(process)
        try:
            ready = await asyncio.wait_for(worker._read(), WORKER_START_SECONDS)
            if not ready.get("ready"):
                raise RuntimeError(f"unexpected first line {ready!r}")
        except BaseException:
            worker.kill()
            raise
        return worker

    async def ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        await self.process.stdin.drain()
        return await self._read()

    async def _read(self) -> dict:
        line = await self.process.stdout.readline()
        if not line:
            raise EOFError(f"math worker exited with code {await self.process.wait()}")
        return json.loads(line)

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()


class MathVerifierPool:
    """`workers` verifier processes; a request waits for an idle one. A worker that overruns
    its time limit or dies is killed and replaced in the background."""

    def __init__(self, workers: int, python: str = sys.executable, *,
                 kill_grace: float = KILL_GRACE_SECONDS):
        if workers < 1:
            raise ValueError(f"a math verifier pool needs at least one worker, got {workers}")
        self.size = workers
        self._python = python
        self._kill_grace = kill_grace
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: set[_Worker] = set()
        self._starting: set[asyncio.Task] = set()
        self._started = False
        self.replaced = 0

    async def start(self) -> None:
        """Starts every worker and waits until each has loaded math-verify."""
        if self._started:
            return
        self._started = True
        try:
            workers = await asyncio.gather(
                *(_Worker.start(self._python) for _ in range(self.size)))
        except BaseException:
            self._started = False
            raise
        for worker in workers:
            self._all.add(worker)
            self._idle.put_nowait(worker)

    async def verify(self, answer: str, reference: str, timeout: float) -> dict:
        """The worker's reply: {"equal": bool} or {"failure": reason, "detail": ...}."""
        await self.start()
        worker = await self._idle.get()
        request = {"answer": answer, "reference": reference, "timeout": timeout}
        try:
            reply = await asyncio.wait_for(worker.ask(request), timeout + self._kill_grace)
        except asyncio.TimeoutError:
            self._replace(worker)
            return {"failure": "timeout",
                    "detail": f"verification took longer than {timeout:g}s; worker killed"}
        except (EOFError, OSError, ValueError) as exc:
            self._replace(worker)
            return {"failure": "verifier_error", "detail": f"math worker failed: {exc}"}
        except BaseException:  # cancelled mid-request: the worker's state is unknown
            self._replace(worker)
            raise
        self._idle.put_nowait(worker)
        return reply

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._all.discard(worker)
        self.replaced += 1
        task = asyncio.get_running_loop().create_task(self._start_replacement())
        self._starting.add(task)
        task.add_done_callback(self._starting.discard)

    async def _start_replacement(self) -> None:
        delay = 0.5
        while True:
            try:
                worker = await _Worker.start(self._python)
            except Exception:  # noqa: BLE001 - keep trying; requests wait for a worker
                log.exception("could not start a math worker; retrying in %.1fs", delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
                continue
            self._all.add(worker)
            self._idle.put_nowait(worker)
            return

    async def close(self) -> None:
        for task in list(self._starting):
            task.cancel()
        for worker in list(self._all):
            worker.kill()
        for worker in list(self._all):
            await worker.process.wait()
        self._all.clear()


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
