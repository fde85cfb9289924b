"""The RolloutControl gRPC status API over a real torch engine, on a real loopback server."""

from __future__ import annotations

import grpc
import pytest

from asyncrl.platform.grpc_health import is_serving_at
from asyncrl.engine.api import TorchInferenceEngine
from asyncrl.rollout.grpc_control import serve_control
from asyncrl.engine.types import SamplingParams
from asyncrl.v1 import rollout_pb2, rollout_pb2_grpc
from support.ports import free_port
from support.rollout import tiny_engine


@pytest.fixture
def served():
    engine = tiny_engine()
    port = free_port()
    server = serve_control(TorchInferenceEngine(engine), port)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield rollout_pb2_grpc.RolloutControlStub(channel), engine
    channel.close()
    server.stop(grace=None)
    engine.stop()


def test_get_status_reports_the_engine(served):
    stub, engine = served
    engine.submit([1, 2], SamplingParams(max_new_tokens=3)).result(timeout=30)
    status = stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=10)
    assert status.version == engine.version
    assert not status.paused
    assert status.running_requests == 0 and status.waiting_requests == 0
    assert status.generated_tokens_total == engine.status().generated_tokens_total >= 3
    assert status.decode_steps_total >= 2


def test_health_follows_the_engine_and_the_workers_dependencies():
    engine = tiny_engine()
    port = free_port()
    redis_up = True
    server = serve_control(TorchInferenceEngine(engine), port, ready=lambda: redis_up)
    address = f"127.0.0.1:{port}"
    try:
        assert is_serving_at(address)
        redis_up = False  # unready while Redis (which announces the weights) is away
        assert not is_serving_at(address)
        redis_up = True
        assert is_serving_at(address)
        engine.stop()  # the decode thread is gone: the worker no longer serves
        assert not is_serving_at(address)
    finally:
        server.stop(grace=None)
        engine.stop()
