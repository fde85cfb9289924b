"""`asyncrl serve buffer`: the gRPC Buffer service over Redis.

The servicer only translates protobuf; `check_group` decides what a well-formed group is and
`BufferStore` does the work. Errors are mapped to status codes in one place (`_status_for`),
and a bad request changes nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import redis.asyncio as redis

from asyncrl.buffer.groups import check_group
from asyncrl.buffer.metrics import BufferMetrics
from asyncrl.buffer.store import (
    Batch,
    BufferError,
    BufferStore,
    FailedPrecondition,
    InvalidArgument,
    JobConfig,
    NotFound,
    Put,
    PutResult,
    ResourceExhausted,
    SlotGrant,
)
from asyncrl.platform.grpc_errors import map_errors
from asyncrl.platform.heap import reuse_large_blocks
from asyncrl.platform import grpc_service
from asyncrl.platform.outage import REDIS_DOWN, Outage, OutageTooLong, connect, redis_address, retry
from asyncrl.platform.settings import BufferSettings
from asyncrl.spec import load_manifest
from asyncrl.v1 import buffer_pb2, buffer_pb2_grpc
from asyncrl.weights.announcements import WeightVersion

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


class BufferServicer(buffer_pb2_grpc.BufferServicer):
    def __init__(self, store: BufferStore, client: redis.Redis, metrics: BufferMetrics):
        self._store = store
        self._client = client
        self._metrics = metrics

    @_mapped
    async def AcquireSlot(self, request, context):
        return _grant_pb(await self._store.acquire_slot(request.job, request.worker,
                                                        request.prompts))

    @_mapped
    async def Heartbeat(self, request, context):
        alive, expires = await self._store.heartbeat(request.job, request.slot_id)
        return buffer_pb2.HeartbeatResponse(alive=alive, lease_expires_unix_ms=expires)

    @_mapped
    async def ReleaseSlot(self, request, context):
        released = await self._store.release_slot(request.job, request.slot_id,
                                                  uniform_rewards=request.uniform_rewards,
                                                  prompt_used=request.prompt_used)
        return buffer_pb2.ReleaseSlotResponse(released=released)

    @_mapped
    async def PutGroup(self, request: buffer_pb2.EncodedPutGroupRequest, context):
        group = request.group  # each read of a bytes field copies it
        group_id, oldest = check_group(group, self._store.job(request.job))
        put = await self._store.put_group(
            request.job, request.slot_id, group_id, oldest, group,
            next_worker=request.worker if request.acquire_next else None, prompts=request.prompts,
        )
        return _put_pb(put)

    @_mapped
    async def PutGroups(self, requests, context):
        """A worker's stream of EncodedPutGroupsRequest, each answered in turn."""
        async for request in requests:
            yield await self._put_each(request)

    async def _put_each(self, request: buffer_pb2.EncodedPutGroupsRequest
                        ) -> buffer_pb2.PutGroupsResponse:
        if not request.puts:
            return buffer_pb2.PutGroupsResponse()
        if len({put.job for put in request.puts}) > 1:
            raise InvalidArgument("the puts of one PutGroups message name different jobs; "
                                  "send one message per job")
        job = self._store.job(request.puts[0].job)
        outcomes: list = [None] * len(request.puts)
        puts = []
        for index, put in enumerate(request.puts):
            group = put.group  # each read of a bytes field copies it
            try:
                group_id, oldest = check_group(group, job)
            except BufferError as exc:
                outcomes[index] = exc
                continue
            puts.append((index, Put(put.slot_id, group_id, oldest, group,
                                    put.worker if put.acquire_next else None, put.prompts)))
        stored = await self._store.put_groups(job.name, [put for _, put in puts])
        for (index, _), outcome in zip(puts, stored):
            outcomes[index] = outcome
        return buffer_pb2.PutGroupsResponse(results=[_put_result_pb(o) for o in outcomes])

    @_mapped
    async def GetBatch(self, request, context):
        """The batch in parts (buffer.proto), each encoded here (`_batch_parts`)."""
        batch = await self._store.get_batch(
            request.job, request.consumer, request.num_groups, request.wait_ms
        )
        for part in _batch_parts(batch):
            yield part

    @_mapped
    async def AckBatch(self, request, context):
        return buffer_pb2.AckBatchResponse(
            acknowledged=await self._store.ack_batch(request.job, request.batch_id)
        )

    @_mapped
    async def SetVersion(self, request, context):
        announced = await self._store.set_version(request.job, request.version, request.weights_uri,
                                                  request.trainer_step, final=request.final)
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


