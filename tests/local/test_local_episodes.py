"""`asyncrl run` of an episode job (rollout.workflow.kind: episode) with the tiny model: the
episode function in the user's folder drives the rollout worker through the OpenAI client
over two turns, and the trainer trains on the recorded conversations; a function that cannot
be imported stops the job at start, naming it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support import ROOT
from support.episodes import TWO_TURNS

ASYNCRL = str(Path(sys.executable).parent / "asyncrl")

def episode_job(tmp_path: Path, function: str = "my_episodes:episode") -> Path:
    (tmp_path / "code").mkdir(exist_ok=True)
    (tmp_path / "code" / "my_episodes.py").write_text(TWO_TURNS)
    data = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    data["spec"]["algorithm"]["skipUniformGroups"] = False
    data["spec"]["rollout"]["workflow"] = {
        "kind": "episode", "function": function, "path": str(tmp_path / "code"),
        "maxTurns": 2, "maxContextTokens": 512}
    job = tmp_path / "episodes.yaml"
    job.write_text(yaml.safe_dump(data))
    return job


@pytest.mark.slow
def test_an_episode_job_trains_on_the_recorded_conversations(tmp_path):
    run_dir = tmp_path / "run"
    done = subprocess.run([ASYNCRL, "run", str(episode_job(tmp_path)), "--run-dir",
                           str(run_dir), "--steps", "3"], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in steps] == [1, 2, 3]
    # Two episodes of two prompts a step, each one merged sample of two answers of up to 8
    # tokens: the model's tokens only are trained on, the prompt and the reply never.
    assert all(r["trained_samples"] == 4 and 4 <= r["trained_tokens"] <= 4 * 16 for r in steps)
    log = (run_dir / "logs/rollout.log").read_text()
    assert "failed" not in log and "HTTP Request" not in log


def test_an_episode_function_that_cannot_be_imported_stops_the_job_at_start(tmp_path):
    done = subprocess.run([ASYNCRL, "run", str(episode_job(tmp_path, "my_episodes:missing")),
                           "--run-dir", str(tmp_path / "run"), "--steps", "1"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    output = " ".join((done.stdout + done.stderr).split())  # as the terminal wrapped it
    assert ("rollout exited with code 1" in output and "rollout.workflow.function "
            "'my_episodes:missing': module 'my_episodes' has no 'missing'" in output), output
