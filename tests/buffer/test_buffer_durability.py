"""Redis going away under a real buffer process: kill -9 of redis-server (AOF) and of the
buffer in the middle of a run, where every acknowledged put is delivered to the trainer, and
acknowledged, exactly once; and a Redis that is stopped and started again, which the buffer
rides through (not serving meanwhile) up to its outage bound, past which it exits."""

import asyncio
import os
import shutil
import time
from pathlib import Path

import grpc
import pytest
import redis as sync_redis
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from asyncrl.clients.buffer import BufferClient
from asyncrl.platform.redis_keys import key
from asyncrl.platform.grpc_health import LIVENESS, NOT_SERVING, SERVING
from asyncrl.platform.outage import OutageTooLong
from asyncrl.v1 import buffer_pb2
from support import ROOT
from support.buffer import BufferProcess, make_group, wait_healthy

GROUPS = 24


def write_job(tmp_path: Path) -> tuple[Path, dict]:
    """examples/tiny.yaml where the producer never waits for the trainer."""
    manifest = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    manifest["spec"]["algorithm"]["maxStaleness"] = 100
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(manifest))
    return job_file, manifest


@pytest.mark.slow
def test_nothing_acknowledged_is_lost_or_duplicated(redis_server, tmp_path):
    job_file, manifest = write_job(tmp_path)
    group_size = manifest["spec"]["algorithm"]["groupSize"]
    batch_size = manifest["spec"]["algorithm"]["batchSize"]
    buffer = BufferProcess(job_file, redis_server.url, tmp_path / "buffer.log").start()

    async def scenario():
        client = BufferClient(buffer.address, "tiny", "producer")
        await wait_healthy(client)
        acknowledged = []
        for index in range(GROUPS):
            if index == 8:
                redis_server.kill()  # Redis crashes; the buffer answers UNAVAILABLE meanwhile
                redis_server.start()
            if index == 16:
                buffer.kill()  # the buffer crashes; it holds no state, a new one takes over
                buffer.start()
            slot = await client.acquire()
            await client.put(slot, make_group(f"g{index}", group_size))
            acknowledged.append(f"g{index}")

        delivered = []
        batch = await client.get_batch("trainer-0", batch_size)
        buffer.kill()  # the trainer's batch is in flight, unacknowledged, when the buffer dies
        redis_server.kill()
        redis_server.start()
        buffer.start()
        again = await client.get_batch("trainer-0", batch_size)
        assert again.redelivered and again.batch_id == batch.batch_id
        await client.ack(again.batch_id)
        delivered += [g.group_id for g in again.groups]
        while True:
            batch = await client.get_batch("trainer-0", batch_size, wait_ms=200)
            if not batch.batch_id:
                break
            await client.ack(batch.batch_id)
            delivered += [g.group_id for g in batch.groups]
        stats = await client.stats()
        await client.close()
        return acknowledged, delivered, stats

    try:
        acknowledged, delivered, stats = asyncio.run(scenario())
    finally:
        buffer.kill()
    assert sorted(delivered) == sorted(acknowledged)  # each exactly once
    assert len(delivered) == GROUPS
    assert stats.accepted_total == GROUPS and stats.consumed_total == GROUPS
    assert stats.depth_groups == 0 and stats.running_slots == 0


async def health(address: str, service: str = "") -> int:
    """The buffer's grpc.health.v1 status of `service` ("" = readiness, LIVENESS); an RPC error
    fails the test: the buffer must keep running."""
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10)
    return reply.status


async def wait_serving(address: str, serving: bool, timeout: float = 120) -> None:
    wanted = SERVING if serving else NOT_SERVING
    deadline = time.monotonic() + timeout
    while await health(address) != wanted:
        assert time.monotonic() < deadline, f"health never said serving={serving}"
        await asyncio.sleep(0.1)


