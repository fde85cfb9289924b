"""How asyncrl's asyncio gRPC servers and channels are made, in one place: message size
limits, a listening address that fails with a clear error, and the standard health service
(asyncrl.platform.grpc_health) on every server."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc

from asyncrl.platform.grpc_health import add_health

MiB = 1 << 20
#: gRPC's default 4 MiB is too small for a group of long sequences or many scored groups.
DEFAULT_MESSAGE_BYTES = 64 * MiB


def message_limits(receive: int = DEFAULT_MESSAGE_BYTES,
                   send: int = DEFAULT_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", receive), ("grpc.max_send_message_length", send)]


async def start_server(name: str, address: str, add_servicers: Callable[[grpc.aio.Server], None],
                       can_work: Callable[[], Awaitable[bool]], *,
                       receive: int = DEFAULT_MESSAGE_BYTES,
                       send: int = DEFAULT_MESSAGE_BYTES) -> grpc.aio.Server:
    """A started server on `address` (host:port) with the servicers `add_servicers` adds and
    grpc.health.v1 answering from `can_work`; OSError naming `name` when it cannot listen."""
    server = grpc.aio.server(options=message_limits(receive, send))
    add_servicers(server)
    await add_health(server, can_work)
    if server.add_insecure_port(address) == 0:
        raise OSError(f"{name}: cannot listen on {address}")
    await server.start()
    return server


def channel(address: str, *, receive: int = DEFAULT_MESSAGE_BYTES,
            send: int = DEFAULT_MESSAGE_BYTES) -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(address, options=message_limits(receive, send))
