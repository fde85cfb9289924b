"""Clients of the buffer service: the rollout side (a SlotGate for the workflow, with lease
heartbeats) and the trainer side (batches, acknowledgements, versions)."""

from __future__ import annotations

import asyncio
import logging

import grpc

from asyncrl.platform.coalesce import Coalescer
from asyncrl.platform.grpc_health import is_serving
from asyncrl.platform.grpc_service import channel
from asyncrl.platform.outage import DEFAULT_OUTAGE_SECONDS, Outage, retry
from asyncrl.data.samples import Group, Slot
from asyncrl.v1 import buffer_pb2, buffer_pb2_grpc, common_pb2

log = logging.getLogger(__name__)

# Calls that are safe to repeat (puts are idempotent per slot, acks per batch).
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


_CODES = {code.value[0]: code for code in grpc.StatusCode}

#: The gate's answer once every prompt of every epoch is used (scripts._GRANT): final.
EXHAUSTED = "exhausted"

#: How long a put message waits for its answer before its call is given up (and retried).
PUT_TIMEOUT_SECONDS = 30
#: Bytes of groups one PutGroups message carries at most (a lone larger group goes alone):
#: well under the buffer's 64 MiB receive limit, and as much as one buffer replica has on
#: its way to Redis at once (store.WRITE_BYTES), so a worker with many long groups under way
#: does not hold them all back for one huge message.
PUT_MESSAGE_BYTES = 8 << 20


def _refusal(result: buffer_pb2.PutGroupResult) -> grpc.aio.AioRpcError:
    """One refused put of a PutGroups message, as the error its own PutGroup would have
    raised."""
    return _error(_CODES[result.code], result.message)


class _PutStream:
    """The worker's open PutGroups call: opened on first use, and again after it failed. One
    message on its way at a time (its caller, a Coalescer, sends one at a time), so each
    reply is the answer to the message just written."""

    def __init__(self, method: grpc.aio.StreamStreamMultiCallable):
        self._method = method
        self._call: grpc.aio.StreamStreamCall | None = None

    async def send(self, request, *, timeout: float):
        if self._call is None or self._call.done():
            self._call = self._method()
        call = self._call
        try:
            await call.write(request)
            async with asyncio.timeout(timeout):  # no task per message, as wait_for makes
                reply = await call.read()
        except BaseException as exc:
            self._drop(call)
            if isinstance(exc, asyncio.TimeoutError):
                raise _error(grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"no answer to a put within {timeout:g} s") from None
            if isinstance(exc, asyncio.InvalidStateError):  # it ended before the write
                raise _error(grpc.StatusCode.UNAVAILABLE, "the put stream ended") from None
            raise
        if reply is grpc.aio.EOF:  # the buffer ended the call (it is stopping)
            self._drop(call)
            raise _error(grpc.StatusCode.UNAVAILABLE, "the buffer ended the put stream")
        return reply

    def _drop(self, call: grpc.aio.StreamStreamCall) -> None:
        call.cancel()
        if self._call is call:
            self._call = None

    def close(self) -> None:
        if self._call is not None:
            self._drop(self._call)


def _error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


def _unavailable(exc: BaseException) -> bool:
    """The buffer or its Redis is down for now (a restart): worth waiting for."""
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in _RETRYABLE


