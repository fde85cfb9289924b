"""free_port: the ports the local runner and the tests hand to servers that bind them later."""

from __future__ import annotations

import socket

from asyncrl.platform import redis_server
from asyncrl.platform.redis_server import PORT_RANGE, free_port


def test_ports_are_distinct_bindable_and_outside_the_ephemeral_range():
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    ephemeral_low = redis_server._ephemeral_low()
    assert all(PORT_RANGE[0] <= port < min(PORT_RANGE[1], ephemeral_low) for port in ports)
    with socket.socket() as sock:  # what a server does with it
        sock.bind(("0.0.0.0", ports[-1]))
        sock.listen()


def test_a_port_something_listens_on_is_not_bindable():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))
        sock.listen()
        assert not redis_server._bindable(sock.getsockname()[1])


def test_a_machine_whose_ephemeral_range_starts_low_gets_the_kernels_pick(monkeypatch):
    monkeypatch.setattr(redis_server, "_ephemeral_low", lambda: 1024)
    port = free_port()
    assert port >= 1024
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
