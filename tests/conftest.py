import pytest

from asyncrl.redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server with AOF on a free loopback port, private to one test."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.kill()


@pytest.fixture(scope="session")
def control_plane(tmp_path_factory):
    """A real Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager,
    kube-scheduler, kwok with CPU and GPU fake nodes) for the whole session.

    Fails, never skips, when the binaries are not built: the message names the build command.
    """
    from cluster.control_plane import ControlPlane, ControlPlaneMissing

    plane = ControlPlane(tmp_path_factory.mktemp("k8s"))
    missing = None
    try:
        plane.start()
    except ControlPlaneMissing as exc:
        missing = str(exc)
    if missing:
        pytest.fail(missing, pytrace=False)
    yield plane
    plane.stop()
