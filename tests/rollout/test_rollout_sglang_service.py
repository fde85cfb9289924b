"""`asyncrl serve rollout` and `asyncrl run` with `rollout.engine: sglang`, on CPU.

SGLang needs a GPU, so the launch command is overridden (`--sglang-command`, or
ASYNCRL_SGLANG_COMMAND) with our torch engine's SGLang-compatible server standing in for it:
`asyncrl serve rollout --engine torch ...`. Everything else is the real path: the worker
launches the server as a child, waits for /health, drives it over SGLang's HTTP API, follows
announced versions through /update_weights_from_disk, and dies with the child.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from support import ROOT
from support.ports import free_port
from support.waiting import wait_for_status

ASYNCRL = str(Path(sys.executable).parent / "asyncrl")
# Every test starts service processes that load a model.
pytestmark = pytest.mark.slow


def sglang_job(path: Path, lora: dict | None = None, **rollout) -> Path:
    """examples/tiny.yaml with SGLang rollout workers (a GPU pool is required by the spec;
    without a GPU here, everything runs on the CPU), training a LoRA adapter with `lora`."""
    manifest = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    if lora is not None:
        manifest["spec"]["model"]["lora"] = lora
    manifest["spec"]["rollout"].update(
        engine="sglang", placement={"gpus": 1, "nodeSelector": {"pool": "gpu"}}, **rollout)
    path.write_text(yaml.safe_dump(manifest))
    return path


def stand_in_command(job_file: Path) -> str:
    """SGLang's stand-in: the torch engine's SGLang-compatible API on {port}."""
    return (f"{ASYNCRL} serve rollout --engine torch --job-file {job_file} --http-port {{port}} "
            f"--grpc-port {free_port()} --threads 1")


def start_worker(job_file: Path, command: str, log: Path, *extra: str):
    http_port = free_port()
    process = subprocess.Popen(
        [ASYNCRL, "serve", "rollout", "--job-file", str(job_file), "--http-port", str(http_port),
         "--grpc-port", str(free_port()), "--sglang-port", str(free_port()),
         "--sglang-command", command, "--threads", "1", *extra],
        stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    return process, f"http://127.0.0.1:{http_port}"


def children(pid: int) -> list[int]:
    found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return [int(p) for p in found.stdout.split()]


def test_a_server_that_dies_at_start_stops_the_worker_with_its_output(tmp_path):
    job = sglang_job(tmp_path / "job.yaml")
    command = f"{sys.executable} -c \"print('cuda out of memory at start'); raise SystemExit(3)\""
    process, _ = start_worker(job, command, tmp_path / "worker.log")
    assert process.wait(timeout=120) != 0
    output = (tmp_path / "worker.log").read_text()
    assert "SGLang exited with code 3" in output and "cuda out of memory at start" in output


def test_without_sglang_installed_the_worker_says_what_to_do(tmp_path):
    job = sglang_job(tmp_path / "job.yaml")
    result = subprocess.run(
        [ASYNCRL, "serve", "rollout", "--job-file", str(job), "--http-port", str(free_port()),
         "--grpc-port", str(free_port())],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode != 0
    assert "needs the sglang package" in result.stderr and "engine: torch" in result.stderr


def test_worker_health_follows_sglang_and_its_death_stops_the_worker(tmp_path):
    job = sglang_job(tmp_path / "job.yaml")
    log = tmp_path / "worker.log"
    process, base = start_worker(job, stand_in_command(job), log)
    try:
        wait_for_status(process, log, f"{base}/health", 200, timeout=180)
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        assert 'asyncrl_rollout_policy_version{rljob="tiny"} 0.0' in metrics
        # The OpenAI-compatible API is served over SGLang's generation too.
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        model = yaml.safe_load(job.read_text())["spec"]["model"]["source"]
        assert [m.id for m in client.models.list()] == [model]
        answer = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is 2 + 3?"}],
            max_tokens=8, temperature=0)
        assert 0 < answer.usage.completion_tokens <= 8
        assert answer.choices[0].finish_reason in ("stop", "length")
        assert isinstance(answer.choices[0].message.content, str)
        (server,) = children(process.pid)
        os.kill(server, signal.SIGKILL)  # the SGLang server dies
        assert process.wait(timeout=60) != 0  # ... and takes the worker (the pod) with it
        assert "SGLang exited with code -9" in log.read_text()
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)


def test_a_tiny_job_runs_to_completion_through_engine_sglang(tmp_path):
    run_dir = tmp_path / "run"
    job = sglang_job(tmp_path / "job.yaml", maxNewTokens=48)
    env = {**os.environ, "ASYNCRL_SGLANG_COMMAND": stand_in_command(run_dir / "config.yaml")}
    done = subprocess.run([ASYNCRL, "run", str(job), "--run-dir", str(run_dir), "--steps", "4"],
                          capture_output=True, text=True, timeout=900, env=env)
    rollout_log = (run_dir / "logs/rollout.log").read_text()
    assert done.returncode == 0, done.stdout[-3000:] + rollout_log[-3000:]
    assert "launching SGLang" in rollout_log
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    eta = yaml.safe_load(job.read_text())["spec"]["algorithm"]["maxStaleness"]
    assert all(0 <= s <= eta for r in train for s in r["staleness"])
    # The worker followed the trainer's versions through SGLang's weight-update API.
    statuses = [json.loads(line) for line in
                (run_dir / "rollout_status.jsonl").read_text().splitlines()]
    assert max(int(s["version"]) for s in statuses) >= 1


def test_a_lora_job_serves_each_version_as_an_sglang_adapter(tmp_path):
    run_dir = tmp_path / "run"
    job = sglang_job(tmp_path / "job.yaml", lora={"rank": 4, "alpha": 8})
    env = {**os.environ, "ASYNCRL_SGLANG_COMMAND": stand_in_command(run_dir / "config.yaml")}
    done = subprocess.run([ASYNCRL, "run", str(job), "--run-dir", str(run_dir), "--steps", "3"],
                          capture_output=True, text=True, timeout=900, env=env)
    rollout_log = (run_dir / "logs/rollout.log").read_text()
    assert done.returncode == 0, done.stdout[-3000:] + rollout_log[-3000:]
    # Each version went to the server as an adapter (/load_lora_adapter), not as weights.
    assert "serves LoRA adapter v1" in rollout_log, rollout_log[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    # The rollout's log-probs, each token tagged with the adapter it named, are the trainer's.
    measured = [r["mismatch_abs_max"] for r in train if r.get("mismatch_abs_max") is not None]
    assert measured and max(measured) < 1e-4, measured
