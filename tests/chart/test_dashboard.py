"""The Grafana dashboard queries only names the services export, the names carry their units,
every series carries `rljob`, and `asyncrl run --metrics` writes a valid Prometheus set-up."""

import json
import re
import shutil
import subprocess

import pytest
import yaml

from asyncrl.local.runner import LocalJob, RunOptions
from asyncrl.spec import load_manifest
from support import ROOT
from support.dashboard import (
    exercised_registries,
    exported_names,
    expressions,
    families,
    load_dashboard,
    metric_names,
    panels,
)

# The counted thing, plural, before `_total` (as in http_requests_total).
COUNTED = {"steps", "tokens", "samples", "requests", "updates", "responses", "failures",
           "timeouts", "groups", "batches", "slots", "prompts", "episodes",
           "seconds"}  # time spent, as in process_cpu_seconds_total
UNITS = {
    "histogram": ("_seconds", "_versions", "_ratio"),
    "gauge": ("_seconds", "_tokens", "_groups", "_slots", "_requests", "_version", "_ratio",
              "_nats", "_replicas"),
}
# Gauges with no unit to carry, each with its reason.
UNITLESS = {
    "asyncrl_trainer_loss": "a loss is dimensionless and not bounded to 0..1",
    "asyncrl_trainer_learning_rate": "a step size, dimensionless and not a share of anything",
    "asyncrl_reward_sandbox_available": "a 0/1 boolean, like Prometheus' own `up`",
    "asyncrl_reward_extra": "a python reward's own numbers, in the reward's own units",
}
# `field`: a python reward's extra numbers by name, at most reward.metrics.MAX_EXTRA_FIELDS.
# `job_namespace`: the operator's series are of jobs in every namespace it watches.
LABELS = {"rljob", "kind", "reason", "finish_reason", "result", "le", "transfer", "field",
          "outcome", "tracker", "job_namespace"}


@pytest.fixture(scope="module")
def dashboard():
    return load_dashboard()


@pytest.fixture(scope="module")
def registries():
    registries = exercised_registries()
    # The fields a train record has only with some backends or batches (entropy, mismatch)
    # or since newer trainers: their gauges have no series before a record carries them.
    registries["trainer"].observe_step({
        "trained_tokens": 10, "trained_samples": 2, "version": 2, "step_seconds": 0.3,
        "staleness": [0], "reward_mean": 0.5, "loss": 0.1, "clip_fraction": 0.1,
        "entropy": 1.2, "response_length_mean": 9.0, "truncated_fraction": 0.5,
        "learning_rate": 1e-6, "mismatch_tokens": 8, "mismatch_abs_mean": 0.01,
        "mismatch_abs_max": 0.1, "mismatch_k3": 0.001, "mismatch_outside_fraction": 0.0,
        "eval_accuracy": 0.5, "eval_stderr": 0.1, "eval_problems": 25,
        "eval_truncated_fraction": 0.0})
    return registries


