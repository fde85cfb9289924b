"""What the operator keeps in memory, all in one `OperatorState` (one per process:
`asyncrl.operator.handlers.STATE`): its settings, whether the children are watched, and per
job (`JobRegistry`) the lock that makes its reconciles one at a time, the job as last parsed
and as last observed, its buffer's last accepted count, and its children's pending events
(`ChildEvents`). Nothing here talks to the API server; losing it all (a restart) costs only a
fresh observation of each job."""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from asyncrl.operator.autoscaling import AutoscaleMemory
from asyncrl.operator.builders import JOB_LABEL, OperatorConfig
from asyncrl.operator.metrics import OperatorMetrics
from asyncrl.operator.status import Observation, seen_by_controller
from asyncrl.spec import RLJob

log = logging.getLogger("asyncrl.operator")

#: A job by (namespace, name).
JobKey = tuple[str, str]


def job_key(body: Any) -> JobKey:
    return body["metadata"].get("namespace"), body["metadata"]["name"]


#: Children whose status the job's status is made from: a change of theirs only refreshes it.
_OBSERVED = ("Deployment", "StatefulSet", "Pod")


class ChildEvents:
    """Turns watch events of children into work for their job, coalesced: a burst of events
    for one job (a rollout, a deletion of many children) becomes one reconcile. `observed`
    is the registry's last observation of each job (what a workload's status is compared
    with)."""

    def __init__(self, observed: dict[JobKey, Observation], settle_seconds: float = 0.3):
        self.observed = observed
        self.settle_seconds = settle_seconds
        self.pending: dict[JobKey, bool] = {}  # job -> full reconcile (else status)
        #: child uid -> (its job, the generation last seen)
        self.generations: dict[str, tuple[JobKey, int | None]] = {}
        self.pods: dict[str, tuple] = {}  # pod uid -> what its status said
        self._wake: asyncio.Event | None = None

    def note(self, event: dict, body: Any) -> None:
        meta = body["metadata"]
        job = (meta["namespace"], meta["labels"][JOB_LABEL])
        uid, generation = meta.get("uid", ""), meta.get("generation")
        kind, kind_of_event = body.get("kind", ""), event.get("type")
        seen = self.generations.get(uid, (job, None))[1]
        if kind_of_event == "DELETED":
            self.generations.pop(uid, None)
            self.pods.pop(uid, None)
            full = kind != "Pod"  # re-create it (a pod is its workload's to re-create)
        else:
            self.generations[uid] = (job, generation)
            if kind_of_event is None:  # the initial listing: the job's own resume covers it
                return
            changed_spec = seen is not None and generation != seen
            if kind in _OBSERVED:
                full = changed_spec
                if not full and not self._status_moved(job, kind, body):
                    return  # nothing the job's status is made from changed
            else:  # no status of their own: any change of someone else's is drift
                full = kind_of_event == "MODIFIED"
                if kind_of_event == "ADDED":
                    return
        log.debug("%s %s/%s: %s", kind_of_event, kind, meta.get("name"),
                  "reconciling its job" if full else "refreshing its job's status")
        self.pending[job] = self.pending.get(job, False) or full
        if self._wake is not None:
            self._wake.set()

    def _status_moved(self, job: JobKey, kind: str, body: Any) -> bool:
        """Whether what the job's status reads of this child changed: a workload's replica
        counts, a pod's phase, and its containers' (init containers' too: a model download)
        restarts, waiting reason and last exit."""
        status = body.get("status") or {}
        if kind == "Pod":
            containers = (status.get("initContainerStatuses") or []) + \
                (status.get("containerStatuses") or [])
            signature = (status.get("phase"), body["metadata"].get("deletionTimestamp"),
                         tuple((c.get("restartCount"), (c.get("state") or {}).get("waiting"),
                                (c.get("state") or {}).get("terminated"))
                               for c in containers))
            uid = body["metadata"].get("uid", "")
            moved = self.pods.get(uid) != signature
            self.pods[uid] = signature
            return moved
        observed = self.observed.get(job)
        component = body["metadata"]["labels"].get("app.kubernetes.io/component")
        workload = next((w for w in observed.workloads if w.component == component),
                        None) if observed else None
        counts = (status.get("replicas") or 0, status.get("readyReplicas") or 0,
                  status.get("updatedReplicas") or 0,
                  seen_by_controller(status.get("observedGeneration"),
                                     body["metadata"].get("generation")))
        return workload is None or (workload.replicas, workload.ready, workload.updated,
                                    workload.current) != counts

    def forget(self, job: JobKey) -> None:
        self.pending.pop(job, None)
        for uid in [u for u, (owner, _) in self.generations.items() if owner == job]:
            del self.generations[uid]

    async def run(self, work: Callable[[str, str, bool], None], logger) -> None:
        """Forever: once events settle, `work(namespace, name, full)` (in a thread) for each
        job they touched: a full reconcile, or only a status refresh."""
        self._wake = asyncio.Event()
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.settle_seconds)
            self._wake.clear()
            pending, self.pending = self.pending, {}
            for (namespace, name), full in pending.items():
                logger.debug(f"{namespace}/{name}: a child changed, "
                             f"{'reconciling' if full else 'refreshing its status'}")
                try:
                    await asyncio.to_thread(work, namespace, name, full)
                except Exception as exc:  # noqa: BLE001 - one job's trouble must not stop others
                    logger.warning(f"reconciling {namespace}/{name} after a child changed: {exc}")


