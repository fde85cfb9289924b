"""Prometheus metrics of the trainer, in the service's own registry.

Every series carries a constant `rljob` label (the job's name; not `job`, which Prometheus
sets itself). Names carry their unit: `_total` for counters, `_seconds`, `_versions` for
staleness, `_ratio` for values in 0..1 (rewards are scores in 0..1), `_tokens` for lengths,
`_nats` for entropies and log-prob differences (natural log). The Grafana dashboard
(charts/asyncrl/dashboards/asyncrl.json) queries exactly these names.

A gauge of a figure that a record may lack (the entropy with the Megatron backend, the
mismatch of a batch holding no token of the trainer's current version, the accuracy before
the first evaluation) has no series until a record carries it: a 0 would read as measured.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32)

# The last step's figures: (record field, gauge name, help).
_STEP_GAUGES = (
    ("entropy", "asyncrl_trainer_entropy_nats",
     "Mean policy entropy over the last step's trained tokens (nats per token)."),
    ("response_length_mean", "asyncrl_trainer_response_length_mean_tokens",
     "Mean length of the last batch's responses (tokens)."),
    ("truncated_fraction", "asyncrl_trainer_truncated_responses_ratio",
     "Share of the last batch's responses cut at rollout.maxNewTokens (0 to 1)."),
    ("clip_fraction", "asyncrl_trainer_clipped_tokens_ratio",
     "Share of the last step's trained tokens whose PPO ratio was clipped, token-weighted "
     "over its optimizer steps (0 to 1)."),
    ("learning_rate", "asyncrl_trainer_learning_rate",
     "Learning rate of the last step, as scheduled (dimensionless)."),
)
# The engine/trainer mismatch over the last step's tokens of the trainer's current version
# (asyncrl.algorithms.mismatch); set only when it measured some.
_MISMATCH_GAUGES = (
    ("mismatch_abs_mean", "asyncrl_trainer_mismatch_logprob_abs_mean_nats",
     "Mean |trainer - engine log-prob| over the last step's tokens of the current version."),
    ("mismatch_abs_max", "asyncrl_trainer_mismatch_logprob_abs_max_nats",
     "Largest |trainer - engine log-prob| over the last step's tokens of the current version."),
    ("mismatch_k3", "asyncrl_trainer_mismatch_k3_nats",
     "k3 estimate of KL(engine || trainer) per token of the current version (nats)."),
    ("mismatch_outside_fraction", "asyncrl_trainer_mismatch_outside_ratio",
     "Share of the current version's tokens whose trainer/engine probability ratio is "
     "outside [0.5, 2] (0 to 1)."),
)


class TrainerMetrics:
    def __init__(self, job: str):
        self.registry = CollectorRegistry()
        labels = {"rljob": job}

        def labelled(metric):
            return metric.labels(**labels)

        names = ("rljob",)
        registry = self.registry
        self.steps = labelled(Counter("asyncrl_trainer_steps_total", "Training steps applied.",
                                      names, registry=registry))
        self.trained_tokens = labelled(Counter("asyncrl_trainer_trained_tokens_total",
                                               "Generated tokens trained on.", names,
                                               registry=registry))
        self.trained_samples = labelled(Counter("asyncrl_trainer_trained_samples_total",
                                                "Samples (responses) trained on.", names,
                                                registry=registry))
        self.version = labelled(Gauge("asyncrl_trainer_policy_version",
                                      "Published policy version.", names, registry=registry))
        self.step_seconds = labelled(Histogram("asyncrl_trainer_step_seconds",
                                               "Wall time of one update.", names,
                                               buckets=_STEP_BUCKETS, registry=registry))
        self.staleness = labelled(Histogram("asyncrl_trainer_consumed_staleness_versions",
                                            "Staleness of trained groups: trainer version minus "
                                            "their oldest token's version.", names,
                                            buckets=_STALENESS_BUCKETS, registry=registry))
        self.reward_mean = labelled(Gauge("asyncrl_trainer_reward_mean_ratio",
                                          "Mean reward of the last trained batch (0 to 1).",
                                          names, registry=registry))
        self.loss = labelled(Gauge("asyncrl_trainer_loss", "Loss of the last update "
                                   "(dimensionless).", names, registry=registry))
        self._publish_seconds = Histogram(
            "asyncrl_trainer_publish_seconds", "Time to hand a new version to the rollout "
            "engines: the broadcast (transfer distributed) or writing the snapshot (disk).",
            ("rljob", "transfer"), buckets=_STEP_BUCKETS, registry=registry)
        # No series before the first evaluation (a 0 would read as a measured accuracy).
        self._eval_accuracy = Gauge("asyncrl_trainer_eval_accuracy_ratio",
                                    "Held-out accuracy at the last evaluation (0 to 1).", names,
                                    registry=registry)
        self._eval_stderr = Gauge("asyncrl_trainer_eval_stderr_ratio",
                                  "One standard error (binomial) of the last evaluation's "
                                  "accuracy (0 to 1).", names, registry=registry)
        self._eval_truncated = Gauge("asyncrl_trainer_eval_truncated_ratio",
                                     "Share of the last evaluation's responses cut at "
                                     "maxNewTokens (0 to 1): each scores 0.", names,
                                     registry=registry)
        self._step_gauges = {field: Gauge(name, help_, names, registry=registry)
                             for field, name, help_ in _STEP_GAUGES}
        self._mismatch_gauges = {field: Gauge(name, help_, names, registry=registry)
                                 for field, name, help_ in _MISMATCH_GAUGES}
        self.batch_wait_seconds = labelled(Counter(
            "asyncrl_trainer_batch_wait_seconds",
            "Seconds the trainer waited for a batch (its rate is the trainer's idle share, "
            "the rollout autoscaler's signal).", names, registry=registry))
        self._tracking_failures = Counter(
            "asyncrl_trainer_tracking_failures_total", "Failed calls to an experiment tracker "
            "(tracking in the job's spec), each retry counted; training goes on without them.",
            ("rljob", "tracker"), registry=registry)
        self._labels = labels

    def observe_tracking_failure(self, tracker: str) -> None:
        self._tracking_failures.labels(tracker=tracker, **self._labels).inc()

    def observe_version(self, version: int) -> None:
        self.version.set(version)

    def observe_publish(self, seconds: float, transfer: str) -> None:
        self._publish_seconds.labels(transfer=transfer, **self._labels).observe(seconds)

    def observe_eval(self, evaluation: dict) -> None:
        """An evaluation's record fields ({} without held-out prompts: no series)."""
        if "eval_accuracy" in evaluation:
            self._eval_accuracy.labels(**self._labels).set(evaluation["eval_accuracy"])
        if "eval_stderr" in evaluation:
            self._eval_stderr.labels(**self._labels).set(evaluation["eval_stderr"])
        if "eval_truncated_fraction" in evaluation:
            self._eval_truncated.labels(**self._labels).set(
                evaluation["eval_truncated_fraction"])

    def observe_step(self, record: dict) -> None:
        self.steps.inc()
        self.batch_wait_seconds.inc(record.get("wait_seconds", 0.0))
        self.trained_tokens.inc(record["trained_tokens"])
        self.trained_samples.inc(record["trained_samples"])
        self.version.set(record["version"])
        self.step_seconds.observe(record["step_seconds"])
        for value in record["staleness"]:
            self.staleness.observe(value)
        self.reward_mean.set(record["reward_mean"])
        self.loss.set(record["loss"])
        self._set_present(self._step_gauges, record)
        if record.get("mismatch_tokens", 0) > 0:
            self._set_present(self._mismatch_gauges, record)
        self.observe_eval(record)

    def _set_present(self, gauges: dict[str, Gauge], record: dict) -> None:
        """Each gauge whose field the record carries with a value."""
        for field, gauge in gauges.items():
            if record.get(field) is not None:
                gauge.labels(**self._labels).set(record[field])

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)
