"""Prometheus metrics of the reward service, in their own registry (tests run several
services in one process). The Grafana dashboard queries exactly these names."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from asyncrl.reward.sandbox import RunResult
from asyncrl.reward.types import Failure, ScoreResult

SANDBOX_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SCORE_BUCKETS = (0.0, 0.25, 0.5, 0.75, 1.0)
KINDS = ("math", "code")


class RewardMetrics:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.scores = Counter("asyncrl_reward_scores", "Scored responses, by task kind.",
                              ["kind"], registry=registry)
        self.failures = Counter(
            "asyncrl_reward_failures",
            "Responses that scored 0, by reason (wrong_answer, no_answer, runtime_error, "
            "syntax_error, timeout, memory, killed, verifier_error, output_limit).",
            ["reason"], registry=registry)
        self.score = Histogram("asyncrl_reward_score", "Score of each response (0 to 1).",
                               ["kind"], registry=registry, buckets=SCORE_BUCKETS)
        self.sandbox_seconds = Histogram(
            "asyncrl_reward_sandbox_seconds", "Wall time of one sandboxed run, start to exit.",
            registry=registry, buckets=SANDBOX_BUCKETS)
        self.sandbox_timeouts = Counter(
            "asyncrl_reward_sandbox_timeouts", "Sandboxed runs killed at the wall-clock limit.",
            registry=registry)
        self.sandbox_available = Gauge(
            "asyncrl_reward_sandbox_available",
            "1 if the code sandbox can run programs (0 when it refuses: no network namespace).",
            registry=registry)
        # Every series exists from the start (at zero), so rates and dashboards never see gaps.
        for kind in KINDS:
            self.scores.labels(kind=kind)
            self.score.labels(kind=kind)
        for failure in Failure:
            if failure is not Failure.NONE:
                self.failures.labels(reason=failure.label)

    def observe_result(self, kind: str, result: ScoreResult) -> None:
        self.scores.labels(kind=kind).inc()
        self.score.labels(kind=kind).observe(result.score)
        if result.failure is not Failure.NONE:
            self.failures.labels(reason=result.failure.label).inc()

    def observe_run(self, run: RunResult) -> None:
        self.sandbox_seconds.observe(run.wall_seconds)
        if run.timed_out:
            self.sandbox_timeouts.inc()

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)
