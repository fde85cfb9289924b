"""The buffer service for tests: a real buffer gRPC server (grpc.aio) on a loopback port, on
its own event loop, over a real redis-server, or `asyncrl serve buffer` as a process; its stub
fixture; builders for well-formed groups; and the fate of every group of a finished run, read
from Redis' append-only file."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import redis as sync_redis
import redis.asyncio as redis

from asyncrl.buffer.metrics import BufferMetrics
from asyncrl.buffer.server import create_server
from asyncrl.buffer.store import BufferStore, JobConfig
from asyncrl.platform.redis_keys import key
from asyncrl.platform.redis_server import RedisServer
from asyncrl.v1 import buffer_pb2_grpc, common_pb2
from support.ports import free_port
from support.servers import LoopThread


class BufferThread(LoopThread):
    """The buffer service for `jobs` over the Redis at `redis_url`, on a free loopback port."""

    def __init__(self, redis_url: str, jobs: list[JobConfig]):
        super().__init__()
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._redis_url = redis_url
        self._jobs = jobs

    def start(self) -> BufferThread:
        self.run(self._start(), timeout=30)
        return self

    async def _start(self) -> None:
        self.client = redis.from_url(self._redis_url)
        self.store = BufferStore(self.client, self._jobs)
        await self.store.register()
        self.server = await create_server(self.store, self.client, BufferMetrics(), self.address)

    def stop(self) -> None:
        async def stop():
            await self.server.stop(grace=0)
            await self.client.aclose()

        self.run(stop(), timeout=30)
        super().stop()


class BufferProcess:
    """`asyncrl serve buffer` as its own process, on a free port, logging to `log`."""

    def __init__(self, job_file: Path, redis_url: str, log: Path, env: dict | None = None):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.args = [str(Path(sys.executable).parent / "asyncrl"), "serve", "buffer",
                     "--job-file", str(job_file), "--redis-url", redis_url,
                     "--grpc-port", str(self.port), "--metrics-port", "0"]
        self.log = log
        self.env = env  # None: this process' environment
        self.process: subprocess.Popen | None = None

    def start(self) -> BufferProcess:
        with self.log.open("a") as log:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT,
                                            env=self.env)
        return self

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


async def wait_healthy(client, timeout: float = 60) -> None:
    """Until the buffer answers Health with serving (a deadline that only catches a hang)."""
    deadline = time.monotonic() + timeout
    while not await client.healthy():
        assert time.monotonic() < deadline, "buffer never became healthy"
        await asyncio.sleep(0.1)


def make_group(group_id: str, size: int, version: int = 0, tokens: int = 4) -> common_pb2.Group:
    samples = [
        common_pb2.Trajectory(
            prompt_ids=[1, 2, 3], response_ids=list(range(10, 10 + tokens)),
            behaviour_logprobs=[-0.5] * tokens, token_versions=[version] * tokens,
            reward=float(i % 2), finish_reason="length",
        )
        for i in range(size)
    ]
    return common_pb2.Group(group_id=group_id, prompt_id=group_id.split("#")[0], samples=samples)


# ---------------------------------------------------------------- what Redis really did
#
# The append-only file holds every write Redis performed, a script's writes as one MULTI/EXEC
# with XADD's generated stream ids spelled out. Read back, it tells which groups were accepted
# (XADD to the stream), which were trained on (deleted by an AckBatch, the transaction that
# marks its batch acked) and which were dropped as stale (deleted without one), by group id:
# a record that does not rely on the buffer's own counters.


@dataclass
class GroupFates:
    accepted: list[str] = field(default_factory=list)   # group ids, in the order accepted
    trained: list[str] = field(default_factory=list)    # in acknowledged batches
    dropped: list[str] = field(default_factory=list)    # dropped as too stale
    waiting: list[str] = field(default_factory=list)    # still in the stream at the end
    #: The prompt cursor of each accepted group, in the order accepted.
    cursors: list[int] = field(default_factory=list)
    #: At the end: the next new cursor, and the cursors that granted slots still hold or
    #: that wait to be handed out again (a lost or released slot's).
    next_cursor: int = 0
    held: list[int] = field(default_factory=list)
    to_reissue: list[int] = field(default_factory=list)

    def assert_each_prompt_used_once(self) -> None:
        """The prompt cursor's guarantee, from Redis' own record: no cursor accepted twice,
        and every cursor handed out so far accepted, still held by a slot, or waiting to be
        handed out again: none lost (with algorithm.skipUniformGroups off, as in the tiny
        job, every used prompt is an accepted group)."""
        assert len(self.cursors) == len(set(self.cursors)), sorted(self.cursors)
        pending = self.held + self.to_reissue
        assert not set(pending) & set(self.cursors), (pending, sorted(self.cursors))
        assert sorted(self.cursors + pending) == list(range(self.next_cursor)), (
            f"cursors below {self.next_cursor} neither accepted ({len(self.cursors)}) nor "
            f"pending {sorted(pending)}: "
            f"{sorted(set(range(self.next_cursor)) - set(self.cursors) - set(pending))}")
        assert sorted(self.trained + self.dropped + self.waiting) == sorted(self.accepted)


def aof_commands(redis_dir: Path) -> list[list[bytes]]:
    """Every command in the AOF of a stopped redis-server (Redis 7's multi-part AOF), which
    must never have been rewritten (a rewrite folds the history into a snapshot)."""
    aof_dir = Path(redis_dir) / "appendonlydir"
    files = [line.split() for line in (aof_dir / "appendonly.aof.manifest").read_text()
             .splitlines() if line.strip()]
    kinds = {entry[5]: entry for entry in files}   # file <name> seq <n> type <b|i|h>
    assert len(files) == 2 and kinds["b"][3] == "1" and "i" in kinds, (
        f"Redis rewrote its AOF, so it no longer holds every command: {files}")
    data = (aof_dir / kinds["i"][1]).read_bytes()
    commands, pos = [], 0
    while pos < len(data):
        end = data.index(b"\r\n", pos)
        if data[pos:pos + 1] == b"#":               # an annotation (e.g. #TS:)
            pos = end + 2
            continue
        assert data[pos:pos + 1] == b"*", data[pos:pos + 40]
        count, pos = int(data[pos + 1:end]), end + 2
        args = []
        for _ in range(count):
            end = data.index(b"\r\n", pos)
            size, pos = int(data[pos + 1:end]), end + 2
            args.append(data[pos:pos + size])
            pos += size + 2
        commands.append(args)
    return commands


def transactions(commands: list[list[bytes]]):
    """The commands in the units Redis applied them: MULTI ... EXEC, or one command."""
    group = None
    for command in commands:
        name = command[0].upper()
        if name == b"MULTI":
            group = []
        elif name == b"EXEC":
            yield group
            group = None
        elif group is not None:
            group.append(command)
        else:
            yield [command]


def group_fates(redis_dir: Path, job: str) -> GroupFates:
    """The fate of every group of `job`, from the AOF of the job's stopped redis-server; the
    groups still waiting are read from that Redis started again on its own files."""
    stream = key(job, "groups").encode()
    acked = key(job, "acked:").encode()
    fates, group_of = GroupFates(), {}
    for applied in transactions(aof_commands(redis_dir)):
        is_ack = any(c[0].upper() == b"SET" and c[1].startswith(acked) for c in applied)
        for command in applied:
            name, target, args = command[0].upper(), command[1:2], command[2:]
            if name == b"XADD" and target == [stream]:   # XADD <key> <id> <field> <value> ...
                fields = dict(zip(args[1::2], args[2::2]))
                group_of[args[0]] = fields[b"id"].decode()
                fates.accepted.append(group_of[args[0]])
                if fields.get(b"c"):  # '' only from a buffer before prompt cursors
                    fates.cursors.append(int(fields[b"c"]))
            elif name == b"XDEL" and target == [stream]:
                (fates.trained if is_ack else fates.dropped).extend(group_of[s] for s in args)
    with RedisServer(redis_dir) as replay:
        client = sync_redis.Redis(port=replay.port)
        try:
            fates.waiting = [fields[b"id"].decode() for _, fields in client.xrange(stream)]
            fates.next_cursor = int(client.hget(key(job, "state"), "cursor") or 0)
            fates.held = [int(c) for c in client.hvals(key(job, "cursors"))]
            fates.to_reissue = [int(c) for c in client.lrange(key(job, "reissue"), 0, -1)]
        finally:
            client.close()
    return fates


@pytest.fixture(name="stub")
def buffer_stub(buffer):
    """A Buffer stub on a channel to the test module's `buffer` (a BufferThread) fixture;
    a module that imports this gets it as `stub`."""
    with grpc.insecure_channel(buffer.address) as channel:
        yield buffer_pb2_grpc.BufferStub(channel)