def test_the_dashboard_is_importable_json_with_a_datasource_and_an_rljob_variable(dashboard):
    assert dashboard["uid"] and dashboard["title"]
    assert dashboard["id"] is None
    assert 36 <= dashboard["schemaVersion"] <= 41
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    rljob = variables["rljob"]
    assert rljob["type"] == "query"
    assert rljob["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    query = rljob["query"]["query"]
    assert query.startswith("label_values(") and query.endswith(", rljob)")
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_every_panel_and_target_uses_the_datasource_variable(dashboard):
    for panel in panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    # No datasource uid of anyone's Grafana anywhere in the file.
    uids = re.findall(r'"uid":\s*"([^"]*)"', json.dumps(dashboard))
    assert set(uids) == {"${datasource}", dashboard["uid"]}


def test_panels_do_not_overlap(dashboard):
    cells = {}
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_the_dashboard_covers_what_the_design_lists(dashboard):
    titles = {p["title"] for p in panels(dashboard)}
    for title in ("Tokens/s", "Samples/s", "Trainer step time", "Policy version",
                  "Rollout version lag", "Staleness heatmap", "Reward mean", "Eval accuracy",
                  "Buffer depth and running slots", "Interrupted requests and weight updates",
                  "Weight-update latency", "Reward failures by reason", "Sandbox timeouts",
                  "Policy entropy and response length",
                  "PPO clip fraction and truncated responses", "Engine/trainer mismatch",
                  "Learning rate", "Rollout replicas", "Scaling signal"):
        assert title in titles
    assert any(p["type"] == "heatmap" for p in panels(dashboard))


def test_every_queried_name_is_exported_by_a_service(dashboard, registries):
    exported = {name for metrics in registries.values() for family in families(metrics)
                for name in exported_names(family)}
    missing = [(where, name) for where, expr in expressions(dashboard)
               for name in sorted(metric_names(expr)) if name not in exported]
    assert not missing, "queried but not exported:\n" + "\n".join(f"  {w}: {n}" for w, n in missing)
    queried = {name for _, expr in expressions(dashboard) for name in metric_names(expr)}
    assert len(queried) >= 20


def test_every_expression_filters_by_the_rljob_variable(dashboard):
    for where, expr in expressions(dashboard):
        if where.startswith("variable"):
            continue
        selectors = re.findall(r"\basyncrl_\w+(\{[^}]*\})?", expr)
        assert selectors and all(s == '{rljob=~"$rljob"}' for s in selectors), (where, expr)


def test_metric_name_extraction():
    expr = ('histogram_quantile(0.95, sum by (rljob, le) (rate(a_seconds_bucket{rljob=~"x"}'
            '[$__rate_interval]))) - on (rljob) group_right () max by (rljob) (b_version) > 0')
    assert metric_names(expr) == {"a_seconds_bucket", "b_version"}


def test_names_carry_their_units(registries):
    problems = []
    for service, metrics in registries.items():
        for family in families(metrics):
            name = family.name
            if not name.startswith(f"asyncrl_{service}_"):
                problems.append(f"{name}: not prefixed asyncrl_{service}_")
            if family.type == "counter":
                # prometheus_client keeps a counter's name without `_total` and exposes it with.
                if name.rsplit("_", 1)[-1] not in COUNTED:
                    problems.append(f"{name}_total: counts no known thing ({sorted(COUNTED)})")
            elif family.type in UNITS:
                if "_total" in name:
                    problems.append(f"{name}: `_total` is for counters")
                if not name.endswith(UNITS[family.type]) and name not in UNITLESS:
                    problems.append(f"{name}: {family.type} without a unit {UNITS[family.type]}")
            else:
                problems.append(f"{name}: unexpected type {family.type}")
    assert not problems, "\n".join(problems)


def test_every_series_carries_rljob_and_only_low_cardinality_labels(registries):
    for service, metrics in registries.items():
        for family in families(metrics):
            assert family.samples, f"{family.name}: nothing observed (extend the helper)"
            for sample in family.samples:
                assert sample.labels.get("rljob") == "t", (service, sample)
                assert set(sample.labels) <= LABELS, (service, sample)


def test_run_with_metrics_writes_prometheus_targets_and_config(tmp_path):
    tiny = ROOT / "examples/tiny.yaml"
    job = LocalJob(load_manifest(tiny), RunOptions(run_dir=tmp_path / "run", metrics=True))
    config = job.write_prometheus_config()
    assert config == tmp_path / "run/prometheus/prometheus.yml"
    groups = json.loads((config.parent / "targets.json").read_text())
    labels = sorted((g["labels"]["service"], g["labels"]["rljob"]) for g in groups)
    assert labels == [("buffer", "tiny"), ("reward", "tiny"), ("rollout", "tiny"),
                      ("trainer", "tiny")]
    ports = set()
    for group in groups:
        [target] = group["targets"]
        host, port = target.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        ports.add(port)
    assert len(ports) == 4
    assert str(job.rollout_ports[0][0]) in ports  # the rollout worker's /metrics
    scrape = yaml.safe_load(config.read_text())["scrape_configs"][0]
    assert scrape["file_sd_configs"][0]["files"] == ["targets.json"]
    promtool = shutil.which("promtool") or "/usr/bin/promtool"
    if not shutil.which(promtool):
        pytest.fail("promtool (package prometheus) is missing; install it with: "
                    "bash scripts/setup.sh", pytrace=False)
    check = subprocess.run([promtool, "check", "config", str(config)], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    # Without --metrics the buffer, reward and trainer serve no /metrics.
    off = LocalJob(load_manifest(tiny), RunOptions(run_dir=tmp_path / "off"))
    assert set(off.metrics_ports.values()) == {0}
