"""A pool of worker processes, each answering one JSON-lines request at a time under a hard
deadline (the other side is `asyncrl.scoring.worker_protocol`).

The math verifier and a user's Python reward both run here, out of the service's own process:
a worker that overruns its deadline is killed, one that dies (os._exit, a segfault, an
out-of-memory kill) is noticed by its closed stdout, and either is replaced in the background
while the request that met it gets `WorkerTimedOut` or `WorkerDied`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Sequence

log = logging.getLogger(__name__)

# Loading a worker's libraries (sympy, a user's module) can take seconds on a busy machine.
WORKER_START_SECONDS = 120.0
# A reply line may carry a long detail or many extras; asyncio's default limit is 64 KiB.
LINE_LIMIT_BYTES = 1 << 20


class WorkerStartError(RuntimeError):
    """A worker said it cannot work (its first line was an error) or never said it can."""


class WorkerTimedOut(Exception):
    """The worker did not answer before the deadline; it was killed and is being replaced."""


class WorkerDied(Exception):
    """The worker exited or answered garbage; it is being replaced."""


class _Worker:
    def __init__(self, process: asyncio.subprocess.Process):
        self.process = process

    @classmethod
    async def start(cls, command: Sequence[str], start_timeout: float, name: str) -> _Worker:
        process = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            limit=LINE_LIMIT_BYTES)
        worker = cls(process)
        try:
            first = await asyncio.wait_for(worker._read(), start_timeout)
        except asyncio.TimeoutError:
            await worker.stop()
            raise WorkerStartError(f"{name}: not ready after {start_timeout:g}s") from None
        except (EOFError, ValueError) as exc:
            await worker.stop()
            raise WorkerStartError(f"{name}: {exc}") from exc
        except BaseException:
            worker.kill()
            raise
        if not first.get("ready"):
            await worker.stop()
            raise WorkerStartError(first.get("error") or f"{name}: unexpected first line "
                                                         f"{first!r}")
        return worker

    async def ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request).encode() + b"\n")
        await self.process.stdin.drain()
        return await self._read()

    async def _read(self) -> dict:
        line = await self.process.stdout.readline()
        if not line:
            raise EOFError(f"the worker exited with code {await self.process.wait()}")
        return json.loads(line)

    def kill(self) -> None:
        if self.process.returncode is None:
            self.process.kill()

    async def stop(self) -> None:
        self.kill()
        await self.process.wait()


class WorkerPool:
    """`workers` processes running `command`; a request waits for an idle one. Workers start
    all at once on `start()` (or the first request); a start that fails raises for every
    caller waiting on it, and the next call tries again."""

    def __init__(self, command: Sequence[str], workers: int, *, name: str,
                 start_timeout: float = WORKER_START_SECONDS):
        if workers < 1:
            raise ValueError(f"a {name} pool needs at least one worker, got {workers}")
        self.size = workers
        self.name = name
        self._command = list(command)
        self._start_timeout = start_timeout
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: set[_Worker] = set()
        self._replacing: set[asyncio.Task] = set()
        self._started: asyncio.Future | None = None
        self.replaced = 0

    async def start(self) -> None:
        """Starts every worker and waits until each said it is ready."""
        if self._started is None:
            self._started = asyncio.ensure_future(self._start_all())
        started = self._started
        try:
            await asyncio.shield(started)
        except BaseException:
            if started.done() and (started.cancelled() or started.exception() is not None):
                self._started = None  # failed: the next caller starts afresh
            raise

    async def _start_all(self) -> None:
        results = await asyncio.gather(*(self._start_one() for _ in range(self.size)),
                                       return_exceptions=True)
        workers = [r for r in results if isinstance(r, _Worker)]
        failed = [r for r in results if not isinstance(r, _Worker)]
        if failed:
            for worker in workers:
                await worker.stop()
            raise failed[0]
        for worker in workers:
            self._all.add(worker)
            self._idle.put_nowait(worker)

    async def ask(self, request: dict, deadline: float) -> dict:
        """The reply of an idle worker, given `deadline` seconds from when it got `request`."""
        await self.start()
        worker = await self._idle.get()
        try:
            reply = await asyncio.wait_for(worker.ask(request), deadline)
        except asyncio.TimeoutError:
            self._replace(worker)
            raise WorkerTimedOut(f"no answer within {deadline:g}s; {self.name} killed") from None
        except (EOFError, OSError, ValueError) as exc:
            self._replace(worker)
            raise WorkerDied(f"{self.name} failed: {exc}") from exc
        except BaseException:  # cancelled mid-request: the worker's state is unknown
            self._replace(worker)
            raise
        self._idle.put_nowait(worker)
        return reply

    async def _start_one(self) -> _Worker:
        return await _Worker.start(self._command, self._start_timeout, self.name)

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._all.discard(worker)
        self.replaced += 1
        task = asyncio.get_running_loop().create_task(self._start_replacement())
        self._replacing.add(task)
        task.add_done_callback(self._replacing.discard)

    async def _start_replacement(self) -> None:
        delay = 0.5
        while True:
            try:
                worker = await self._start_one()
            except Exception:  # noqa: BLE001 - keep trying; requests wait for a worker
                log.exception("could not start a %s; retrying in %.1fs", self.name, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
                continue
            self._all.add(worker)
            self._idle.put_nowait(worker)
            return

    async def close(self) -> None:
        for task in list(self._replacing):
            task.cancel()
        for worker in list(self._all):
            worker.kill()
        for worker in list(self._all):
            await worker.process.wait()
        self._all.clear()
