"""A real trainer status server (the trainer's own StatusServicer over grpc.aio) on a loopback
port, in a background thread with its own event loop: what the operator reads the trainer's
figures from, without a model or a training loop behind it."""

from __future__ import annotations

import asyncio
import threading

import grpc

from asyncrl.platform.redis_server import free_port
from asyncrl.trainer.service import Status, StatusServicer
from asyncrl.v1 import trainer_pb2_grpc


class TrainerStatusThread:
    def __init__(self, status: Status):
        self.status = status
        self.address = f"127.0.0.1:{free_port()}"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __enter__(self) -> TrainerStatusThread:
        self._thread.start()
        self._run(self._start())
        return self

    def __exit__(self, *_) -> None:
        self._run(self.server.stop(grace=0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _start(self) -> None:
        self.server = grpc.aio.server()
        trainer_pb2_grpc.add_TrainerStatusServiceServicer_to_server(
            StatusServicer(self.status), self.server)
        if self.server.add_insecure_port(self.address) == 0:
            raise OSError(f"cannot listen on {self.address}")
        await self.server.start()

    def _run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout=30)
