import pytest

from asyncrl.redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server with AOF on a free loopback port, private to one test."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.kill()
