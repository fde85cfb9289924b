import random

import pytest
import torch

from asyncrl.platform.redis_server import RedisServer
from support.servers import LoopThread


@pytest.fixture(autouse=True)
def seeded_randomness():
    """Every test starts from the same global random state, whatever ran before it: a test
    that draws inputs without its own generator gets the same inputs in every run."""
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def loop():
    """An event loop on its own thread, for tests that drive async code from sync tests."""
    thread = LoopThread()
    yield thread
    thread.stop()


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

    plane = _started(ControlPlane(tmp_path_factory.mktemp("k8s")), ControlPlaneMissing)
    yield plane
    plane.stop()


@pytest.fixture(scope="session")
def real_node(tmp_path_factory):
    """A real one-node cluster for the whole session (tests/cluster/node.py): the control plane,
    containerd, kubelet, kube-proxy and CoreDNS on this machine, pods as real containers. Yields
    a RealCluster: `kubeconfig`, `api_client()`, `kubectl(*args)`, `import_image(tar)`.

    Fails, never skips, when packages, binaries or the base image are missing: the message
    names the command that installs and builds them.
    """
    from cluster.node import NodeMissing, RealCluster

    cluster = _started(RealCluster(tmp_path_factory.mktemp("real-node")), NodeMissing)
    yield cluster
    cluster.stop()


def _started(cluster, missing_error: type[Exception]):
    """`cluster` started; if what it needs is missing (`missing_error`), the test fails with
    the message, which names the command that provides it."""
    missing = None
    try:
        cluster.start()
    except missing_error as exc:
        missing = str(exc)
    if missing:
        pytest.fail(missing, pytrace=False)
    return cluster


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: it reads the marker added here
def pytest_collection_modifyitems(config, items):
    """Every test that uses the kwok control plane is marked `control_plane`, so scripts/test.sh
    runs the other slow tests while the control plane is still being built, and these after.
    Real-node tests run in their own pass (`-m real_node`) or when their file is named on the
    command line, never inside another pass: they take the machine's one real node."""
    for item in items:
        if "control_plane" in item.fixturenames:
            item.add_marker(pytest.mark.control_plane)
    if "real_node" in (config.option.markexpr or "") or \
            any("test_real_node" in arg for arg in config.args):
        return
    deselected = [item for item in items if item.get_closest_marker("real_node")]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if not item.get_closest_marker("real_node")]
