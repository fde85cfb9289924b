"""Kill -9 of redis-server (AOF) and of the buffer process in the middle of a run: every
acknowledged put is delivered to the trainer, and acknowledged, exactly once."""

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from asyncrl.buffer.client import BufferClient
from asyncrl.redis_server import free_port
from buffer_helpers import make_group

ROOT = Path(__file__).resolve().parents[1]
GROUPS = 24


class BufferProcess:
    def __init__(self, job_file: Path, redis_url: str, log: Path):
        self.port = free_port()
        self.args = [str(Path(sys.executable).parent / "asyncrl"), "serve", "buffer",
                     "--job-file", str(job_file), "--redis-url", redis_url,
                     "--grpc-port", str(self.port), "--metrics-port", "0"]
        self.log = log
        self.process = None

    def start(self) -> "BufferProcess":
        self.process = subprocess.Popen(self.args, stdout=self.log.open("a"), stderr=subprocess.STDOUT)
        return self

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=10)


async def wait_healthy(client, timeout=60):
    deadline = time.monotonic() + timeout
    while not await client.healthy():
        assert time.monotonic() < deadline, "buffer never became healthy"
        await asyncio.sleep(0.1)


@pytest.mark.slow
def test_nothing_acknowledged_is_lost_or_duplicated(redis_server, tmp_path):
    manifest = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    manifest["spec"]["algorithm"]["maxStaleness"] = 100  # the producer never waits for the trainer
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(manifest))
    group_size = manifest["spec"]["algorithm"]["groupSize"]
    batch_size = manifest["spec"]["algorithm"]["batchSize"]
    buffer = BufferProcess(job_file, redis_server.url, tmp_path / "buffer.log").start()

    async def scenario():
        client = BufferClient(f"127.0.0.1:{buffer.port}", "tiny", "producer")
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
