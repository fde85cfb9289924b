"""An asyncio loop in a background thread, so tests can keep real worker pools, sandboxes and a
real reward gRPC server (grpc.aio on a loopback port) alive across several test functions."""

from __future__ import annotations

import asyncio
import threading

from asyncrl.redis_server import free_port
from asyncrl.reward.metrics import RewardMetrics
from asyncrl.reward.scorer import RewardScorer
from asyncrl.reward.server import create_server


class LoopThread:
    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


class RewardThread(LoopThread):
    """A reward service for `reward_spec` (asyncrl.spec.RewardSpec) on a free loopback port."""

    def __init__(self, reward_spec, job: str = "test-job", workers: int = 2, **sandbox_options):
        super().__init__()
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.job = job
        self.metrics = RewardMetrics(job)
        self.scorer = RewardScorer.from_spec(reward_spec, workers=workers, metrics=self.metrics,
                                             **sandbox_options)
        self._kind = reward_spec.kind

    def start(self) -> RewardThread:
        async def start():
            await self.scorer.start(["math", "code"])
            self.server = await create_server(self.scorer, self.job, self._kind, self.address)

        self.run(start(), timeout=180)
        return self

    def close(self) -> None:
        async def close():
            await self.server.stop(grace=0)
            await self.scorer.close()

        self.run(close())
        self.stop()
