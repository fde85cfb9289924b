"""A real buffer gRPC server (grpc.aio) on a loopback port, in a background thread with its own
event loop, over a real redis-server; plus builders for well-formed groups."""

from __future__ import annotations

import asyncio
import threading

import redis.asyncio as redis

from asyncrl.buffer.metrics import BufferMetrics
from asyncrl.buffer.server import create_server
from asyncrl.buffer.store import BufferStore, JobConfig
from asyncrl.redis_server import free_port
from asyncrl.v1 import common_pb2


class BufferThread:
    def __init__(self, redis_url: str, jobs: list[JobConfig]):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._redis_url = redis_url
        self._jobs = jobs
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def start(self) -> BufferThread:
        self._thread.start()
        self._run(self._start())
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

        self._run(stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=30)


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
