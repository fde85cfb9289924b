"""The rollout worker's gRPC control plane (asyncrl.v1.RolloutControl).

The servicer only translates between protobuf messages and engine calls; one interceptor
maps the engine's errors to status codes (RequestError -> INVALID_ARGUMENT,
UnknownRequestError -> NOT_FOUND), so no handler deals with errors itself.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import unquote, urlparse

import grpc

from asyncrl.rollout.metrics import RolloutMetrics
from asyncrl.rollout.types import EngineStatus, RequestError, UnknownRequestError
from asyncrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc


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


def weights_path(uri: str) -> Path:
    """A local path from `weights_uri`: a plain path or a file:// URI."""
    if not uri:
        raise RequestError("weights_uri is empty; give a safetensors file or directory path")
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return Path(unquote(parsed.path) if parsed.scheme == "file" else uri)
    raise RequestError(
        f"weights_uri {uri!r}: scheme {parsed.scheme!r} is not supported; "
        "give a local path or a file:// URI"
    )


class RolloutControlServicer(rollout_pb2_grpc.RolloutControlServicer):
    def __init__(self, engine, metrics: RolloutMetrics | None = None):
        self._engine = engine
        self._metrics = metrics

    def Pause(self, request, context):
        self._engine.pause()
        return status_to_pb(self._engine.status())

    def Resume(self, request, context):
        self._engine.resume()
        return status_to_pb(self._engine.status())

    def UpdateWeights(self, request, context):
        try:
            update = self._engine.update_weights(weights_path(request.weights_uri),
                                                 request.version)
        except RequestError:
            if self._metrics is not None:
                self._metrics.observe_weight_update_failure()
            raise
        if self._metrics is not None:
            self._metrics.observe_weight_update(update)
        return rollout_pb2.UpdateWeightsResponse(
            version=update.version,
            interrupted_requests=update.interrupted_requests,
            seconds=update.seconds,
        )

    def Abort(self, request, context):
        if not request.all and not request.request_ids:
            raise RequestError("Abort needs request_ids or all=true")
        aborted = self._engine.abort(None if request.all else list(request.request_ids))
        return rollout_pb2.AbortResponse(aborted_ids=aborted)

    def GetStatus(self, request, context):
        return status_to_pb(self._engine.status())

    def Health(self, request, context):
        alive = self._engine.alive
        return common_pb2.HealthResponse(
            serving=alive,
            detail=f"policy version {self._engine.version}" if alive
            else "the engine's decode thread is not running",
        )


class ErrorStatusInterceptor(grpc.ServerInterceptor):
    """Maps the engine's exceptions to gRPC status codes, for every unary-unary method."""

    CODES = (
        (RequestError, grpc.StatusCode.INVALID_ARGUMENT),
        (UnknownRequestError, grpc.StatusCode.NOT_FOUND),
    )

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        behavior = handler.unary_unary

        def mapped(request, context):
            try:
                return behavior(request, context)
            except (RequestError, UnknownRequestError) as exc:
                code = next(c for kind, c in self.CODES if isinstance(exc, kind))
                context.abort(code, exc.args[0] if exc.args else type(exc).__name__)

        return grpc.unary_unary_rpc_method_handler(
            mapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def serve_control(
    engine,
    port: int,
    metrics: RolloutMetrics | None = None,
    *,
    host: str = "127.0.0.1",
    max_workers: int = 4,
) -> grpc.Server:
    """Starts the RolloutControl server on host:port and returns it (stop it with .stop())."""
    server = grpc.server(
        ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="rollout-control"),
        interceptors=[ErrorStatusInterceptor()],
    )
    rollout_pb2_grpc.add_RolloutControlServicer_to_server(
        RolloutControlServicer(engine, metrics), server
    )
    address = f"{host}:{port}"
    try:
        bound = server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"rollout control: cannot listen on {address}: {exc}") from exc
    if bound == 0:
        raise OSError(f"rollout control: cannot listen on {address}")
    server.start()
    return server
