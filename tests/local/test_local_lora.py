"""`asyncrl run` of a LoRA job (model.lora) end to end: versions and checkpoints are the
adapter, a peft directory that loads with peft, and a resumed run continues from it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from peft import PeftModel

from asyncrl.model.policy import load_policy
from asyncrl.spec import load_manifest
from support import ROOT

ASYNCRL = str(Path(sys.executable).parent / "asyncrl")


@pytest.mark.slow
def test_a_lora_job_publishes_and_checkpoints_the_adapter_and_resumes(tmp_path):
    manifest = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    manifest["spec"]["model"]["lora"] = {"rank": 4, "alpha": 8}
    manifest["spec"]["algorithm"]["kl"] = {"coef": 0.01}  # the base, adapter off, as reference
    job_file = tmp_path / "tiny-lora.yaml"
    run_dir = tmp_path / "run"

    def run(steps: int, transfer: str) -> None:
        manifest["spec"]["trainer"]["weightTransfer"] = transfer
        job_file.write_text(yaml.safe_dump(manifest))
        done = subprocess.run([ASYNCRL, "run", str(job_file), "--run-dir", str(run_dir),
                               "--steps", str(steps)], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr

    run(2, "auto")  # ipc on the CPU: the adapter's tensors in shared memory
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2]
    assert [r["weight_transfer"] for r in train] == ["ipc", "ipc"]
    # 2 layers x rank 4 x (in + out) of the seven projections, float32.
    assert {r["version_bytes"] for r in train} == {2 * 4 * 1024 * 4}
    # The engine merges what the trainer computes unmerged: the same log-probs in float32.
    measured = [r["mismatch_abs_max"] for r in train if r.get("mismatch_abs_max") is not None]
    assert measured and max(measured) < 1e-4
    checkpoint = run_dir / "checkpoints/step-000002"
    spec = load_manifest(job_file).spec
    base, _ = load_policy(spec.model)
    loaded = PeftModel.from_pretrained(base, str(checkpoint))
    assert loaded.peft_config["default"].r == 4
    trained = {n: p for n, p in loaded.named_parameters() if "lora_A" in n}
    assert trained and all(torch.isfinite(p).all() for p in trained.values())

    run(3, "disk")  # continues from the adapter and its optimizer state at step 2
    assert "trainer starts at step 2" in (run_dir / "logs/trainer.log").read_text()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3]
    assert train[-1]["weight_transfer"] == "disk"
    published = sorted((run_dir / "weights").glob("v*"))
    assert published and all({p.name for p in v.iterdir()} == {
        "adapter_config.json", "adapter_model.safetensors"} for v in published)
