"""A job whose model.source is a Hub id, through `asyncrl validate` and `asyncrl run` as a user
types them, against the loopback Hub stand-in (support.hub): checked before any service starts,
and trained end to end from the downloaded snapshot."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from support import ROOT
from support.hub import HubStandIn, write_tiny_hub_model

ASYNCRL = str(Path(sys.executable).parent / "asyncrl")
REPO = "tiny-org/tiny-chat"


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return write_tiny_hub_model(tmp_path_factory.mktemp("repo"))


@pytest.fixture
def hub(model_folder):
    with HubStandIn() as server:
        server.add_model(REPO, model_folder)
        yield server


def job_file(tmp_path: Path, source: str, **model) -> Path:
    data = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    data["spec"]["model"] = {"source": source, **model}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def asyncrl(tmp_path: Path, hub: HubStandIn, *args: str, timeout: float = 600):
    """`asyncrl ARGS` with huggingface_hub on the stand-in and its cache in tmp_path."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE")}
    env.update(HF_ENDPOINT=hub.url, HF_HOME=str(tmp_path / "hf-home"),
               HF_HUB_CACHE=str(tmp_path / "hf-cache"))
    return subprocess.run([ASYNCRL, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=tmp_path)


def test_validate_asks_the_hub_and_downloads_nothing(tmp_path, hub):
    done = asyncrl(tmp_path, hub, "validate", str(job_file(tmp_path, REPO)))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "job.yaml: valid" in done.stdout
    assert hub.repos[REPO].downloads == []

    wrong = asyncrl(tmp_path, hub, "validate", str(job_file(tmp_path, "tiny-org/nope")))
    assert wrong.returncode == 1
    assert "job.yaml: invalid model" in wrong.stdout
    assert "model.source 'tiny-org/nope': no such model on the Hub" in wrong.stdout

    hub.stop()  # a cluster job validated where the Hub cannot be reached: a note
    away = asyncrl(tmp_path, hub, "validate", str(job_file(tmp_path, REPO)))
    assert away.returncode == 0, away.stdout + away.stderr
    assert "cannot be reached" in away.stdout and "checked again when the job starts" in \
        away.stdout


@pytest.mark.parametrize("model, message", [
    ({"source": "tiny-org/nope"}, "model.source 'tiny-org/nope': no such model on the Hub"),
    ({"source": REPO, "revision": "v9"}, "model.revision 'v9' is no branch, tag or commit"),
])
def test_run_refuses_a_model_it_cannot_have_before_any_service_starts(tmp_path, hub, model,
                                                                      message):
    run_dir = tmp_path / "run"
    done = asyncrl(tmp_path, hub, "run", str(job_file(tmp_path, **model)), "--run-dir",
                   str(run_dir))
    assert done.returncode == 1
    assert message in done.stderr
    assert not (run_dir / "logs").exists()  # no service was started


@pytest.mark.slow
def test_a_hub_id_job_trains_end_to_end_from_the_downloaded_snapshot(tmp_path, hub):
    run_dir = tmp_path / "run"
    done = asyncrl(tmp_path, hub, "run", str(job_file(tmp_path, REPO)), "--run-dir",
                   str(run_dir), "--steps", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Fetching 6 files" in done.stderr  # huggingface_hub's progress bar
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
    # Downloaded once, by `asyncrl run`: the services loaded it from the cache, offline.
    assert sorted(hub.repos[REPO].downloads) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
        "tokenizer.json", "tokenizer_config.json"]
