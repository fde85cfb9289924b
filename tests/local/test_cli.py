"""The `asyncrl` console script, run as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from support import ROOT

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
BROKEN = ROOT / "tests" / "data" / "broken-rljob.yaml"
# The console script installed next to the interpreter running the tests (.venv/bin/asyncrl).
ASYNCRL = Path(sys.executable).parent / "asyncrl"


def asyncrl(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ASYNCRL), *map(str, args)], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_help_lists_the_commands():
    result = asyncrl("--help")
    assert result.returncode == 0, result.stderr
    assert "validate" in result.stdout and "crd" in result.stdout


def test_validate_examples():
    result = asyncrl("validate", *EXAMPLES)
    assert result.returncode == 0, result.stdout + result.stderr
    for path in EXAMPLES:
        assert f"{path}: valid" in result.stdout


def test_validate_broken_manifest_and_a_missing_file():
    missing = ROOT / "tests" / "data" / "no-such-rljob.yaml"
    result = asyncrl("validate", EXAMPLES[0], BROKEN, missing)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "Traceback" not in out
    assert f"{EXAMPLES[0]}: valid" in out
    assert f"{BROKEN}: invalid (8 problems)" in out
    for path in ("metadata.name", "spec.algorithm.clipEpsilon", "spec.algorithm.groupSize",
                 "spec.rollout.resources.requests.cpu", "spec.dataset.path"):
        assert f": {path}: " in out, path
    assert "did you mean `clipEps`?" in out
    assert f"{missing}: no such file" in out


def test_validate_yaml_syntax_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("apiVersion: asyncrl.io/v1alpha1\nspec: [unclosed\n")
    result = asyncrl("validate", path)
    out = result.stdout + result.stderr
    assert result.returncode == 1 and "Traceback" not in out
    assert f"{path}: not valid YAML: line 3" in out


def test_crd_yaml_and_json():
    as_yaml = asyncrl("crd")
    assert as_yaml.returncode == 0, as_yaml.stderr
    crd = yaml.safe_load(as_yaml.stdout)
    assert crd["kind"] == "CustomResourceDefinition"
    assert crd["metadata"]["name"] == "rljobs.asyncrl.io"
    as_json = asyncrl("crd", "--output", "json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout) == crd


def test_operator_refuses_bad_settings_before_touching_a_cluster():
    cases = [
        (["--gpu-tolerations", "[{"], "not JSON"),
        (["--gpu-tolerations", '[{"key": "a", "colour": "red"}]'], "unknown field(s) ['colour']"),
        (["--gpu-tolerations", '{"key": "a"}'], "expected a JSON list"),
        (["--reward-seccomp-profile", "Loose"], "expected RuntimeDefault, Unconfined or Localhost"),
    ]
    for args, message in cases:
        result = asyncrl("operator", *args)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        text = " ".join(result.stderr.split()).replace("│", "")
        assert message in " ".join(text.split()), (args, result.stderr)


def test_train_demo_trains_the_tiny_job_and_scores_with_the_reward_services_scorer():
    # The tiny random model rarely answers right; the run proves the loop (generate, score
    # with the same scorer as the reward service, update) goes through, step by step.
    result = subprocess.run([str(ASYNCRL), "train-demo", ROOT / "examples" / "tiny.yaml",
                             "--steps", "2"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2/2" in result.stdout, result.stdout
