"""Prometheus metrics of the reward service, in their own registry (tests run several
services in one process). Every series carries the job's name as a constant `rljob` label (not
`job`, which Prometheus sets itself); names carry their unit (`_total` for counters, `_seconds`,
`_ratio` for scores in 0..1). The Grafana dashboard queries exactly these names."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from asyncrl.reward.sandbox import RunResult
from asyncrl.reward.types import Failure, ScoreResult

SANDBOX_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SCORE_BUCKETS = (0.0, 0.25, 0.5, 0.75, 1.0)
KINDS = ("math", "code")


class RewardMetrics:
    def __init__(self, job: str):
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self._const = {"rljob": job}
        const = ("rljob",)
        self.scores = Counter("asyncrl_reward_scored_responses_total",
                              "Scored responses, by task kind.", (*const, "kind"),
                              registry=registry)
        self.failures = Counter(
            "asyncrl_reward_failures_total",
            "Responses that scored 0, by reason (wrong_answer, no_answer, runtime_error, "
            "syntax_error, timeout, memory, killed, verifier_error, output_limit).",
            (*const, "reason"), registry=registry)
        self.score = Histogram("asyncrl_reward_score_ratio", "Score of each response (0 to 1).",
                               (*const, "kind"), registry=registry, buckets=SCORE_BUCKETS)
        self.sandbox_seconds = Histogram(
            "asyncrl_reward_sandbox_seconds", "Wall time of one sandboxed run, start to exit.",
            const, registry=registry, buckets=SANDBOX_BUCKETS)
        self.sandbox_timeouts = Counter(
            "asyncrl_reward_sandbox_timeouts_total",
            "Sandboxed runs killed at the wall-clock limit.", const, registry=registry)
        # No series until the code sandbox is probed (jobs that score code), see below.
        self._sandbox_available = Gauge(
            "asyncrl_reward_sandbox_available",
            "1 if the code sandbox can run programs (0 when it refuses: no network namespace).",
            const, registry=registry)
        # Every series exists from the start (at zero), so rates and dashboards never see gaps.
        self._child(self.sandbox_seconds)
        self._child(self.sandbox_timeouts)
        for kind in KINDS:
            self._child(self.scores, kind=kind)
            self._child(self.score, kind=kind)
        for failure in Failure:
            if failure is not Failure.NONE:
                self._child(self.failures, reason=failure.label)

    def _child(self, metric, **labels):
        return metric.labels(**self._const, **labels)

    @property
    def sandbox_available(self) -> Gauge:
        """The 0/1 gauge, created on first use (the scorer sets it after probing)."""
        return self._child(self._sandbox_available)

    def observe_result(self, kind: str, result: ScoreResult) -> None:
        self._child(self.scores, kind=kind).inc()
        self._child(self.score, kind=kind).observe(result.score)
        if result.failure is not Failure.NONE:
            self._child(self.failures, reason=result.failure.label).inc()

    def observe_run(self, run: RunResult) -> None:
        self._child(self.sandbox_seconds).observe(run.wall_seconds)
        if run.timed_out:
            self._child(self.sandbox_timeouts).inc()

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)
