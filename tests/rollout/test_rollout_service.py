"""`asyncrl serve rollout` as a real process: HTTP generation, gRPC control, and weight
versions announced in Redis."""

import os
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
import redis
import yaml
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_model

from asyncrl.model.policy import load_model
from asyncrl.v1 import rollout_pb2, rollout_pb2_grpc
from asyncrl.weights.announcements import WeightVersion, weights_channel, weights_key
from support import ROOT
from support.ports import free_port
from support.waiting import wait_for_status


def start_rollout(redis_url: str, log: Path, env: dict | None = None,
                  job_file: Path = ROOT / "examples/tiny.yaml"):
    """`asyncrl serve rollout` of the tiny job (or `job_file`), once its /health answers 200:
    (process, base URL, gRPC port)."""
    http_port, grpc_port = free_port(), free_port()
    with log.open("w") as out:
        process = subprocess.Popen(
            [str(Path(sys.executable).parent / "asyncrl"), "serve", "rollout",
             "--job-file", str(job_file), "--http-port", str(http_port),
             "--grpc-port", str(grpc_port), "--redis-url", redis_url, "--threads", "1"],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )
    base = f"http://127.0.0.1:{http_port}"
    wait_for_status(process, log, f"{base}/health", 200)
    return process, base, grpc_port


def generate_four_tokens(base: str) -> dict:
    """The worker's reply to a greedy /generate of 4 tokens, with log-probs."""
    return httpx.post(f"{base}/generate", json={
        "input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_logprob": True,
    }, timeout=30).json()


def announce_version_1(redis_url: str, base: str, tmp_path: Path, log: Path | None = None):
    """Announces a float32 snapshot of the tiny model as version 1, as the trainer does, and
    waits until the worker serves it."""
    snapshot = tmp_path / "v1" / "model.safetensors"
    snapshot.parent.mkdir()
    save_model(load_model("tiny-random"), str(snapshot))
    client = redis.from_url(redis_url)
    client.hset(weights_key("tiny"), mapping=WeightVersion(1, str(snapshot.parent), 1).to_hash())
    client.publish(weights_channel("tiny"), "1")
    deadline = time.monotonic() + 30
    while httpx.get(f"{base}/get_model_info").json()["weight_version"] != "1":
        assert time.monotonic() < deadline, "announced version never applied" + (
            ":\n" + log.read_text()[-2000:] if log else "")
        time.sleep(0.1)


@pytest.fixture
def rollout_process(redis_server, tmp_path):
    log = tmp_path / "rollout.log"
    process, base, grpc_port = start_rollout(redis_server.url, log)
    yield base, grpc_port
    process.terminate()
    # SIGTERM stops a service as Ctrl-C does (130); the limit only catches a hang.
    assert process.wait(timeout=120) == 130, log.read_text()[-3000:]


@pytest.mark.slow
def test_rollout_service_generates_and_follows_announced_versions(rollout_process, redis_server, tmp_path):
    base, grpc_port = rollout_process
    reply = generate_four_tokens(base)
    assert len(reply["output_ids"]) == 4 and len(reply["meta_info"]["output_token_logprobs"]) == 4

    # The trainer announces version 1: the worker loads it without being called.
    announce_version_1(redis_server.url, base, tmp_path)

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


def test_a_bf16_engine_generates_and_takes_float32_versions_cast(redis_server, tmp_path):
    """rollout.computeDtype bfloat16 under a float32 model: the engine holds bf16 weights and
    takes the trainer's float32 snapshots, cast on arrival."""
    job = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    job["spec"]["rollout"]["computeDtype"] = "bfloat16"
    job_file = tmp_path / "tiny-bf16.yaml"
    job_file.write_text(yaml.safe_dump(job))
    log = tmp_path / "rollout.log"
    process, base, _ = start_rollout(redis_server.url, log, job_file=job_file)
    try:
        assert "the engine computes in bfloat16 (rollout.computeDtype bfloat16)" in \
            log.read_text()
        assert len(generate_four_tokens(base)["output_ids"]) == 4
        announce_version_1(redis_server.url, base, tmp_path, log)
    finally:
        process.terminate()
        assert process.wait(timeout=120) == 130, log.read_text()[-3000:]


@pytest.mark.slow
def test_not_ready_while_redis_is_down_and_ready_again_once_it_is_back(rollout_process,
                                                                       redis_server, tmp_path):
    base, _ = rollout_process
    process_log = tmp_path / "rollout.log"
    assert httpx.get(f"{base}/ready").status_code == 200
    redis_server.stop()
    # Not ready (no traffic, no weight updates can reach it), yet alive: no restart.
    deadline = time.monotonic() + 120
    while httpx.get(f"{base}/ready").status_code != 503:
        assert time.monotonic() < deadline, "/ready never answered 503 while Redis was down"
        time.sleep(0.1)
    assert httpx.get(f"{base}/health").status_code == 200
    redis_server.start()  # the same port and files
    deadline = time.monotonic() + 120
    while httpx.get(f"{base}/ready").status_code != 200:
        assert time.monotonic() < deadline, process_log.read_text()[-3000:]
        time.sleep(0.1)
    # The fixture then checks it still runs and stops cleanly.


@pytest.mark.slow
def test_past_the_outage_bound_the_worker_exits_naming_redis(redis_server, tmp_path):
    log = tmp_path / "rollout.log"
    env = {**os.environ, "ASYNCRL_OUTAGE_SECONDS": "2"}
    process, _, _ = start_rollout(redis_server.url, log, env=env)
    try:
        redis_server.stop()
        code = process.wait(timeout=120)
    finally:
        process.kill()
    text = " ".join(log.read_text().split())
    assert code == 1, text[-3000:]
    assert f"rollout: Redis at 127.0.0.1:{redis_server.port} has been unreachable" in text


def test_bad_settings_exit_with_a_clear_message(tmp_path):
    result = subprocess.run(
        [str(Path(sys.executable).parent / "asyncrl"), "serve", "rollout",
         "--job-file", str(tmp_path / "missing.yaml")],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 2
    assert "job file" in result.stderr and "Traceback" not in result.stderr
