"""The one retry policy for Redis outages (asyncrl.platform.outage) against real sockets: a Redis that
is not there, and an address answered by something that is not Redis (as a Service's address
can be while its Redis pod is away), both count as Redis being down, are retried, and end in
OutageTooLong naming the address once the bound has passed."""

import asyncio
import socket
import threading

import pytest

from asyncrl.platform.outage import Outage, OutageTooLong, connect, redis_address, redis_down, retry
from support.ports import free_port


class HttpAnswerer:
    """A loopback listener that answers every connection like an HTTP proxy refusing it."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            with conn:
                conn.recv(4096)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    def close(self) -> None:
        self.sock.close()


async def ping_until_the_bound(url: str, bound: float) -> BaseException:
    client = connect(url)
    outage = Outage(f"Redis at {redis_address(url)}", bound)
    try:
        with pytest.raises(OutageTooLong) as raised:
            await retry(client.ping, outage)
    finally:
        await client.aclose()
    return raised.value


def test_a_non_redis_answer_is_an_outage_retried_until_the_bound():
    answerer = HttpAnswerer()
    try:
        error = asyncio.run(ping_until_the_bound(f"redis://127.0.0.1:{answerer.port}", 1.0))
    finally:
        answerer.close()
    assert f"Redis at 127.0.0.1:{answerer.port} has been unreachable" in str(error)
    # hiredis words it 'Protocol error, got "H" as reply type byte' (redis-py's own parser
    # quotes the answer: "Protocol Error: HTTP/1.1 400 Bad Request").
    assert "protocol error" in str(error).lower()
    assert answerer.connections >= 2  # retried, not given up at the first answer
    assert redis_down(error.__cause__)


def test_nothing_listening_is_an_outage_too():
    port = free_port()
    error = asyncio.run(ping_until_the_bound(f"redis://127.0.0.1:{port}", 0.5))
    assert f"127.0.0.1:{port}" in str(error)
    assert redis_down(error.__cause__)


def test_a_redis_error_reply_is_not_an_outage(redis_server):
    async def scenario():
        client = connect(redis_server.url)
        try:
            return await retry(lambda: client.execute_command("NO-SUCH-COMMAND"),
                               Outage("Redis", 60))
        finally:
            await client.aclose()

    with pytest.raises(Exception) as raised:
        asyncio.run(scenario())
    assert "unknown command" in str(raised.value).lower()
    assert not redis_down(raised.value)
