"""The Grafana dashboard (charts/asyncrl/dashboards/asyncrl.json), its PromQL, and the metric
names the four services and the operator really export (collected from their metrics classes)."""

from __future__ import annotations

import json
import re

from asyncrl.buffer.metrics import BufferMetrics
from asyncrl.buffer.store import Stats
from asyncrl.engine.types import EngineStatus, GenerationResult, WeightUpdate
from asyncrl.operator.metrics import OperatorMetrics
from asyncrl.rollout.metrics import RolloutMetrics
from asyncrl.scoring.metrics import RewardMetrics
from asyncrl.scoring.sandbox import RunResult
from asyncrl.scoring.types import Failure, ScoreResult
from asyncrl.trainer.metrics import TrainerMetrics
from support import ROOT

DASHBOARD = ROOT / "charts/asyncrl/dashboards/asyncrl.json"

# PromQL words that are not metric names: keywords, aggregations, functions (always followed
# by "(", removed separately), and the label lists of by/without/on/ignoring/group_*.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
             "and", "or", "unless", "inf", "nan"}


def load_dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel, rows' collapsed children included (rows themselves excepted)."""
    found = []
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            found.extend(panel.get("panels", []))
        else:
            found.append(panel)
    return found


def expressions(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    found = [(f"panel {panel['title']!r} target {target['refId']}", target["expr"])
             for panel in panels(dashboard) for target in panel.get("targets", [])]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            query = variable["query"]
            query = query["query"] if isinstance(query, dict) else query
            inner = re.fullmatch(r"label_values\((.+),\s*\w+\)", query)
            if inner:  # label_values(metric, label) asks for the metric's series
                found.append((f"variable {variable['name']}", inner.group(1)))
    return found


def metric_names(expr: str) -> set[str]:
    """The metric names an expression selects."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range selectors
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\b[a-zA-Z_][a-zA-Z0-9_]*\s*\(", "(", text)  # functions and aggregations
    words = re.findall(r"(?<![0-9.])\b[a-zA-Z_:][a-zA-Z0-9_:]*", text)
    return {w for w in words if w.lower() not in _KEYWORDS}


def substitute(expr: str, job: str, rate_interval: str = "30s") -> str:
    """A panel expression as Grafana sends it, for one job."""
    replacements = {
        "$__rate_interval": rate_interval, "${__rate_interval}": rate_interval,
        "$__interval": "15s", "${__interval}": "15s", "$__range": "5m", "${__range}": "5m",
        "${rljob}": job, "$rljob": job,
    }
    for variable, value in replacements.items():
        expr = expr.replace(variable, value)
    assert "$" not in expr, f"unsubstituted variable in {expr}"
    return expr


def exercised_registries() -> dict[str, object]:
    """Each service's metrics object with every series observed at least once."""
    trainer = TrainerMetrics("t")
    trainer.observe_step({"trained_tokens": 10, "trained_samples": 2, "version": 1,
                          "step_seconds": 0.3, "staleness": [0, 1], "reward_mean": 0.5,
                          "loss": 0.1, "eval_accuracy": 0.25})
    trainer.observe_publish(0.3, "distributed")
    trainer.observe_tracking_failure("mlflow")
    rollout = RolloutMetrics("t")
    rollout.observe_result(GenerationResult("r", [1], [2], [-0.1], [0], finish_reason="length"),
                           0.2)
    rollout.observe_weight_update(WeightUpdate(version=1, interrupted_requests=1, seconds=0.05))
    rollout.observe_weight_update_failure()
    rollout.observe_episode("completed")
    rollout.refresh(EngineStatus(version=1, paused=False, running_requests=1, waiting_requests=0,
                                 generated_tokens_total=5, interrupted_requests_total=1,
                                 busy_seconds_total=2.5, max_running_requests=4, max_sequence_length=64))
    reward = RewardMetrics("t")
    reward.observe_result("math", ScoreResult.failed("a", Failure.WRONG_ANSWER))
    reward.observe_result("python", ScoreResult("b", 1.0, extras={"format_bonus": 0.1}))
    reward.observe_run(RunResult(exit_code=None, stdout=b"", stderr=b"", wall_seconds=1.0,
                                 timed_out=True))
    reward.sandbox_available.set(1)
    buffer = BufferMetrics()
    buffer.observe_stats("t", Stats(trainer_version=1, trainer_step=1, depth_groups=2,
                                    running_slots=3, accepted_total=4, consumed_total=2,
                                    dropped_stale_total=0, redelivered_total=0,
                                    expired_slots_total=0, staleness_counts=[1, 1]))
    operator = OperatorMetrics()
    operator.record("ml", "t", 2, 3, {"demand": 1.5, "trainerIdle": 0.4, "rolloutBusy": 0.9})
    return {"trainer": trainer, "rollout": rollout, "reward": reward, "buffer": buffer,
            "operator": operator}


def families(metrics) -> list:
    return list(metrics.registry.collect())


def exported_names(family) -> set[str]:
    """The sample names a family exposes, with or without samples yet."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                "gauge": ("",)}[family.type]
    return {family.name + suffix for suffix in suffixes} | {s.name for s in family.samples}
