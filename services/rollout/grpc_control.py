"""The rollout worker's gRPC status API (asyncrl.v1.RolloutControl): GetStatus of its engine,
torch or SGLang alike, and the standard health service (serving while the engine serves and
the worker's dependencies answer, as the HTTP /ready). Control operations are on the HTTP API
SGLang clients speak (see asyncrl.rollout.http_api)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc

from asyncrl.platform.grpc_health import add_health_to_thread_server
from asyncrl.engine.api import InferenceEngine
from asyncrl.engine.types import EngineStatus
from asyncrl.v1 import rollout_pb2, rollout_pb2_grpc


def status_to_pb(status: EngineStatus) -> rollout_pb2.RolloutStatus:
    return rollout_pb2.RolloutStatus(
        version=status.version,
        paused=status.paused,
        running_requests=status.running_requests,
        waiting_requests=status.waiting_requests,
        generated_tokens_total=status.generated_tokens_total,
        interrupted_requests_total=status.interrupted_requests_total,
        decode_steps_total=status.decode_steps_total,
        decode_rows_total=status.decode_rows_total,
        busy_seconds_total=status.busy_seconds_total,
        weight_swap_seconds_total=status.weight_swap_seconds_total,
        resume_prefill_seconds_total=status.resume_prefill_seconds_total,
    )


class RolloutControlServicer(rollout_pb2_grpc.RolloutControlServicer):
    def __init__(self, engine: InferenceEngine):
        self._engine = engine

    def GetStatus(self, request, context):
        return status_to_pb(self._engine.status())


def serve_control(
    engine: InferenceEngine, port: int, *, host: str = "127.0.0.1", max_workers: int = 2,
    ready: Callable[[], bool] = lambda: True,
) -> grpc.Server:
    """Starts the RolloutControl server on host:port and returns it (stop it with .stop()).
    `ready` tells whether the worker's dependencies answer (Redis)."""
    server = grpc.server(
        ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rollout-control")
    )
    rollout_pb2_grpc.add_RolloutControlServicer_to_server(RolloutControlServicer(engine), server)
    add_health_to_thread_server(server, lambda: engine.alive and ready())
    address = f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"rollout control: cannot listen on {address}: {exc}") from exc
    if bound == 0:
        raise OSError(f"rollout control: cannot listen on {address}")
    server.start()
    return server
