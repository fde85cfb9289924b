"""`asyncrl serve buffer`: the gRPC Buffer service over Redis.

The servicer only checks and translates protobuf; `BufferStore` does the work. Errors are
mapped to status codes in one place (`_status_for`), and a bad request changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
import redis.asyncio as redis

from asyncrl.buffer.metrics import BufferMetrics
from asyncrl.buffer.store import (
    BufferError,
    BufferStore,
    FailedPrecondition,
    InvalidArgument,
    JobConfig,
    NotFound,
    ResourceExhausted,
)
from asyncrl.grpc_errors import map_errors
from asyncrl import grpc_service
from asyncrl.outage import REDIS_DOWN, Outage, OutageTooLong, connect, redis_address, retry
from asyncrl.settings import BufferSettings
from asyncrl.spec import load_manifest
from asyncrl.v1 import buffer_pb2, buffer_pb2_grpc, common_pb2
from asyncrl.weights import WeightVersion

log = logging.getLogger(__name__)

_STATUS = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    NotFound: grpc.StatusCode.NOT_FOUND,
    FailedPrecondition: grpc.StatusCode.FAILED_PRECONDITION,
    ResourceExhausted: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def _status_for(exc: Exception) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, BufferError):
        return _STATUS.get(type(exc), grpc.StatusCode.INVALID_ARGUMENT), str(exc)
    if isinstance(exc, REDIS_DOWN):
        return grpc.StatusCode.UNAVAILABLE, f"Redis is unavailable: {exc}"
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


_mapped = map_errors(_status_for, "buffer")


def validate_group(group: common_pb2.Group, job: JobConfig) -> int:
    """Checks a put group is well formed; returns its oldest token version."""
    if not group.group_id:
        raise InvalidArgument("group.group_id is empty")
    if len(group.samples) != job.group_size:
        raise InvalidArgument(
            f"group has {len(group.samples)} samples; job {job.name!r} has algorithm.groupSize "
            f"{job.group_size}: put whole groups"
        )
    oldest = None
    for index, sample in enumerate(group.samples):
        where = f"group.samples[{index}]"
        if not sample.prompt_ids:
            raise InvalidArgument(f"{where}.prompt_ids is empty")
        n = len(sample.response_ids)
        if len(sample.behaviour_logprobs) != n or len(sample.token_versions) != n:
            raise InvalidArgument(
                f"{where}: response_ids, behaviour_logprobs and token_versions need one entry "
                f"per response token (got {n}, {len(sample.behaviour_logprobs)}, "
                f"{len(sample.token_versions)})"
            )
        # min() runs in C over the repeated fields: records hold thousands of tokens.
        if min(sample.prompt_ids) < 0 or (n and min(sample.response_ids) < 0):
            raise InvalidArgument(f"{where} has a negative token id")
        if n:
            low = min(sample.token_versions)
            if low < 0:
                raise InvalidArgument(f"{where}.token_versions has a negative version")
            oldest = low if oldest is None else min(oldest, low)
    return oldest or 0


class BufferServicer(buffer_pb2_grpc.BufferServicer):
    def __init__(self, store: BufferStore, client: redis.Redis, metrics: BufferMetrics):
        self._store = store
        self._client = client
        self._metrics = metrics

    @_mapped
    async def AcquireSlot(self, request, context):
        grant = await self._store.acquire_slot(request.job, request.worker)
        return buffer_pb2.AcquireSlotResponse(
            granted=grant.granted, slot_id=grant.slot_id,
            lease_expires_unix_ms=grant.lease_expires_unix_ms, reason=grant.reason,
            retry_after_ms=0 if grant.granted else 100,
        )

    @_mapped
    async def Heartbeat(self, request, context):
        alive, expires = await self._store.heartbeat(request.job, request.slot_id)
        return buffer_pb2.HeartbeatResponse(alive=alive, lease_expires_unix_ms=expires)

    @_mapped
    async def ReleaseSlot(self, request, context):
        released = await self._store.release_slot(request.job, request.slot_id)
        return buffer_pb2.ReleaseSlotResponse(released=released)

    @_mapped
    async def PutGroup(self, request, context):
        job = self._store.job(request.job)
        oldest = validate_group(request.group, job)
        _, accepted = await self._store.put_group(
            request.job, request.slot_id, request.group.group_id, oldest,
            request.group.SerializeToString(),
        )
        self._metrics.observe_put(request.group)
        return buffer_pb2.PutGroupResponse(accepted=True, accepted_total=accepted)

    @_mapped
    async def GetBatch(self, request, context):
        batch = await self._store.get_batch(
            request.job, request.consumer, request.num_groups, request.wait_ms
        )
        self._metrics.observe_batch(batch)
        return buffer_pb2.Batch(
            batch_id=batch.batch_id,
            groups=[common_pb2.Group.FromString(e.group_bytes) for e in batch.entries],
            dropped_stale=batch.dropped_stale,
            redelivered=batch.redelivered,
        )

    @_mapped
    async def AckBatch(self, request, context):
        return buffer_pb2.AckBatchResponse(
            acknowledged=await self._store.ack_batch(request.job, request.batch_id)
        )

    @_mapped
    async def SetVersion(self, request, context):
        announced = await self._store.set_version(request.job, request.version, request.weights_uri,
                                                  request.trainer_step)
        return _version_pb(announced)

    @_mapped
    async def GetStats(self, request, context):
        stats = await self._store.stats(request.job)
        self._metrics.observe_stats(request.job, stats)
        return buffer_pb2.BufferStats(**stats.__dict__)


async def redis_answers(client: redis.Redis, timeout: float = 1.0) -> bool:
    """The buffer's health: it can work while Redis answers (within a probe's patience)."""
    try:
        await asyncio.wait_for(client.ping(), timeout)
    except (*REDIS_DOWN, asyncio.TimeoutError):
        return False
    return True


def _version_pb(announced: WeightVersion) -> buffer_pb2.VersionInfo:
    return buffer_pb2.VersionInfo(
        version=announced.version, weights_uri=announced.uri,
        updated_unix_ms=announced.updated_unix_ms,
    )


@dataclass
class RunningBuffer:
    server: grpc.aio.Server
    client: redis.Redis
    store: BufferStore
    metrics: BufferMetrics
    job: str
    redis: Outage

    async def close(self) -> None:
        await self.server.stop(grace=2)
        await self.client.aclose()


async def start_server(settings: BufferSettings) -> RunningBuffer:
    job = load_manifest(settings.job_file)
    client = connect(settings.redis_url, password=settings.redis_password)
    store = BufferStore(client, [JobConfig.from_job(job)])
    # Redis may still be starting (a pod, or a restart): wait for it rather than crash.
    outage = Outage(f"Redis at {redis_address(settings.redis_url)}", settings.outage_seconds)
    await retry(store.register, outage)
    metrics = BufferMetrics()
    server = await create_server(store, client, metrics, f"{settings.host}:{settings.grpc_port}")
    return RunningBuffer(server, client, store, metrics, job.metadata.name, outage)


async def create_server(
    store: BufferStore, client: redis.Redis, metrics: BufferMetrics, address: str
) -> grpc.aio.Server:
    """A started gRPC server for `store` on `address` (host:port)."""
    return await grpc_service.start_server(
        "buffer", address,
        lambda server: buffer_pb2_grpc.add_BufferServicer_to_server(
            BufferServicer(store, client, metrics), server),
        lambda: redis_answers(client), send=grpc_service.BATCH_BYTES)


async def _watch_redis(running: RunningBuffer, every: float = 2.0) -> None:
    """Reads the job's totals from Redis every `every` seconds, which keeps the exported
    metrics fresh when nobody calls GetStats and notices an outage: meanwhile requests get
    UNAVAILABLE (clients retry) and Health says not serving. Raises OutageTooLong once Redis
    has been unreachable for longer than the bound. A Redis that came back empty (restarted
    without its files) gets the job's settings again, as a new buffer would write them."""
    while True:
        if not await retry(running.store.registered, running.redis):
            log.warning("%s came back without the job's state (persistence none?): "
                        "registering the job again; what it held is lost", running.redis.what)
            await retry(running.store.register, running.redis)
        stats = await retry(lambda: running.store.stats(running.job), running.redis)
        running.metrics.observe_stats(running.job, stats)
        await asyncio.sleep(every)


def serve(settings: BufferSettings) -> None:
    async def run() -> None:
        running = await start_server(settings)
        if settings.metrics_port:
            running.metrics.serve(settings.metrics_port, settings.host)
        watch = asyncio.create_task(_watch_redis(running))
        stopped = asyncio.create_task(running.server.wait_for_termination())
        try:
            done, _ = await asyncio.wait({watch, stopped}, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()  # past the outage bound: OutageTooLong
        finally:
            watch.cancel()
            await running.close()

    try:
        asyncio.run(run())
    except OutageTooLong as exc:
        raise SystemExit(f"buffer: {exc}") from None