_GROUPS_TAG = bytes([buffer_pb2.EncodedBatch.DESCRIPTOR.fields_by_name["groups"].number << 3 | 2])
#: Bytes of groups one GetBatch message carries (a larger group goes alone): 8 MiB parts
#: moved a 64 MB batch 3.5 times faster than one message (buffer.proto).
BATCH_PART_BYTES = 8 << 20


def _batch_parts(batch: Batch) -> Iterator[bytes]:
    """The Batch as the messages of GetBatch, each encoded as an EncodedBatch: the small
    fields by protobuf in the first, each group framed here as one more `groups` field (tag,
    length, bytes), so that the tens of MB of a batch are copied once, not into a message and
    out."""
    part = [buffer_pb2.EncodedBatch(batch_id=batch.batch_id, dropped_stale=batch.dropped_stale,
                                    redelivered=batch.redelivered).SerializeToString()]
    size = 0
    for entry in batch.entries:
        group = entry.group_bytes
        if size and size + len(group) > BATCH_PART_BYTES:
            yield b"".join(part)
            part, size = [], 0
        part += (_GROUPS_TAG, _varint(len(group)), group)
        size += len(group)
    yield b"".join(part)


def _varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _put_pb(put: PutResult) -> buffer_pb2.PutGroupResponse:
    return buffer_pb2.PutGroupResponse(
        accepted=True, accepted_total=put.accepted_total,
        next_slot=_grant_pb(put.next_slot) if put.next_slot else None,
    )


def _put_result_pb(outcome: PutResult | Exception) -> buffer_pb2.PutGroupResult:
    if isinstance(outcome, PutResult):
        return buffer_pb2.PutGroupResult(response=_put_pb(outcome))
    code, message = _status_for(outcome)
    return buffer_pb2.PutGroupResult(code=code.value[0], message=message)


def _grant_pb(grant: SlotGrant) -> buffer_pb2.AcquireSlotResponse:
    return buffer_pb2.AcquireSlotResponse(
        granted=grant.granted, slot_id=grant.slot_id,
        lease_expires_unix_ms=grant.lease_expires_unix_ms, reason=grant.reason,
        retry_after_ms=0 if grant.granted else 100, prompt_cursor=grant.prompt_cursor,
    )


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
        self.store.close()
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
        lambda server: add_servicer(BufferServicer(store, client, metrics), server),
        lambda: redis_answers(client))


class _Handlers:
    """Stands in for a server to take the handlers the generated code registers."""

    def add_generic_rpc_handlers(self, _) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.service, self.handlers = service, handlers


def add_servicer(servicer: BufferServicer, server: grpc.aio.Server) -> None:
    """Registers `servicer` as the generated add_BufferServicer_to_server does, except that
    PutGroup(s) read their requests and GetBatch writes its replies with groups left encoded
    (Encoded* in buffer.proto, `_batch_parts`): the same bytes on the wire."""
    generated = _Handlers()
    buffer_pb2_grpc.add_BufferServicer_to_server(servicer, generated)
    handlers = dict(generated.handlers)
    handlers["PutGroup"] = grpc.unary_unary_rpc_method_handler(
        servicer.PutGroup, request_deserializer=buffer_pb2.EncodedPutGroupRequest.FromString,
        response_serializer=buffer_pb2.PutGroupResponse.SerializeToString)
    handlers["PutGroups"] = grpc.stream_stream_rpc_method_handler(
        servicer.PutGroups, request_deserializer=buffer_pb2.EncodedPutGroupsRequest.FromString,
        response_serializer=buffer_pb2.PutGroupsResponse.SerializeToString)
    handlers["GetBatch"] = grpc.unary_stream_rpc_method_handler(  # it streams encoded bytes
        servicer.GetBatch, request_deserializer=buffer_pb2.GetBatchRequest.FromString)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(generated.service, handlers),))
    server.add_registered_method_handlers(generated.service, handlers)


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
    reuse_large_blocks()  # groups of hundreds of KB and batches of MBs, many a second

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
