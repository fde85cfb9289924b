"""Reconciling a job: validate its spec, apply every child the builders return, write the
status observed.

Reconciliation is level-based: `reconcile` computes every child from the current spec and
applies it with server-side apply (applying an unchanged object changes nothing), then
recomputes status from what it observes. kopf's handlers run it on create, spec update and
operator start (resume); a child's change runs it again or refreshes only the status
(`reconcile_by_name`); `refresh_figures_forever` refreshes the status of a job whose figures
changed, and `resync_forever` reconciles every RLJob every resync interval, which repairs
drift a watch missed. One reconcile at a time per job.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import secrets
from typing import Any

import kopf
from pydantic import ValidationError

from asyncrl.operator import autoscaling, builders, kube, kueue, lifetime
from asyncrl.operator.observe import (Figures, changed_figures, observe, with_stored_status,
                                     write_status)
from asyncrl.operator.state import OperatorState, job_key
from asyncrl.operator.status import Observation
from asyncrl.spec import API_VERSION, KIND, RLJob, parse_manifest
from asyncrl.spec.errors import describe

log = logging.getLogger("asyncrl.operator")


def job_manifest(body: Any) -> dict[str, Any]:
    """The RLJob manifest of a body as kopf or the API gives it: what the spec parses."""
    meta = body["metadata"]
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": meta["name"], "namespace": meta.get("namespace")},
            "spec": dict(body.get("spec") or {})}


def redis_password(job: RLJob) -> str:
    """The stored generated password, or a new one the first time."""
    if builders.redis_secret(job, "") is None:
        return ""
    data = kube.read_secret_data(job.metadata.namespace, builders.child_name(job, "redis"))
    if data is None:
        return secrets.token_hex(24)
    return base64.b64decode(data["password"]).decode()


def reconcile(state: OperatorState, body: Any, *,
              logger: logging.Logger | logging.LoggerAdapter = log) -> dict:
    """Validate, apply every child, write status. Raises kopf.PermanentError for an invalid
    spec (nothing is created) and kopf.TemporaryError when the API refuses a child.

    kopf's handlers and the resync loop may reconcile the same job at once; one at a time per
    job, so a phase transition is seen (and announced as an Event) once."""
    with state.registry.lock(job_key(body)):
        return _reconcile(state, with_stored_status(body), logger=logger)


def _reconcile(state: OperatorState, body: Any, *,
               logger: logging.Logger | logging.LoggerAdapter) -> dict:
    try:
        job = parse_manifest(job_manifest(body))
    except ValidationError as exc:
        message = describe(exc)
        write_status(body, Observation(generation=body["metadata"].get("generation"),
                                       suspend=False, max_steps=0, invalid=message))
        raise kopf.PermanentError(message) from None

    _sync_queue_workload(state, job, body, logger)
    # The workers follow Kueue's word now (a Workload just made anew holds no quota yet).
    admission = kueue.observe_admission(job, body)
    current = kueue.with_admission(body, admission)
    _apply_children(state, job, current, logger)
    return _write_and_reapply(state, job, body, observe(state, job, body, admission=admission),
                              logger, applied_from=current)


def _sync_queue_workload(state: OperatorState, job: RLJob, body: Any, logger) -> None:
    """A queued job's Kueue Workload (asyncrl.operator.kueue). Without Kueue's CRDs the job
    stays Queued, its status saying why; kopf.TemporaryError when the API refuses otherwise."""
    from kubernetes.client.rest import ApiException

    try:
        done = kueue.sync_workload(job, body, state.config)
        if done:
            logger.info(f"{job.metadata.namespace}/{job.metadata.name}: {done}")
    except ApiException as exc:
        if exc.status == 404:
            log.warning("%s/%s is labelled %s, and Kueue's Workloads are not served here: it "
                        "stays Queued", job.metadata.namespace, job.metadata.name,
                        kueue.QUEUE_LABEL)
            return
        raise kopf.TemporaryError(
            f"the Kueue Workload of a job labelled {kueue.QUEUE_LABEL}: {exc.status} "
            f"{exc.reason}: {kube.api_message(exc)} (is Kueue installed?)", delay=10) from exc


def _applied(job: RLJob, body: Any) -> tuple[int, bool]:
    """What the workloads get from the status: the rollout replicas, and whether the
    workers are stopped (a failed job)."""
    applied = lifetime.as_applied(job, body)
    return applied.spec.rollout.replicas, applied.spec.suspend


def _apply_children(state: OperatorState, job: RLJob, body: Any, logger) -> None:
    """Applies every child as the status says (asyncrl.operator.lifetime.as_applied: the
    autoscaler's rollout replicas, the workers at zero once the job failed). Every child is
    owned by the RLJob but the run volume's claim with spec.keepRunVolume. Raises
    kopf.TemporaryError when the API refuses one."""
    from kubernetes.client.rest import ApiException

    try:
        children = builders.build_children(lifetime.as_applied(job, body), state.config,
                                           redis_password=redis_password(job))
        run_claim = builders.child_name(job, "run")
        for child in children:
            unowned = (job.spec.keep_run_volume and child["kind"] == "PersistentVolumeClaim"
                       and child["metadata"]["name"] == run_claim)
            if not unowned:
                kopf.adopt(child, owner=body)
            kube.apply(child)
        logger.debug(f"applied {len(children)} children")
    except ApiException as exc:
        raise kopf.TemporaryError(f"applying children failed: {exc.status} {exc.reason}: "
                                  f"{kube.api_message(exc)}", delay=5) from exc


def _write_and_reapply(state: OperatorState, job: RLJob, body: Any, observed, logger, *,
                       applied_from: Any = None) -> dict:
    """Writes the status observed; where it changes what the workloads get (the autoscaler
    changed the rollout replicas, the job failed, Kueue admitted or evicted it), the children
    are applied again at once, not at the next reconcile. `applied_from`: the body the
    children were last applied from, when not `body` itself."""
    before = _applied(job, body if applied_from is None else applied_from)
    status = write_status(body, observed)
    times = lifetime.due_times(job, status)
    if any(times):
        state.registry.timers[job_key(body)] = times
    else:
        state.registry.timers.pop(job_key(body), None)
    now = {**body, "status": status}
    if _applied(job, now) != before:
        _apply_children(state, job, now, logger)
    stopped = all(w.replicas == 0 for w in observed.workloads if w.component in kueue.WORKERS)
    done = kueue.settle(now, observed.queue, workers_stopped=stopped)
    if done:
        logger.info(f"{job.metadata.namespace}/{job.metadata.name}: {done}")
    return status


def refresh_status(state: OperatorState, body: Any,
                   figures: Figures | None = None) -> dict | None:
    """The job's status from a fresh observation; children are applied only where the
    autoscaler changed the rollout replicas."""
    try:
        job = parse_manifest(job_manifest(body))
    except ValidationError:
        return None  # an invalid spec's status says so already
    with state.registry.lock(job_key(body)):
        body = with_stored_status(body)
        return _write_and_reapply(state, job, body, observe(state, job, body, figures), log)


def reconcile_by_name(state: OperatorState, namespace: str, name: str, full: bool,
                      figures: Figures | None = None) -> None:
    """The job as stored now: reconciled (`full`), else only its status refreshed."""
    body = kube.read_job(namespace, name)
    if body is None:
        return  # the job is gone; its children go by garbage collection
    if body["metadata"].get("deletionTimestamp"):
        return
    if full:
        try:
            reconcile(state, body)
        except kopf.PermanentError:
            pass  # status already says why
    else:
        refresh_status(state, body, figures)


def resync_all(state: OperatorState) -> None:
    for body in kube.list_jobs():
        if body["metadata"].get("deletionTimestamp"):
            continue
        try:
            reconcile(state, body)
        except kopf.PermanentError:
            pass  # status already says why
        except Exception as exc:  # noqa: BLE001 - one job's trouble must not stop the others
            log.warning("resync of %s/%s: %s", body["metadata"].get("namespace"),
                        body["metadata"]["name"], exc)


# --------------------------------------------------------------------------- periodic work


async def refresh_figures_forever(state: OperatorState, logger) -> None:
    """Every interval: each job's figures from its buffer and trainer (gRPC, no API call);
    a job whose figures changed gets its status refreshed."""
    while True:
        await asyncio.sleep(state.interval)
        if not state.buffer_stats:
            continue
        for key, observed in list(state.registry.observed.items()):
            try:
                job = state.registry.jobs.get(key)
                if job is None:
                    continue
                figures = await asyncio.to_thread(changed_figures, job, observed)
                if figures is not None:
                    logger.debug(f"{key[0]}/{key[1]}: its figures changed")
                    await asyncio.to_thread(reconcile_by_name, state, *key, False, figures)
            except Exception as exc:  # noqa: BLE001 - keep refreshing the others
                logger.warning(f"refreshing {key[0]}/{key[1]}: {exc}")


async def resync_forever(state: OperatorState, logger) -> None:
    """Level-based safety net: every RLJob is reconciled again every resync interval."""
    while True:
        await asyncio.sleep(state.resync_interval)
        try:
            await asyncio.to_thread(resync_all, state)
        except Exception as exc:  # noqa: BLE001 - keep resyncing whatever one pass hit
            logger.warning(f"resync pass failed: {exc}")
