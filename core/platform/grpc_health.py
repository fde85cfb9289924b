"""The standard gRPC health service (`grpc.health.v1`, from grpcio-health-checking): every asyncrl
gRPC server serves it, and clients, the local runner and the kubelet's native gRPC probes ask it.

Two names are served:
- "" (what a probe or client asks by default): the service's own check, run at each Check. The
  buffer without Redis, or a code job's reward service without its sandbox, is NOT_SERVING, so
  its pod leaves its Service's endpoints (the readiness probe asks this).
- LIVENESS: SERVING whenever the process answers at all. Liveness and start-up probes ask this,
  so that an outage of a dependency makes a pod unready without restarting it.
A Watch of "" sees the status found by the latest Check.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

LIVENESS = "liveness"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class _CheckedServicer(health.aio.HealthServicer):
    def __init__(self, check: Callable[[], Awaitable[bool]]):
        super().__init__()
        self._check = check

    async def Check(self, request, context):
        if request.service == "":
            await self.set("", SERVING if await self._check() else NOT_SERVING)
        return await super().Check(request, context)


class _CheckedThreadServicer(health.HealthServicer):
    def __init__(self, check: Callable[[], bool]):
        super().__init__()
        self._check = check

    def Check(self, request, context):
        if request.service == "":
            self.set("", SERVING if self._check() else NOT_SERVING)
        return super().Check(request, context)


async def add_health(server: grpc.aio.Server, check: Callable[[], Awaitable[bool]]) -> None:
    """Serves grpc.health.v1 on an asyncio server; `check` says whether the service can work."""
    servicer = _CheckedServicer(check)
    await servicer.set(LIVENESS, SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)


def add_health_to_thread_server(server: grpc.Server, check: Callable[[], bool]) -> None:
    """The same for a thread-pool server."""
    servicer = _CheckedThreadServicer(check)
    servicer.set(LIVENESS, SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)


async def is_serving(channel: grpc.aio.Channel, timeout: float = 2.0) -> bool:
    """Whether the server behind `channel` says it can work (False when it does not answer)."""
    try:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.aio.AioRpcError:
        return False
    return reply.status == SERVING


def is_serving_at(address: str, timeout: float = 2.0) -> bool:
    """`is_serving` for a blocking caller, over a channel of its own."""
    try:
        with grpc.insecure_channel(address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout)
    except grpc.RpcError:
        return False
    return reply.status == SERVING
