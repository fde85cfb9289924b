"""Prometheus metrics of the buffer.

The job's totals live in Redis (shared by every buffer replica), so they are exported from the
latest `Stats` read rather than counted in-process: every replica reports the same, true figures.
Every series carries the job's name as its `rljob` label (a buffer may serve several jobs; not
`job`, which Prometheus sets itself). Names carry their unit (`_groups`, `_slots`, `_versions`,
`_total` for counters); the Grafana dashboard queries exactly these names.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from asyncrl.buffer.store import Stats

_TOTALS = (
    ("accepted_groups", "accepted_total", "Groups accepted into the buffer."),
    ("consumed_groups", "consumed_total", "Groups the trainer acknowledged."),
    ("dropped_stale_groups", "dropped_stale_total", "Groups dropped as staler than the bound."),
    ("redelivered_batches", "redelivered_total", "Batches delivered again after no ack."),
    ("expired_slots", "expired_slots_total", "Rollout slots whose lease expired."),
)


class BufferMetrics:
    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=False)
        self._stats: dict[str, Stats] = {}
        self.registry.register(self)

    def observe_stats(self, job: str, stats: Stats) -> None:
        self._stats[job] = stats

    def collect(self):
        depth = GaugeMetricFamily("asyncrl_buffer_depth_groups", "Accepted groups not yet batched.",
                                  labels=["rljob"])
        running = GaugeMetricFamily("asyncrl_buffer_running_slots", "Granted rollout slots.",
                                    labels=["rljob"])
        version = GaugeMetricFamily("asyncrl_buffer_trainer_version",
                                    "Trainer version the gate uses.", labels=["rljob"])
        totals = {
            key: CounterMetricFamily(f"asyncrl_buffer_{name}", help_text, labels=["rljob"])
            for name, key, help_text in _TOTALS
        }
        staleness = HistogramMetricFamily(
            "asyncrl_buffer_consumed_staleness_versions",
            "Staleness (trainer version - oldest token version) of consumed groups.",
            labels=["rljob"],
        )
        for job, stats in self._stats.items():
            depth.add_metric([job], stats.depth_groups)
            running.add_metric([job], stats.running_slots)
            version.add_metric([job], stats.trainer_version)
            for key, family in totals.items():
                family.add_metric([job], getattr(stats, key))
            cumulative, buckets = 0, []
            for bound, count in enumerate(stats.staleness_counts):
                cumulative += count
                buckets.append((str(bound), cumulative))
            buckets.append(("+Inf", cumulative))
            total = sum(i * c for i, c in enumerate(stats.staleness_counts))
            staleness.add_metric([job], buckets, total)
        yield from (depth, running, version, *totals.values(), staleness)

    def serve(self, port: int, host: str = "127.0.0.1") -> None:
        start_http_server(port, addr=host, registry=self.registry)
