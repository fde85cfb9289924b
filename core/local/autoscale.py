"""rollout.autoscale in `asyncrl run`: the operator's rule (asyncrl.algorithms.autoscale) over
the run's own processes. Each tick reads the trainer's waited seconds and each worker's engine
busy seconds, and a decision that changes the replicas starts or stops worker processes (the
highest indices go first; a worker stopped hands its prompts back to the buffer, as a pod
scaled away does). Every change is said on the console and appended to
<run_dir>/autoscale.jsonl; with --metrics the runner serves the operator's autoscaling metrics
(asyncrl_operator_*) from `metrics`."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Callable

from asyncrl.algorithms.autoscale import Decision, Reading, ReadingWindow, decide, window_signals
from asyncrl.operator.autoscaling import wanted_replicas
from asyncrl.operator.metrics import OperatorMetrics

if TYPE_CHECKING:
    from asyncrl.local.runner import LocalJob


class LocalAutoscaler:
    def __init__(self, local: LocalJob, notify: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic):
        self.local = local
        self.spec = local.job.spec.rollout.autoscale
        self.notify = notify
        self.clock = clock
        self.window = ReadingWindow()
        self.last_change: float | None = None
        self.last: Decision | None = None
        #: The operator's autoscaling gauges, for the same dashboard panels.
        self.metrics = OperatorMetrics()

    @property
    def replicas(self) -> int:
        return len(self.local.rollout_workers)

    def tick(self) -> Decision | None:
        """Reads the signals, decides, and applies a change; None while the trainer does not
        answer."""
        status = self.local.trainer_status()
        if status is None:
            return None
        busy = {}
        for worker in self.local.rollout_workers:
            engine = self.local.rollout_status(worker.index)
            if engine is not None:
                busy[f"rollout-{worker.index}"] = engine.busy_seconds_total
        now = self.clock()
        self.window.add(Reading(now, status.waited_seconds_total, status.step, busy))
        since = None if self.last_change is None else now - self.last_change
        decision = decide(self.spec, self.replicas, self.window.first, self.window.last, since)
        self.last = decision
        self._record(decision)
        if decision.scales:
            self._apply(decision)
            self.last_change = now
            self.window.restart()
        return decision

    def _record(self, decision: Decision) -> None:
        """The decision's signal in the operator's gauges (once there is one)."""
        window = self.window
        signals = window_signals(window.first, window.last) if window.first and window.last \
            else None
        figures = {} if signals is None or decision.demand is None else {
            "demand": decision.demand, "trainerIdle": signals.trainer_idle,
            "rolloutBusy": signals.rollout_busy}
        scaling = {"active": True, "replicas": self.replicas, **figures}
        self.metrics.record("", self.local.job.metadata.name, decision.replicas,
                            wanted_replicas(self.local.job, scaling), scaling)

    def _apply(self, decision: Decision) -> None:
        current = self.replicas
        if decision.replicas > current:
            for index in range(current, decision.replicas):
                self.local.start_rollout_worker(index)
        else:
            for index in reversed(range(decision.replicas, current)):
                self.local.stop_rollout_worker(index)
        self.notify(f"autoscale: {decision.message}")
        record = {"time": time.time(), "from": current, "to": decision.replicas,
                  "reason": decision.reason, "demand": round(decision.demand, 4),
                  "message": decision.message}
        with (self.local.run_dir / "autoscale.jsonl").open("a") as out:
            out.write(json.dumps(record) + "\n")
