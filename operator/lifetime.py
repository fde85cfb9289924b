"""A job's lifetime rules, with Kubernetes Job semantics: a failed job's workers stop
(spec.backoffLimit, spec.activeDeadlineSeconds: status.failure, kept until the spec changes),
and a finished job is deleted spec.ttlSecondsAfterFinished after status.completionTime (its
children by garbage collection; the run volume's claim too, unless spec.keepRunVolume left it
unowned). `lifetime_forever` enforces the times without waiting for a watch event."""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime, timezone
from typing import Any, Callable, Mapping

from asyncrl.operator import autoscaling, kube
from asyncrl.spec import RLJob

log = logging.getLogger("asyncrl.operator")

_STAMP = "%Y-%m-%dT%H:%M:%SZ"


def stopped_by_failure(body: Mapping[str, Any]) -> bool:
    """Whether the job failed (status.failure) at its current spec: its workers stay at zero."""
    failure = (body.get("status") or {}).get("failure")
    return bool(failure) and failure.get("generation") == body["metadata"].get("generation")


def as_applied(job: RLJob, body: Mapping[str, Any]) -> RLJob:
    """The job as its children are built now: the rollout replicas the autoscaler set, and
    every worker at zero (as suspended) once it failed."""
    previous = (body.get("status") or {}).get("autoscaling")
    replicas = autoscaling.rollout_replicas(job, autoscaling.settled(job, previous))
    applied = autoscaling.with_rollout_replicas(job, replicas)
    if stopped_by_failure(body) and not job.spec.suspend:
        applied = applied.model_copy(update={"spec": applied.spec.model_copy(
            update={"suspend": True})})
    return applied


def _seconds_since(stamp: str | None, now: datetime) -> float | None:
    if not stamp:
        return None
    return (now - datetime.strptime(stamp, _STAMP).replace(tzinfo=timezone.utc)).total_seconds()


def due_for_deletion(job: RLJob, body: Mapping[str, Any], now: datetime) -> bool:
    """ttlSecondsAfterFinished has passed since the job succeeded or failed."""
    ttl = job.spec.ttl_seconds_after_finished
    since = _seconds_since((body.get("status") or {}).get("completionTime"), now)
    return ttl is not None and since is not None and since >= ttl


def past_deadline(job: RLJob, body: Mapping[str, Any], now: datetime) -> bool:
    """activeDeadlineSeconds has passed since the job started, and it has not finished."""
    status = body.get("status") or {}
    deadline = job.spec.active_deadline_seconds
    since = _seconds_since(status.get("startTime"), now)
    return (deadline is not None and since is not None and since >= deadline
            and status.get("phase") not in ("Succeeded", "Failed"))


def enforce(body: Mapping[str, Any], parse: Callable[[Mapping], RLJob | None],
            reconcile: Callable[[Mapping], Any], now: datetime) -> str | None:
    """One job's times: deleted past its TTL, reconciled (and so failed) past its deadline.
    Returns what was done, for the log."""
    job = parse(body)
    if job is None:
        return None
    meta = body["metadata"]
    if due_for_deletion(job, body, now):
        kube.delete_job(meta["namespace"], meta["name"])
        return (f"deleted: {(body.get('status') or {}).get('phase', 'finished')} since "
                f"{body['status']['completionTime']}, ttlSecondsAfterFinished "
                f"{job.spec.ttl_seconds_after_finished}")
    if past_deadline(job, body, now):
        reconcile(body)
        return f"past activeDeadlineSeconds {job.spec.active_deadline_seconds}: reconciled"
    return None


async def lifetime_forever(interval: float, parse, reconcile, logger) -> None:
    """Every `interval`: each RLJob's TTL and deadline (`enforce`)."""
    while True:
        await asyncio.sleep(interval)
        try:
            bodies = await asyncio.to_thread(kube.list_jobs)
        except Exception as exc:  # noqa: BLE001 - the next pass tries again
            logger.warning(f"listing RLJobs for their lifetime rules failed: {exc}")
            continue
        for body in bodies:
            if body["metadata"].get("deletionTimestamp"):
                continue
            try:
                done = await asyncio.to_thread(enforce, body, parse, reconcile,
                                               datetime.now(timezone.utc))
            except Exception as exc:  # noqa: BLE001 - one job's trouble must not stop others
                logger.warning(f"lifetime of {body['metadata'].get('namespace')}/"
                               f"{body['metadata']['name']}: {exc}")
                continue
            if done:
                logger.info(f"{body['metadata'].get('namespace')}/{body['metadata']['name']}: "
                            f"{done}")