async def wait_for_line(log: Path, text: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while text not in log.read_text():
        assert time.monotonic() < deadline, f"{text!r} never logged:\n{log.read_text()}"
        await asyncio.sleep(0.1)


@pytest.mark.slow
def test_the_buffer_rides_through_a_redis_restart_and_loses_nothing(redis_server, tmp_path):
    job_file, manifest = write_job(tmp_path)
    group_size = manifest["spec"]["algorithm"]["groupSize"]
    log = tmp_path / "buffer.log"
    buffer = BufferProcess(job_file, redis_server.url, log).start()
    redis_down = f"Redis at 127.0.0.1:{redis_server.port} is unreachable"

    async def scenario():
        client = BufferClient(buffer.address, "tiny", "producer")
        await wait_healthy(client)
        before = [f"before-{i}" for i in range(6)]
        for group_id in before:
            await client.put(await client.acquire(), make_group(group_id, group_size))
        refused_slot, retried_slot = await client.acquire(), await client.acquire()

        redis_server.stop()
        await wait_serving(buffer.address, False)  # unready, yet alive: not restarted
        assert await health(buffer.address, LIVENESS) == SERVING
        # One attempt, as a caller without retries makes it: an error, never OK.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.stub.PutGroup(buffer_pb2.PutGroupRequest(
                job="tiny", slot_id=refused_slot.slot_id,
                group=make_group("refused", group_size)), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        # The client's put waits the outage out; the buffer's watch has seen it, and waits too.
        retried = asyncio.create_task(client.put(retried_slot, make_group("retried", group_size)))
        await wait_for_line(log, redis_down)
        assert not retried.done() and buffer.process.poll() is None

        redis_server.start()  # the same port and files
        await wait_serving(buffer.address, True)
        await retried
        await wait_for_line(log, f"Redis at 127.0.0.1:{redis_server.port} is reachable again")
        stats = await client.stats()
        await client.close()
        return before, stats

    try:
        before, stats = asyncio.run(scenario())
        assert buffer.process.poll() is None  # it never exited
    finally:
        buffer.kill()
    # What Redis holds: everything written before the outage, and the put that waited.
    client = sync_redis.Redis(port=redis_server.port)
    try:
        stored = [f[b"id"].decode() for _, f in client.xrange(key("tiny", "groups"))]
    finally:
        client.close()
    assert sorted(stored) == sorted([*before, "retried"])
    assert stats.accepted_total == len(before) + 1


@pytest.mark.slow
def test_past_the_outage_bound_the_buffer_exits_naming_redis(redis_server, tmp_path):
    job_file, _ = write_job(tmp_path)
    log = tmp_path / "buffer.log"
    env = {**os.environ, "ASYNCRL_OUTAGE_SECONDS": "2"}
    buffer = BufferProcess(job_file, redis_server.url, log, env=env).start()

    async def scenario():
        client = BufferClient(buffer.address, "tiny", "producer", outage_seconds=2)
        await wait_healthy(client)
        redis_server.stop()
        # Its callers give up too, past the same bound, naming what they waited for.
        with pytest.raises(OutageTooLong, match=f"the buffer at {buffer.address}"):
            await client.acquire()
        await client.close()

    try:
        asyncio.run(scenario())
        code = buffer.process.wait(timeout=120)
    finally:
        buffer.kill()
    assert code != 0
    text = " ".join(log.read_text().split())
    assert (f"buffer: Redis at 127.0.0.1:{redis_server.port} has been unreachable" in text), text
    assert "ASYNCRL_OUTAGE_SECONDS" in text


@pytest.mark.slow
def test_a_redis_that_comes_back_empty_gets_the_job_again_and_the_buffer_serves(redis_server,
                                                                                tmp_path):
    job_file, _ = write_job(tmp_path)
    log = tmp_path / "buffer.log"
    buffer = BufferProcess(job_file, redis_server.url, log).start()

    async def scenario():
        client = BufferClient(buffer.address, "tiny", "producer")
        await wait_healthy(client)
        await client.release(await client.acquire(), "test")
        # A Redis with `persistence: none` restarts with nothing: same port, no files.
        redis_server.stop()
        shutil.rmtree(redis_server.data_dir)
        redis_server.start()
        await wait_for_line(log, "came back without the job's state")
        slot = await client.acquire()  # the gate works again, not "job not registered"
        await client.release(slot, "test")
        await client.close()

    try:
        asyncio.run(scenario())
        assert buffer.process.poll() is None  # it never exited
    finally:
        buffer.kill()
