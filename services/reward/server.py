"""`asyncrl serve reward`: the gRPC Reward service.

The servicer only translates protobuf to domain types and back; `RewardScorer` does the work.
Errors are mapped to status codes in one place (`_status_for`): a malformed request (or a task
this job's reward cannot score) is INVALID_ARGUMENT, a sandbox that refuses to run code or a
reward function that cannot be loaded FAILED_PRECONDITION. Anything a scored response does is a
per-task `ScoreResult`, never an error.

A job's reward is started before the server listens: a python reward whose function cannot be
imported stops the service there, its message naming the module and the error.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass

import grpc

from asyncrl.scoring.metrics import RewardMetrics
from asyncrl.scoring.sandbox import SandboxUnavailable
from asyncrl.scoring.scorer import RewardScorer, UnsupportedTask
from asyncrl.scoring.types import ScoreTask
from asyncrl.scoring.worker_pool import WorkerStartError
from asyncrl.platform.grpc_errors import map_errors
from asyncrl.platform import grpc_service
from asyncrl.platform.settings import RewardSettings
from asyncrl.spec import load_manifest
from asyncrl.v1 import reward_pb2, reward_pb2_grpc

log = logging.getLogger(__name__)

# A batch is a few groups of responses; this bounds what one request may hold.
MAX_TASKS_PER_BATCH = 4096


class InvalidRequest(ValueError):
    pass


def _status_for(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, (InvalidRequest, UnsupportedTask)):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, (SandboxUnavailable, WorkerStartError)):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


_mapped = map_errors(_status_for, "reward")


def tasks_from_pb(request: reward_pb2.ScoreBatchRequest, job: str) -> list[ScoreTask]:
    if request.job and request.job != job:
        raise InvalidRequest(f"this reward service scores job {job!r}, not {request.job!r}")
    if len(request.tasks) > MAX_TASKS_PER_BATCH:
        raise InvalidRequest(f"{len(request.tasks)} tasks in one batch; send at most "
                             f"{MAX_TASKS_PER_BATCH}")
    try:
        return [ScoreTask.from_pb(task) for task in request.tasks]
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from exc


class RewardServicer(reward_pb2_grpc.RewardServicer):
    def __init__(self, scorer: RewardScorer, job: str, kind: str):
        self._scorer = scorer
        self._job = job
        self._kind = kind

    @_mapped
    async def ScoreBatch(self, request, context):
        results = await self._scorer.score(tasks_from_pb(request, self._job))
        return reward_pb2.ScoreBatchResponse(results=[r.to_pb() for r in results])


@dataclass
class RunningReward:
    server: grpc.aio.Server
    scorer: RewardScorer
    metrics: RewardMetrics

    async def close(self) -> None:
        await self.server.stop(grace=2)
        await self.scorer.close()


async def start_server(settings: RewardSettings) -> RunningReward:
    job = load_manifest(settings.job_file)
    metrics = RewardMetrics(job.metadata.name)
    scorer = RewardScorer.from_spec(job.spec.reward, workers=settings.workers, metrics=metrics,
                                    uid_base=settings.sandbox_uid_base)
    # The job's own kind is ready before the first request (and health tells the truth).
    try:
        await scorer.start([job.spec.reward.kind])
    except BaseException:
        await scorer.close()
        raise
    server = await create_server(scorer, job.metadata.name, job.spec.reward.kind,
                                 f"{settings.host}:{settings.grpc_port}")
    return RunningReward(server, scorer, metrics)


async def create_server(scorer: RewardScorer, job: str, kind: str, address: str) -> grpc.aio.Server:
    """A started gRPC server for `scorer` on `address` (host:port)."""

    async def can_score() -> bool:
        # The job's own kind decides: a math job is served while the code sandbox is
        # unavailable; an http job is not while its endpoint is unreachable.
        return await scorer.ready()

    return await grpc_service.start_server(
        "reward", address,
        lambda server: reward_pb2_grpc.add_RewardServicer_to_server(
            RewardServicer(scorer, job, kind), server),
        can_score)


def serve(settings: RewardSettings) -> None:
    async def run() -> None:
        running = await start_server(settings)
        if settings.metrics_port:
            running.metrics.serve(settings.metrics_port, settings.host)
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):  # stop cleanly: workers, sandboxes
            loop.add_signal_handler(signum, lambda: loop.create_task(running.server.stop(grace=2)))
        try:
            await running.server.wait_for_termination()
        finally:
            await running.close()

    try:
        asyncio.run(run())
    except WorkerStartError as exc:  # e.g. the job's reward function does not import
        raise SystemExit(f"reward service cannot start: {exc}") from None
