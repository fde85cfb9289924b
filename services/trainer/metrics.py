"""Prometheus metrics of the trainer, in the service's own registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

_STEP_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600)
_STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32)


class TrainerMetrics:
    def __init__(self, job: str):
        self.registry = CollectorRegistry()
        labels = {"rljob": job}

        def labelled(metric):
            return metric.labels(**labels)

        names = ("rljob",)
        self.steps = labelled(Counter("asyncrl_trainer_steps", "Training steps applied.", names,
                                      registry=self.registry))
        self.trained_tokens = labelled(Counter("asyncrl_trainer_trained_tokens",
                                               "Generated tokens trained on.", names,
                                               registry=self.registry))
        self.version = labelled(Gauge("asyncrl_trainer_policy_version", "Published policy version.",
                                      names, registry=self.registry))
        self.step_seconds = labelled(Histogram("asyncrl_trainer_step_seconds",
                                               "Wall time of one update.", names,
                                               buckets=_STEP_BUCKETS, registry=self.registry))
        self.staleness = labelled(Histogram("asyncrl_trainer_consumed_staleness",
                                            "Staleness of trained groups (versions).", names,
                                            buckets=_STALENESS_BUCKETS, registry=self.registry))
        self.reward_mean = labelled(Gauge("asyncrl_trainer_reward_mean",
                                          "Mean reward of the last batch.", names,
                                          registry=self.registry))
        self.loss = labelled(Gauge("asyncrl_trainer_loss", "Loss of the last update.", names,
                                   registry=self.registry))
        self.eval_accuracy = labelled(Gauge("asyncrl_trainer_eval_accuracy",
                                            "Held-out accuracy at the last evaluation.", names,
                                            registry=self.registry))

    def observe_step(self, record: dict) -> None:
        self.steps.inc()
        self.trained_tokens.inc(record["trained_tokens"])
        self.version.set(record["version"])
        self.step_seconds.observe(record["step_seconds"])
        for value in record["staleness"]:
            self.staleness.observe(value)
        self.reward_mean.set(record["reward_mean"])
        self.loss.set(record["loss"])
        if "eval_accuracy" in record:
            self.eval_accuracy.set(record["eval_accuracy"])

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)