class JobRegistry:
    """Per-job memory, keyed by (namespace, name); `forget` drops it when the job is deleted."""

    def __init__(self) -> None:
        self._locks: dict[JobKey, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        #: The job as last parsed and what was last observed of it (the figures refresh compares).
        self.jobs: dict[JobKey, RLJob] = {}
        self.observed: dict[JobKey, Observation] = {}
        #: By job uid: its buffer's accepted total and when it was read (samples per second).
        self._accepted: dict[str, tuple[int, float]] = {}
        self.child_events = ChildEvents(self.observed)
        #: With rollout.autoscale: the readings of the autoscaler's window.
        self._autoscale: dict[JobKey, AutoscaleMemory] = {}
        #: When each job is due for deletion (ttlSecondsAfterFinished) and past its deadline
        #: (activeDeadlineSeconds), from its last status (asyncrl.operator.lifetime.due_times).
        self.timers: dict[JobKey, tuple] = {}

    def autoscale_memory(self, key: JobKey) -> AutoscaleMemory:
        return self._autoscale.setdefault(key, AutoscaleMemory())

    def lock(self, key: JobKey) -> threading.Lock:
        """The job's own lock: kopf's handlers, the child watches and the resync may reconcile
        the same job at once."""
        with self._locks_lock:
            return self._locks.setdefault(key, threading.Lock())

    def remember(self, key: JobKey, job: RLJob, observed: Observation) -> None:
        self.jobs[key], self.observed[key] = job, observed

    def accepted_rate(self, uid: str, accepted_total: int, now: float) -> float | None:
        """Samples accepted per second since the last reading of this job's buffer (None for
        the first); remembers this reading for the next."""
        rate = None
        before = self._accepted.get(uid)
        if before is not None and now > before[1]:
            rate = max(0.0, (accepted_total - before[0]) / (now - before[1]))
        self._accepted[uid] = (accepted_total, now)
        return rate

    def forget(self, namespace: str, name: str, uid: str | None) -> None:
        """Drops everything kept in memory about a deleted job."""
        key = (namespace, name)
        with self._locks_lock:
            self._locks.pop(key, None)
        self.jobs.pop(key, None)
        self.observed.pop(key, None)
        self._accepted.pop(uid or name, None)
        self._autoscale.pop(key, None)
        self.timers.pop(key, None)
        self.child_events.forget(key)


def _interval_from_env() -> float:
    return float(os.environ.get("ASYNCRL_OPERATOR_INTERVAL", "10"))


def _resync_interval_from_env() -> float:
    return float(os.environ.get("ASYNCRL_OPERATOR_RESYNC_INTERVAL", "600"))


def _buffer_stats_from_env() -> bool:
    return os.environ.get("ASYNCRL_OPERATOR_BUFFER_STATS", "1") not in ("0", "false", "")


@dataclass
class OperatorState:
    """The operator's settings (from `asyncrl operator`'s flags, else the environment) and
    everything it remembers."""

    #: How to build each job's children (set by `asyncrl operator` before kopf starts).
    config: OperatorConfig = field(default_factory=OperatorConfig)
    #: Seconds between refreshes of each job's figures from its buffer and trainer (gRPC); the
    #: API is written only when the status changes. Children are watched, so nothing else polls.
    interval: float = field(default_factory=_interval_from_env)
    #: Seconds between full reconciles of every RLJob: a safety net behind the watches.
    resync_interval: float = field(default_factory=_resync_interval_from_env)
    #: Ask the job's services for their figures (buffer GetStats, trainer GetStatus); they are
    #: reachable when the operator runs in the cluster.
    buffer_stats: bool = field(default_factory=_buffer_stats_from_env)
    #: Whether kopf's handlers for the children are registered (once per process).
    children_watched: bool = False
    registry: JobRegistry = field(default_factory=JobRegistry)
    #: Served by `asyncrl operator --metrics-port`.
    metrics: OperatorMetrics = field(default_factory=OperatorMetrics)

    def configure(self, config: OperatorConfig, *, interval: float | None = None,
                  resync_interval: float | None = None,
                  buffer_stats: bool | None = None) -> None:
        """Settings from `asyncrl operator`'s flags (read at run time, not at import); None
        keeps the environment's."""
        self.config = config
        if interval is not None:
            self.interval = interval
        if resync_interval is not None:
            self.resync_interval = resync_interval
        if buffer_stats is not None:
            self.buffer_stats = buffer_stats