class BufferClient:
    def __init__(self, address: str, job: str, worker: str = "worker", *, lease_seconds: float = 30,
                 outage_seconds: float = DEFAULT_OUTAGE_SECONDS, prompts: int = 0):
        self._channel = channel(address)
        self.stub = buffer_pb2_grpc.BufferStub(self._channel)
        # PutGroups with each group encoded once (EncodedPutGroupsRequest: PutGroupsRequest's
        # bytes), rather than copied into a request and then encoded: a group is large.
        service = f"/{buffer_pb2.DESCRIPTOR.services_by_name['Buffer'].full_name}"
        self._put_stream = _PutStream(self._channel.stream_stream(
            f"{service}/PutGroups",
            request_serializer=buffer_pb2.EncodedPutGroupsRequest.SerializeToString,
            response_deserializer=buffer_pb2.PutGroupsResponse.FromString))
        # GetBatch's parts as they came (bytes), merged into one Batch by `_whole_batch`.
        self._batch_parts = self._channel.unary_stream(
            f"{service}/GetBatch",
            request_serializer=buffer_pb2.GetBatchRequest.SerializeToString)
        # Puts made while a message is on its way go together in the next one, up to
        # PUT_MESSAGE_BYTES (one message at a time on the stream, so replies need no matching).
        self._puts = Coalescer(self._send_puts, limit=PUT_MESSAGE_BYTES,
                               weight=lambda put: len(put["group"]))
        self.address = address
        self._outage_seconds = outage_seconds
        self.job = job
        self.worker = worker
        self.prompts = prompts  # the training prompts a rollout worker draws from (N)
        self._heartbeat_every = max(lease_seconds / 3, 0.05)
        self._heartbeats: dict[str, asyncio.Task] = {}

    async def _with_retries(self, call):
        """`call()`, retried with backoff while the buffer (or its Redis) is unavailable, for up
        to `outage_seconds`; then OutageTooLong."""
        outage = Outage(f"the buffer at {self.address} (or its Redis)", self._outage_seconds)
        return await retry(call, outage, transient=_unavailable)

    async def close(self) -> None:
        for task in self._heartbeats.values():
            task.cancel()
        self._puts.close()
        self._put_stream.close()
        await self._channel.close()

    # ------------------------------------------------------------------ rollout side (SlotGate)

    async def acquire(self) -> Slot | None:
        """Waits (politely) until the staleness gate grants a slot, then keeps its lease alive;
        None once every prompt of every epoch is used (no slot will be granted again)."""
        while True:
            reply = await self._with_retries(lambda: self.stub.AcquireSlot(
                buffer_pb2.AcquireSlotRequest(job=self.job, worker=self.worker,
                                              prompts=self.prompts), timeout=10))
            if reply.granted:
                return self._hold(reply.slot_id, reply.prompt_cursor)
            if reply.reason == EXHAUSTED:
                return None
            await asyncio.sleep(max(reply.retry_after_ms, 20) / 1000)

    async def put(self, slot: Slot, group: Group | common_pb2.Group | bytes, *,
                  acquire_next: bool = False) -> Slot | None:
        """Puts `group` (a Group, its protobuf, or that protobuf encoded) with `slot`. With
        `acquire_next`, also asks the gate for this worker's next slot in the same round trip:
        that Slot (its lease kept alive) if granted, else None (`acquire` then waits for one)."""
        if isinstance(group, Group):
            group = group.to_pb()
        encoded = group if isinstance(group, bytes) else group.SerializeToString()
        reply = await self._puts.submit(dict(
            job=self.job, slot_id=slot.slot_id, group=encoded, acquire_next=acquire_next,
            worker=self.worker, prompts=self.prompts))
        self._stop_heartbeat(slot)
        granted = reply.next_slot
        return self._hold(granted.slot_id, granted.prompt_cursor) if granted.granted else None

    async def _send_puts(self, puts: list[dict]) -> list:
        """One message on the PutGroups stream for `puts` (each an EncodedPutGroupRequest's
        fields): each put's reply, or the error its own PutGroup would have raised. The puts
        are built in the message: a built put handed to it would be copied, group and all
        (160 us for 8k tokens)."""
        request = buffer_pb2.EncodedPutGroupsRequest()
        for fields in puts:
            request.puts.add(**fields)
        reply = await self._with_retries(
            lambda: self._put_stream.send(request, timeout=PUT_TIMEOUT_SECONDS))
        return [r.response if r.code == 0 else _refusal(r) for r in reply.results]

    async def release(self, slot: Slot, reason: str, *, uniform_rewards: bool = False,
                      prompt_used: bool = False) -> None:
        """Gives `slot` back without a group: its prompt is handed out again, unless
        `prompt_used` (or `uniform_rewards`, see `skip`)."""
        self._stop_heartbeat(slot)
        await self._with_retries(lambda: self.stub.ReleaseSlot(
            buffer_pb2.ReleaseSlotRequest(job=self.job, slot_id=slot.slot_id, reason=reason,
                                          uniform_rewards=uniform_rewards,
                                          prompt_used=prompt_used),
            timeout=10))

    async def skip(self, slot: Slot) -> None:
        await self.release(slot, "every reward equal", uniform_rewards=True)

    def _hold(self, slot_id: str, prompt_cursor: int) -> Slot:
        """A granted slot, whose lease is kept alive until it is put or released."""
        self._heartbeats[slot_id] = asyncio.create_task(self._keep_alive(slot_id))
        return Slot(slot_id, prompt_cursor)

    async def _keep_alive(self, slot_id: str) -> None:
        while True:
            await asyncio.sleep(self._heartbeat_every)
            try:
                reply = await self.stub.Heartbeat(
                    buffer_pb2.HeartbeatRequest(job=self.job, slot_id=slot_id), timeout=5)
                if not reply.alive:
                    log.warning("slot %s expired before its group was put", slot_id)
                    return
            except grpc.aio.AioRpcError as exc:
                log.warning("heartbeat for %s failed: %s", slot_id, exc.details())

    def _stop_heartbeat(self, slot: Slot) -> None:
        task = self._heartbeats.pop(slot.slot_id, None)
        if task:
            task.cancel()

    # ------------------------------------------------------------------ trainer side

    async def get_batch(self, consumer: str, num_groups: int, wait_ms: int = 1000) -> buffer_pb2.Batch:
        """The next batch (an empty one if none was ready within `wait_ms`). A call that
        fails on the way is made again: the buffer hands this consumer the same batch."""
        request = buffer_pb2.GetBatchRequest(job=self.job, consumer=consumer,
                                             num_groups=num_groups, wait_ms=wait_ms)
        return await self._with_retries(
            lambda: self._whole_batch(request, timeout=wait_ms / 1000 + 30))

    async def _whole_batch(self, request: buffer_pb2.GetBatchRequest, *,
                           timeout: float) -> buffer_pb2.Batch:
        """GetBatch's parts merged as they arrive, each decoded straight into the Batch."""
        batch = buffer_pb2.Batch()
        async for part in self._batch_parts(request, timeout=timeout):
            batch.MergeFromString(part)
        return batch

    async def ack(self, batch_id: str) -> None:
        await self._with_retries(lambda: self.stub.AckBatch(
            buffer_pb2.AckBatchRequest(job=self.job, batch_id=batch_id), timeout=30))

    async def set_version(self, version: int, weights_uri: str, step: int = 0,
                          final: bool = False) -> buffer_pb2.VersionInfo:
        """Announces `version`; `final`: the job's last weights (the trainer is done)."""
        return await self._with_retries(lambda: self.stub.SetVersion(buffer_pb2.SetVersionRequest(
            job=self.job, version=version, weights_uri=weights_uri, trainer_step=step,
            final=final), timeout=30))

    async def stats(self) -> buffer_pb2.BufferStats:
        return await self._with_retries(lambda: self.stub.GetStats(
            buffer_pb2.GetStatsRequest(job=self.job), timeout=10))

    async def healthy(self) -> bool:
        return await is_serving(self._channel)
