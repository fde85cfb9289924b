"""The RolloutControl gRPC service over a real torch engine, on a real loopback server."""

from __future__ import annotations

import grpc
import pytest
from rollout_helpers import free_port, queued, tiny_engine, wait_for, write_snapshot

from asyncrl.rollout.grpc_control import RolloutControlServicer, serve_control
from asyncrl.rollout.metrics import RolloutMetrics
from asyncrl.rollout.types import SamplingParams, UnknownRequestError
from asyncrl.v1 import common_pb2, rollout_pb2, rollout_pb2_grpc


@pytest.fixture(scope="module")
def control():
    engine = tiny_engine()
    metrics = RolloutMetrics("test-job")
    port = free_port()
    server = serve_control(engine, port, metrics)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield rollout_pb2_grpc.RolloutControlStub(channel), engine, metrics
    channel.close()
    server.stop(grace=None)
    engine.stop()


@pytest.fixture
def stub(control):
    return control[0]


@pytest.fixture
def engine(control):
    return control[1]


def short(max_new_tokens: int = 3) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens)


def test_get_status_reports_the_engine(stub, engine):
    engine.submit([1, 2], short()).result(timeout=30)
    status = stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=10)
    assert status.version == engine.version
    assert not status.paused
    assert status.running_requests == 0 and status.waiting_requests == 0
    assert status.generated_tokens_total == engine.status().generated_tokens_total >= 3


def test_pause_holds_requests_until_resume(stub, engine):
    assert stub.Pause(rollout_pb2.PauseRequest(), timeout=10).paused
    try:
        future = engine.submit([3, 4], short())
        wait_for(lambda: queued(engine) == 1, what="the request to be queued")
        with pytest.raises(TimeoutError):
            future.result(timeout=0.3)
    finally:
        assert not stub.Resume(rollout_pb2.ResumeRequest(), timeout=10).paused
    assert len(future.result(timeout=30).output_ids) == 3


def test_update_weights_loads_a_snapshot(control, tmp_path):
    stub, engine, metrics = control
    successes = {"rljob": "test-job", "result": "success"}
    before = metrics.registry.get_sample_value("asyncrl_rollout_weight_updates_total", successes)
    version = engine.version + 1
    snapshot = write_snapshot(tmp_path / "model.safetensors", seed=1)
    response = stub.UpdateWeights(
        rollout_pb2.UpdateWeightsRequest(version=version, weights_uri=str(snapshot)), timeout=30
    )
    assert response.version == version and response.seconds > 0
    # A file:// URI to a directory holding model.safetensors works too.
    response = stub.UpdateWeights(
        rollout_pb2.UpdateWeightsRequest(version=version + 1, weights_uri=tmp_path.as_uri()),
        timeout=30,
    )
    assert response.version == version + 1
    assert stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=10).version == version + 1
    assert engine.submit([5], short()).result(timeout=30).output_versions == [version + 1] * 3
    after = metrics.registry.get_sample_value("asyncrl_rollout_weight_updates_total", successes)
    assert after == before + 2


@pytest.mark.parametrize(
    ("make_request", "named"),
    [
        pytest.param(lambda tmp, v: rollout_pb2.UpdateWeightsRequest(
            version=v - 1, weights_uri=str(write_snapshot(tmp / "old.safetensors", seed=2))),
            "version", id="older-version"),
        pytest.param(lambda tmp, v: rollout_pb2.UpdateWeightsRequest(
            version=v + 1, weights_uri=str(tmp / "missing.safetensors")),
            "snapshot", id="missing-file"),
        pytest.param(lambda tmp, v: rollout_pb2.UpdateWeightsRequest(
            version=v + 1, weights_uri=str(_corrupt(tmp))),
            "unreadable", id="corrupt-file"),
        pytest.param(lambda tmp, v: rollout_pb2.UpdateWeightsRequest(
            version=v + 1, weights_uri="https://example.invalid/model.safetensors"),
            "weights_uri", id="remote-uri"),
        pytest.param(lambda tmp, v: rollout_pb2.UpdateWeightsRequest(version=v + 1),
                     "weights_uri", id="no-uri"),
    ],
)
def test_invalid_update_is_invalid_argument_and_keeps_serving(
    stub, engine, tmp_path, make_request, named
):
    version = engine.version
    with pytest.raises(grpc.RpcError) as raised:
        stub.UpdateWeights(make_request(tmp_path, version), timeout=30)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in raised.value.details()
    assert engine.version == version
    assert engine.submit([6], short()).result(timeout=30).output_versions == [version] * 3


def _corrupt(tmp_path):
    path = tmp_path / "corrupt.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    return path


def test_abort_all_ends_every_request(stub, engine):
    stub.Pause(rollout_pb2.PauseRequest(), timeout=10)
    try:
        futures = [engine.submit([7], short(), request_id=f"grpc-{i}") for i in range(2)]
        response = stub.Abort(rollout_pb2.AbortRequest(all=True), timeout=10)
        assert sorted(response.aborted_ids) == ["grpc-0", "grpc-1"]
        assert [f.result(timeout=10).finish_reason for f in futures] == ["abort", "abort"]
        with pytest.raises(grpc.RpcError) as raised:
            stub.Abort(rollout_pb2.AbortRequest(), timeout=10)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        stub.Resume(rollout_pb2.ResumeRequest(), timeout=10)


def test_health(stub):
    response = stub.Health(common_pb2.HealthRequest(), timeout=10)
    assert response.serving


class _UnknownStatus(RolloutControlServicer):
    def GetStatus(self, request, context):
        raise UnknownRequestError("request 'gone' is not known")


def test_unknown_request_error_maps_to_not_found(engine, monkeypatch):
    # The error mapping lives in serve_control's interceptor, whatever the servicer raises.
    import asyncrl.rollout.grpc_control as grpc_control

    monkeypatch.setattr(grpc_control, "RolloutControlServicer", _UnknownStatus)
    port = free_port()
    server = grpc_control.serve_control(engine, port)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.RpcError) as raised:
                rollout_pb2_grpc.RolloutControlStub(channel).GetStatus(
                    rollout_pb2.GetStatusRequest(), timeout=10
                )
        assert raised.value.code() == grpc.StatusCode.NOT_FOUND
        assert raised.value.details() == "request 'gone' is not known"
    finally:
        server.stop(grace=None)
