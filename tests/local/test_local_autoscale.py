"""rollout.autoscale in `asyncrl run`: real worker processes started and stopped by the rule of
asyncrl.algorithms.autoscale, with the prompt cursor's guarantee kept across them."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support import ROOT
from support.buffer import group_fates

ASYNCRL = str(Path(sys.executable).parent / "asyncrl")

pytestmark = pytest.mark.slow


def autoscaled_run(tmp_path: Path, steps: int, rollout: dict, algorithm: dict | None = None,
                   trainer: dict | None = None):
    manifest = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    # One epoch (each prompt used once), and as many held-out problems as the tiny job has.
    manifest["spec"]["dataset"].update(numPrompts=1000, evalFraction=0.008)
    manifest["spec"]["rollout"].update(rollout)
    manifest["spec"]["algorithm"].update(algorithm or {})
    manifest["spec"]["trainer"].update(trainer or {})
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(manifest))
    run_dir = tmp_path / "run"
    done = subprocess.run([ASYNCRL, "run", str(job_file), "--run-dir", str(run_dir),
                           "--steps", str(steps), "--rollout-threads", "2"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    changes = [json.loads(line) for line in
               (run_dir / "autoscale.jsonl").read_text().splitlines()]
    return run_dir, " ".join(done.stdout.split()), changes


def test_a_trainer_waiting_for_data_scales_the_rollout_out_to_its_maximum(tmp_path):
    # η = 0: the trainer waits while each batch is generated, most of its time with the tiny
    # model. The engines' target is set low: the decision must not hang on how busy a tiny
    # model's engine gets on this machine. A new worker takes ~10 s to import and load on two
    # busy cores, 20 of the tiny job's steps: the run lasts long enough after the scale-out
    # (after ~7 steps) for it to take part.
    run_dir, output, changes = autoscaled_run(
        tmp_path, 70,
        {"autoscale": {"maxReplicas": 2, "cooldownSeconds": 3, "targetRolloutBusy": 0.05},
         "maxNewTokens": 48},
        algorithm={"maxStaleness": 0}, trainer={"evalEvery": 1000, "checkpointEvery": 1000})
    assert ("rollout: 1 worker process to start, autoscaled between 1 and 2 "
            "(rollout.autoscale), 1 thread and up to 4 prompts at once each "
            "(rollout.maxConcurrentRollouts 4 shared)") in output, output
    assert [(c["from"], c["to"], c["reason"]) for c in changes] == [(1, 2, "ScaledOut")], changes
    assert "the trainer waited" in changes[0]["message"] and changes[0]["demand"] > 1.1
    assert "autoscale: 1 -> 2 rollout replicas: over" in output
    generated = {}
    for line in (run_dir / "rollout_status.jsonl").read_text().splitlines():
        record = json.loads(line)
        generated[record["worker"]] = int(record["generated_tokens_total"])
    assert generated.get("rollout-1", 0) > 0, generated  # the new worker generated
    group_fates(run_dir / "redis", "tiny").assert_each_prompt_used_once()


def test_idle_workers_beside_a_fed_trainer_scale_in_and_hand_their_prompts_back(tmp_path):
    # The tiny job as shipped: its trainer, evaluating every other step, is the bottleneck
    # (it waits a few percent of its time), and two workers generate far less than their
    # target share of the time. The trainer's target is set high enough that a busy machine's
    # few percent more never put it in the dead band.
    run_dir, output, changes = autoscaled_run(
        tmp_path, 40, {"replicas": 2, "autoscale": {"maxReplicas": 2, "cooldownSeconds": 3,
                                                    "targetTrainerIdle": 0.5}})
    assert [(c["from"], c["to"], c["reason"]) for c in changes] == [(2, 1, "ScaledIn")], changes
    assert changes[0]["demand"] < 0.9
    assert "autoscale: 2 -> 1 rollout replicas" in output
    group_fates(run_dir / "redis", "tiny").assert_each_prompt_used_once()
