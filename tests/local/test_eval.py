"""`asyncrl eval`: what --model names, the same responses from a checkpoint and its export,
and, on a real short run, the run's own evaluation accuracies reproduced."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from asyncrl.engine.types import GenerationResult
from asyncrl.evaluation import held_out_prompts, response_record
from asyncrl.local.eval_models import ModelArgumentError, resolve_model
from asyncrl.local.evaluate import evaluate_model, markdown_table
from asyncrl.model.policy import load_policy
from asyncrl.spec import parse_manifest
from asyncrl.trainer.checkpoints import TrainerState, save_checkpoint
from asyncrl.trainer.export import export
from asyncrl.trainer.model_files import ModelFiles
from support import ROOT

ASYNCRL = str(Path(sys.executable).parent / "asyncrl")
TINY = ROOT / "examples/tiny.yaml"


def trained_run(tmp_path: Path):
    """A run folder with one checkpoint (step 2) of perturbed tiny weights."""
    job = parse_manifest(yaml.safe_load(TINY.read_text()))
    model, tokenizer = load_policy(job.spec.model)
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn_like(parameter))
    run_dir = tmp_path / "run"
    save_checkpoint(model, model.state_dict(), {"state": {}, "param_groups": []}, run_dir,
                    TrainerState(2, 2), files=ModelFiles.of(job, model, tokenizer))
    return job, run_dir, tokenizer


def test_what_names_no_model_is_refused_saying_what_to_give(tmp_path):
    job, run_dir, _ = trained_run(tmp_path)
    spec = job.spec
    with pytest.raises(ModelArgumentError, match="--model .*missing: no such folder"):
        resolve_model(str(tmp_path / "missing"), spec.model)
    with pytest.raises(ModelArgumentError, match="no checkpoint of step 9; it keeps"):
        resolve_model(f"{run_dir}@9", spec.model)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelArgumentError, match="holds no model .* or base"):
        resolve_model(str(tmp_path / "empty"), spec.model)
    assert resolve_model(str(run_dir), spec.model).step == 2
    assert resolve_model(f"{run_dir}@2", spec.model).weights.name == "step-000002"
    assert resolve_model("base", spec.model).weights is None


def test_a_checkpoint_and_its_export_give_the_same_responses_unlike_the_base(tmp_path):
    job, run_dir, tokenizer = trained_run(tmp_path)
    spec = job.spec
    export(run_dir / "checkpoints" / "step-000002", job, tmp_path / "exported")
    items = held_out_prompts(spec, tokenizer, 3)
    records = [evaluate_model(spec, "tiny", resolve_model(text, spec.model), items, tokenizer,
                              samples=1, device="cpu")
               for text in (str(run_dir), str(tmp_path / "exported"), "base")]
    responses = [[p["responses"] for p in r["per_problem"]] for r in records]
    assert responses[0] == responses[1]
    assert responses[0] != responses[2]
    assert [r["step"] for r in records] == [2, None, None]
    for record in records:  # how the responses ended, beside the accuracy
        cut = [c for p in record["per_problem"] for c in p["cut"]]
        assert record["truncated_fraction"] == sum(cut) / len(cut)
        assert record["response_length_mean"] > 0
    table = markdown_table("tiny", records, "3 held-out prompts")
    assert "| pass@1 |" in table and f"`{run_dir}`" in table and "| problems | 3 | 3 | 3 |" in table


def test_the_response_record_counts_cut_responses_and_mean_length():
    results = [[GenerationResult("a", [1], output_ids=[5] * 4, finish_reason="length")],
               [GenerationResult("b", [1], output_ids=[5] * 2, finish_reason="stop")]]
    assert response_record(results) == {"eval_response_length_mean": 3.0,
                                        "eval_truncated_fraction": 0.5}
    assert response_record([]) == {}


# A reward that depends on every token of a response (its length's parity), so that one
# changed greedy token changes the score as often as not.
PARITY = "def score(response, row):\n    return float(len(response) % 2 == 0)\n"


@pytest.mark.slow
@pytest.mark.parametrize("engine_dtype", [None, "bfloat16"])
def test_eval_reproduces_the_runs_own_evaluations_of_the_base_and_the_trained_model(
        tmp_path, engine_dtype):
    """Also where the rollout engines compute in bf16 beside a float32 model: both evaluate
    the bf16 policy, not the trainer's float32 weights."""
    (tmp_path / "parity.py").write_text(PARITY)
    manifest = yaml.safe_load(TINY.read_text())
    if engine_dtype:
        manifest["spec"]["rollout"]["computeDtype"] = engine_dtype
    manifest["spec"]["reward"] = {"kind": "python",
                                  "python": {"function": "parity:score", "path": str(tmp_path)}}
    manifest["spec"]["algorithm"]["maxSteps"] = 2
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(manifest))
    run_dir = tmp_path / "run"
    done = subprocess.run([ASYNCRL, "run", str(job_file), "--run-dir", str(run_dir),
                           "--devices", "cpu"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    base = next(r for r in records if r["kind"] == "eval" and r["step"] == 0)
    trained = next(r for r in records if r["kind"] == "train" and r["step"] == 2)
    checkpoint = run_dir / "checkpoints" / "step-000002"
    # The run's own checkpoint is a model directory a serving stack loads as it is.
    for name in ("tokenizer.json", "generation_config.json", "README.md", "state.json"):
        assert (checkpoint / name).is_file(), name

    out = tmp_path / "eval"
    scored = subprocess.run([ASYNCRL, "eval", str(job_file), "--model", "base", "--model",
                             str(run_dir), "--devices", "cpu", "--out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert scored.returncode == 0, scored.stdout + scored.stderr
    (result,) = out.glob("*.json")
    models = json.loads(result.read_text())["models"]
    assert [m["problems"] for m in models] == [base["eval_problems"]] * 2
    assert models[0]["pass@1"] == base["eval_accuracy"]
    assert models[1]["pass@1"] == trained["eval_accuracy"]
    assert models[1]["step"] == 2
    assert [m["dtype"] for m in models] == [engine_dtype or "float32"] * 2
    assert "| pass@1 |" in scored.stdout and (out / result.name.replace(".json", ".md")).is_file()
