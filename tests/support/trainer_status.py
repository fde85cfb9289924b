"""A real trainer status server (the trainer's own StatusServicer over grpc.aio) on a loopback
port, on its own event loop: what the operator reads the trainer's figures from, without a
model or a training loop behind it."""

from __future__ import annotations

import grpc

from asyncrl.trainer.service import Status, StatusServicer
from asyncrl.v1 import trainer_pb2_grpc
from support.ports import free_port
from support.servers import LoopThread


class TrainerStatusThread(LoopThread):
    """Serves `status` (the trainer's figures, changed in place by the test) while entered."""

    def __init__(self, status: Status):
        super().__init__()
        self.status = status
        self.address = f"127.0.0.1:{free_port()}"

    def __enter__(self) -> TrainerStatusThread:
        self.run(self._start(), timeout=30)
        return self

    def __exit__(self, *_) -> None:
        self.run(self.server.stop(grace=0), timeout=30)
        self.stop()

    async def _start(self) -> None:
        self.server = grpc.aio.server()
        trainer_pb2_grpc.add_TrainerStatusServiceServicer_to_server(
            StatusServicer(self.status), self.server)
        if self.server.add_insecure_port(self.address) == 0:
            raise OSError(f"cannot listen on {self.address}")
        await self.server.start()
