"""The operator's own Prometheus metrics (`asyncrl operator --metrics-port`): per autoscaled
job, the rollout autoscaler's signal and decision, so that a HorizontalPodAutoscaler or KEDA
can scale on it (autoscale.scaler: external) and the dashboard can show it."""

from __future__ import annotations

from typing import Any, Mapping

from prometheus_client import CollectorRegistry, Gauge, start_http_server

# `job_namespace`: a scrape adds the operator pod's own `namespace`.
_LABELS = ("job_namespace", "rljob")


class OperatorMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()

        def gauge(name: str, text: str) -> Gauge:
            return Gauge(name, text, _LABELS, registry=self.registry)

        self.replicas = gauge(
            "asyncrl_operator_rollout_replicas",
            "Rollout replicas the job's Deployment gets (the autoscaler's or the spec's).")
        self.wanted = gauge(
            "asyncrl_operator_rollout_wanted_replicas",
            "Rollout replicas the autoscaler's signal asks for, within min/maxReplicas: the "
            "value for an external scaler to follow (KEDA: threshold 1).")
        self.demand = gauge(
            "asyncrl_operator_rollout_demand_ratio",
            "Wanted over current rollout replicas (HorizontalPodAutoscaler: target 1).")
        self.trainer_idle = gauge(
            "asyncrl_operator_trainer_idle_ratio",
            "Share of the autoscaler's last window the trainer waited for a batch.")
        self.rollout_busy = gauge(
            "asyncrl_operator_rollout_busy_ratio",
            "Mean share of the autoscaler's last window a rollout engine generated.")

    def record(self, namespace: str, job: str, replicas: int, wanted: int | None,
               autoscaling: Mapping[str, Any] | None) -> None:
        """One job's figures after an observation; a job without autoscale has none."""
        labels = {"job_namespace": namespace, "rljob": job}
        if autoscaling is None:
            self.forget(namespace, job)
            return
        self.replicas.labels(**labels).set(replicas)
        for gauge, value in ((self.wanted, wanted), (self.demand, autoscaling.get("demand")),
                             (self.trainer_idle, autoscaling.get("trainerIdle")),
                             (self.rollout_busy, autoscaling.get("rolloutBusy"))):
            if value is not None:
                gauge.labels(**labels).set(value)

    def forget(self, namespace: str, job: str) -> None:
        for gauge in (self.replicas, self.wanted, self.demand, self.trainer_idle,
                      self.rollout_busy):
            try:
                gauge.remove(namespace, job)
            except KeyError:
                pass  # no series for it

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        start_http_server(port, addr=host, registry=self.registry)
