"""Prometheus metrics of the trainer, in the service's own registry.

Every series carries a constant `rljob` label (the job's name; not `job`, which Prometheus
sets itself). Names carry their unit: `_total` for counters, `_seconds`, `_versions` for
staleness, `_ratio` for values in 0..1 (rewards are scores in 0..1). The Grafana dashboard
(charts/asyncrl/dashboards/asyncrl.json) queries exactly these names.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32)


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
        self._labels = labels

    def observe_version(self, version: int) -> None:
        self.version.set(version)

    def observe_publish(self, seconds: float, transfer: str) -> None:
        self._publish_seconds.labels(transfer=transfer, **self._labels).observe(seconds)

    def observe_eval(self, accuracy: float) -> None:
        if accuracy >= 0:  # -1 means no held-out prompts
            self._eval_accuracy.labels(**self._labels).set(accuracy)

    def observe_step(self, record: dict) -> None:
        self.steps.inc()
        self.trained_tokens.inc(record["trained_tokens"])
        self.trained_samples.inc(record["trained_samples"])
        self.version.set(record["version"])
        self.step_seconds.observe(record["step_seconds"])
        for value in record["staleness"]:
            self.staleness.observe(value)
        self.reward_mean.set(record["reward_mean"])
        self.loss.set(record["loss"])
        if "eval_accuracy" in record:
            self.observe_eval(record["eval_accuracy"])

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)
