"""A job's lifetime rules, with Kubernetes Job semantics: a failed job's workers stop
(spec.backoffLimit, spec.activeDeadlineSeconds: status.failure, kept until the spec changes),
and a finished job is deleted spec.ttlSecondsAfterFinished after status.completionTime (its
children by garbage collection; the run volume's claim too, unless spec.keepRunVolume left it
unowned). `lifetime_forever` enforces the times without waiting for a watch event, from the
times each job's last status gave (no API call for an idle job)."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Mapping

from asyncrl.operator import autoscaling, kube, kueue
from asyncrl.operator.status import parse_stamp
from asyncrl.spec import RLJob

log = logging.getLogger("asyncrl.operator")


def stopped_by_failure(body: Mapping[str, Any]) -> bool:
    """Whether the job failed (status.failure) at its current spec: its workers stay at zero."""
    failure = (body.get("status") or {}).get("failure")
    return bool(failure) and failure.get("generation") == body["metadata"].get("generation")


def as_applied(job: RLJob, body: Mapping[str, Any]) -> RLJob:
    """The job as its children are built now: the rollout replicas the autoscaler set, and
    every worker at zero (as suspended) once it failed, and while its Kueue queue holds it
    (asyncrl.operator.kueue.holds)."""
    previous = (body.get("status") or {}).get("autoscaling")
    replicas = autoscaling.rollout_replicas(job, autoscaling.settled(job, previous))
    applied = autoscaling.with_rollout_replicas(job, replicas)
    if (stopped_by_failure(body) or kueue.holds(body)) and not job.spec.suspend:
        applied = applied.model_copy(update={"spec": applied.spec.model_copy(
            update={"suspend": True})})
    return applied


def _parse(stamp: str | None) -> datetime | None:
    return parse_stamp(stamp) if stamp else None


def due_times(job: RLJob, status: Mapping[str, Any]) -> tuple[datetime | None, datetime | None]:
    """(when the RLJob is to be deleted: completionTime + ttlSecondsAfterFinished, when it is
    past its deadline: startTime + activeDeadlineSeconds), each None where it does not apply.
    The operator keeps them in memory (JobRegistry.timers), so an idle job costs no API call."""
    delete_at = deadline_at = None
    completed, started = _parse(status.get("completionTime")), _parse(status.get("startTime"))
    if completed and job.spec.ttl_seconds_after_finished is not None:
        delete_at = completed + timedelta(seconds=job.spec.ttl_seconds_after_finished)
    if started and job.spec.active_deadline_seconds and \
            status.get("phase") not in ("Succeeded", "Failed"):
        deadline_at = started + timedelta(seconds=job.spec.active_deadline_seconds)
    return delete_at, deadline_at


def enforce(key: tuple[str, str], delete_at: datetime | None, deadline_at: datetime | None,
            reconcile_by_name: Callable[[str, str], Any], now: datetime) -> str | None:
    """One job's times: deleted past its TTL, reconciled (and so failed) past its deadline.
    Returns what was done, for the log."""
    namespace, name = key
    if delete_at is not None and now >= delete_at:
        kube.delete_job(namespace, name)
        return f"deleted: finished, and ttlSecondsAfterFinished passed at {delete_at:%H:%M:%S}"
    if deadline_at is not None and now >= deadline_at:
        reconcile_by_name(namespace, name)
        return f"activeDeadlineSeconds passed at {deadline_at:%H:%M:%S}: reconciled"
    return None


async def lifetime_forever(interval: float, timers: dict, reconcile_by_name, logger) -> None:
    """Every `interval`: each job's TTL and deadline (`enforce`), from the times its last
    status gave (`timers`, by job)."""
    while True:
        await asyncio.sleep(interval)
        now = datetime.now(timezone.utc)
        for key, (delete_at, deadline_at) in list(timers.items()):
            try:
                done = await asyncio.to_thread(enforce, key, delete_at, deadline_at,
                                               reconcile_by_name, now)
            except Exception as exc:  # noqa: BLE001 - one job's trouble must not stop others
                logger.warning(f"lifetime of {key[0]}/{key[1]}: {exc}")
                continue
            if done:
                if done.startswith("deleted"):
                    timers.pop(key, None)
                logger.info(f"{key[0]}/{key[1]}: {done}")
