"""`asyncrl run` end to end with the tiny model: every service a real process."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from asyncrl.runner import LocalJob, RunOptions
from asyncrl.spec import load_manifest

ROOT = Path(__file__).resolve().parents[1]
ASYNCRL = str(Path(sys.executable).parent / "asyncrl")
TINY = ROOT / "examples/tiny.yaml"


def run(run_dir, *extra, timeout=600):
    return subprocess.run([ASYNCRL, "run", str(TINY), "--run-dir", str(run_dir), *extra],
                          capture_output=True, text=True, timeout=timeout)


def metrics(run_dir, kind="train"):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["kind"] == kind]


@pytest.mark.slow
def test_run_trains_writes_a_complete_run_folder_and_resumes(tmp_path):
    run_dir = tmp_path / "run"
    first = run(run_dir, "--steps", "3")
    assert first.returncode == 0, first.stdout + first.stderr
    for path in ["config.yaml", "metrics.jsonl", "report.md", "logs/buffer.log", "logs/trainer.log",
                 "logs/rollout.log", "plots/reward_vs_step.png", "plots/reward_vs_time.png",
                 "plots/throughput.png", "plots/staleness.png"]:
        assert (run_dir / path).is_file(), path
    assert list((run_dir / "checkpoints").glob("step-*"))
    records = metrics(run_dir)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert [r["version"] for r in records] == [1, 2, 3]
    eta = load_manifest(TINY).spec.algorithm.max_staleness
    assert all(s <= eta for r in records for s in r["staleness"])
    assert any("eval_accuracy" in r for r in records)
    assert [r["step"] for r in metrics(run_dir, "eval")] == [0]  # the starting point
    assert "Run report: tiny" in (run_dir / "report.md").read_text()

    # The same command with a larger budget continues from the checkpoint at step 3.
    second = run(run_dir, "--steps", "5")
    assert second.returncode == 0, second.stdout + second.stderr
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4, 5]
    assert "trainer starts at step 3" in (run_dir / "logs/trainer.log").read_text()


@pytest.mark.slow
def test_ctrl_c_stops_every_service_and_leaves_a_resumable_folder(tmp_path):
    run_dir = tmp_path / "run"
    process = subprocess.Popen([ASYNCRL, "run", str(TINY), "--run-dir", str(run_dir), "--steps", "200"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    while not (run_dir / "metrics.jsonl").exists():
        assert time.monotonic() < deadline and process.poll() is None
        time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 130, output
    assert "rerun the same command to resume" in output
    leftovers = subprocess.run(["pgrep", "-f", f"--job-file {run_dir}"], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""
    assert (run_dir / "report.md").is_file()


@pytest.mark.slow
def test_killing_the_trainer_mid_step_loses_no_accepted_sample(tmp_path):
    job = load_manifest(TINY)
    options = RunOptions(run_dir=tmp_path / "run", max_steps=6)
    local = LocalJob(job, yaml.safe_load(TINY.read_text()), options)
    try:
        local.start()
        trainer = next(s for s in local.services if s.name == "trainer")
        deadline = time.monotonic() + 300
        while True:  # kill it while an update is being applied, before its ack
            status = local.trainer_status()
            if status is not None and status.step >= 1 and status.phase == "training":
                break
            assert time.monotonic() < deadline
            time.sleep(0.005)
        os.kill(trainer.process.pid, signal.SIGKILL)
        trainer.process.wait()
        trainer.start()
        while not local.trainer_done():
            local.check()
            assert time.monotonic() < deadline + 300
            time.sleep(0.5)
        stats = local.buffer_stats()
    finally:
        local.stop()
    assert stats.redelivered_total >= 1
    # Every accepted group was trained on, is still waiting, or was dropped as stale (and
    # counted): none vanished. The restarted trainer redid the steps after its checkpoint,
    # so it consumed at least the six batches of its budget.
    assert stats.accepted_total == (stats.consumed_total + stats.depth_groups
                                    + stats.dropped_stale_total)
    assert stats.consumed_total >= 6 * job.spec.algorithm.batch_size


@pytest.mark.slow
def test_a_crashed_service_stops_the_job_with_its_log_tail(tmp_path):
    from asyncrl.runner import ServiceFailed

    job = load_manifest(TINY)
    local = LocalJob(job, yaml.safe_load(TINY.read_text()), RunOptions(run_dir=tmp_path / "run",
                                                                        max_steps=50))
    try:
        local.start()
        rollout = next(s for s in local.services if s.name == "rollout")
        os.kill(rollout.process.pid, signal.SIGKILL)
        rollout.process.wait()
        with pytest.raises(ServiceFailed) as failure:
            local.check()
    finally:
        local.stop()
    assert failure.value.name == "rollout" and failure.value.returncode == -signal.SIGKILL
    assert "serve rollout" in failure.value.log_tail
    # Everything else was stopped with it.
    assert all(s.process.poll() is not None for s in local.services)
