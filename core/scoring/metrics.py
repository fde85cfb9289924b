"""Prometheus metrics of the reward service, in their own registry (tests run several
services in one process). Every series carries the job's name as a constant `rljob` label (not
`job`, which Prometheus sets itself); names carry their unit (`_total` for counters, `_seconds`,
`_ratio` for scores in 0..1). The Grafana dashboard queries exactly these names."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from asyncrl.scoring.sandbox import RunResult
from asyncrl.scoring.types import Failure, ScoreResult

SANDBOX_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
SCORE_BUCKETS = (0.0, 0.25, 0.5, 0.75, 1.0)
# A python reward's extra numbers are its own, in its own units. No bucket below 0: with one,
# Prometheus clients drop the histogram's _sum (and with it the mean per field).
EXTRA_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 100.0)
KINDS = ("math", "code", "python", "http")
# Extra fields get a series each; past this many names, new ones are not recorded.
MAX_EXTRA_FIELDS = 16

log = logging.getLogger(__name__)


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
            "syntax_error, timeout, memory, killed, verifier_error, output_limit, exception, "
            "invalid_score, http_error).",
            (*const, "reason"), registry=registry)
        self.score = Histogram("asyncrl_reward_score_ratio", "Score of each response (0 to 1).",
                               (*const, "kind"), registry=registry, buckets=SCORE_BUCKETS)
        self.extras = Histogram(
            "asyncrl_reward_extra",
            "The extra numbers a python reward returns beside its score, by name (at most "
            f"{MAX_EXTRA_FIELDS} names).", (*const, "field"), registry=registry,
            buckets=EXTRA_BUCKETS)
        self._extra_fields: set[str] = set()
        self._ignored_extra_logged = False
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
        for name, value in result.extras.items():
            if self._extra_field(name):
                self._child(self.extras, field=name).observe(value)

    def _extra_field(self, name: str) -> bool:
        """Whether `name` has (or may have) a series: label values are bounded."""
        if name in self._extra_fields:
            return True
        if len(self._extra_fields) < MAX_EXTRA_FIELDS:
            self._extra_fields.add(name)
            return True
        if not self._ignored_extra_logged:
            self._ignored_extra_logged = True
            log.warning("the reward returns more than %d extra fields; %r and any further "
                        "names are not recorded as metrics", MAX_EXTRA_FIELDS, name)
        return False

    def observe_run(self, run: RunResult) -> None:
        self._child(self.sandbox_seconds).observe(run.wall_seconds)
        if run.timed_out:
            self._child(self.sandbox_timeouts).inc()

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)
