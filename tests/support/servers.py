"""Servers on loopback inside the test process, what the per-service support modules build on.

`LoopThread` is an asyncio event loop on a background thread: the grpc.aio servers tests keep
alive across several test functions run on one (support.buffer's BufferThread,
support.reward's RewardThread, support.trainer_status' TrainerStatusThread), and the `loop`
fixture (tests/conftest.py) drives async code from sync tests with one. `HttpServer` serves an
ASGI app with uvicorn on a loopback socket (the rollout worker's SGLang-compatible API)."""

from __future__ import annotations

import asyncio
import socket
import threading

import uvicorn

from support.waiting import wait_for


class LoopThread:
    """An event loop running on a daemon thread from construction until `stop`."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coroutine, timeout: float = 60.0):
        """Runs `coroutine` on the loop and returns its result (raises what it raises)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


class HttpServer:
    """Serves an ASGI app with uvicorn in a background thread on a loopback socket."""

    def __init__(self, app):
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )

    def __enter__(self) -> HttpServer:
        self._thread.start()
        wait_for(lambda: self._server.started, what="uvicorn to start")
        return self

    def __exit__(self, *_) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()
