"""`asyncrl serve rollout` as a real process: HTTP generation, gRPC control, and weight
versions announced in Redis."""

import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_model

from asyncrl.models import load_model
from asyncrl.redis_server import free_port
from asyncrl.v1 import rollout_pb2, rollout_pb2_grpc
from asyncrl.weights import WeightVersion, weights_channel, weights_key

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def rollout_process(redis_server, tmp_path):
    http_port, grpc_port = free_port(), free_port()
    log = open(tmp_path / "rollout.log", "w")
    process = subprocess.Popen(
        [str(Path(sys.executable).parent / "asyncrl"), "serve", "rollout",
         "--job-file", str(ROOT / "examples/tiny.yaml"), "--http-port", str(http_port),
         "--grpc-port", str(grpc_port), "--redis-url", redis_server.url, "--threads", "1"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, (tmp_path / "rollout.log").read_text()[-3000:]
        assert time.monotonic() < deadline, "rollout service did not become healthy"
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    yield base, grpc_port
    process.terminate()
    # SIGTERM stops a service as Ctrl-C does (130); the limit only catches a hang.
    assert process.wait(timeout=120) == 130, (tmp_path / "rollout.log").read_text()[-3000:]


@pytest.mark.slow
def test_rollout_service_generates_and_follows_announced_versions(rollout_process, redis_server, tmp_path):
    base, grpc_port = rollout_process
    reply = httpx.post(f"{base}/generate", json={
        "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True,
    }, timeout=30).json()
    assert len(reply["output_ids"]) == 4 and len(reply["meta_info"]["output_token_logprobs"]) == 4

    # The trainer announces version 1: the worker loads it without being called.
    snapshot = tmp_path / "v1" / "model.safetensors"
    snapshot.parent.mkdir()
    save_model(load_model("tiny-random"), str(snapshot))
    client = redis.from_url(redis_server.url)
    client.hset(weights_key("tiny"), mapping=WeightVersion(1, str(snapshot.parent), 1).to_hash())
    client.publish(weights_channel("tiny"), "1")
    deadline = time.monotonic() + 30
    while httpx.get(f"{base}/get_model_info").json()["weight_version"] != "1":
        assert time.monotonic() < deadline, "announced version never applied"
        time.sleep(0.1)

    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stub = rollout_pb2_grpc.RolloutControlStub(channel)
        status = stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=10)
        assert status.version == 1 and status.generated_tokens_total >= 4
        assert httpx.post(f"{base}/pause_generation", json={"mode": "in_place"}).status_code == 200
        assert stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=10).paused
        assert httpx.post(f"{base}/continue_generation", json={}).status_code == 200
        assert not stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=10).paused
    metrics = httpx.get(f"{base}/metrics").text
    values = {(s.name, s.labels.get("result")): s
              for family in text_string_to_metric_families(metrics) for s in family.samples}
    assert values[("asyncrl_rollout_policy_version", None)].value == 1
    assert values[("asyncrl_rollout_policy_version", None)].labels["rljob"] == "tiny"
    # An update applied by the weights watcher is counted and timed like one asked for.
    assert values[("asyncrl_rollout_weight_updates_total", "success")].value == 1
    assert values[("asyncrl_rollout_weight_update_seconds_count", None)].value == 1


def test_bad_settings_exit_with_a_clear_message(tmp_path):
    result = subprocess.run(
        [str(Path(sys.executable).parent / "asyncrl"), "serve", "rollout",
         "--job-file", str(tmp_path / "missing.yaml")],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "job file" in result.stderr and "Traceback" not in result.stderr
