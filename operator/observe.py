"""Observing a job and writing its status: its workloads and trainer pods as the API shows
them, its figures from its buffer (GetStats) and trainer (GetStatus) over gRPC, and the
status `asyncrl.operator.status` computes from them (a pure function) patched onto the RLJob
only where it changed, with an Event for each phase transition."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Sequence

from asyncrl.operator import autoscaling, builders, kube, kueue, lifetime
from asyncrl.operator.state import OperatorState, job_key
from asyncrl.operator.status import (
    BufferStats,
    Observation,
    TrainerStatus,
    Workload,
    compute_status,
    component_failure,
    model_failure,
    seen_by_controller,
    status_changes,
)
from asyncrl.spec import RLJob

#: The phase a trainer process that is not the leader reports (see trainer.proto).
FOLLOWING = "following"


@dataclass(frozen=True)
class Figures:
    """What the job's buffer and trainer say over gRPC (None where not ready or not asked)."""
    stats: BufferStats | None = None
    stats_error: str | None = None
    trainer: TrainerStatus | None = None
    trainer_error: str | None = None
    #: With rollout.autoscale: each ready rollout pod's engine busy seconds, by pod name.
    rollout_busy: dict[str, float] | None = None


def fetch_figures(job: RLJob, workloads: Sequence[Workload]) -> Figures:
    """Asks only the ready ones: a pod that is not ready answers nothing worth the wait."""
    ready = {w.component for w in workloads if w.ready}
    stats, stats_error = buffer_stats(job) if "buffer" in ready else (None, None)
    trainer, trainer_error = trainer_status(job) if "trainer" in ready else (None, None)
    busy = (rollout_busy(job) if job.spec.rollout.autoscale is not None and "rollout" in ready
            else None)
    return Figures(stats, stats_error, trainer, trainer_error, busy)


def observe(state: OperatorState, job: RLJob, body: Any,
            figures: Figures | None = None, *,
            admission: kueue.Admission | None = None) -> Observation:
    """The job's children as they are now; `figures` when the caller has just fetched them
    (else they are fetched here, if the operator asks the services for them at all)."""
    namespace = job.metadata.namespace
    previous = (body.get("status") or {}).get("autoscaling")
    # Kueue's word now (unless just read): the workers follow it, not the last status.
    if admission is None:
        admission = kueue.observe_admission(job, body)
    # The replicas the workloads have now: the autoscaler's before this observation's
    # decision, none for a failed job's workers or one its queue holds.
    applied = lifetime.as_applied(job, kueue.with_admission(body, admission))
    found = []
    for kind, component in builders.workloads(applied):
        desired = builders.desired_replicas(applied, component)
        workload = kube.read_workload(kind, namespace, builders.child_name(job, component))
        if workload is None:
            found.append(Workload(component, desired))
            continue
        status = workload.status
        found.append(Workload(component, desired, exists=True,
                              replicas=status.replicas or 0,
                              ready=status.ready_replicas or 0,
                              updated=status.updated_replicas or 0,
                              current=seen_by_controller(status.observed_generation,
                                                         workload.metadata.generation)))

    pods = kube.list_pods(namespace, {builders.JOB_LABEL: job.metadata.name})
    trainer_pods = [p for p in pods if (p["metadata"].get("labels") or {}).get(
        "app.kubernetes.io/component") == "trainer"]

    if figures is None:
        figures = fetch_figures(job, found) if state.buffer_stats else Figures()
    rate = None
    if figures.stats is not None:
        uid = body["metadata"].get("uid", job.metadata.name)
        rate = state.registry.accepted_rate(uid, figures.stats.accepted_total, time.monotonic())
    key = job_key(body)
    scaling, scaling_events = autoscaling.next_autoscaling(
        job, previous, state.registry.autoscale_memory(key),
        autoscaling.reading(figures.trainer, figures.rollout_busy), datetime.now(timezone.utc))
    observed = Observation(
        generation=body["metadata"].get("generation"), suspend=job.spec.suspend,
        max_steps=job.spec.algorithm.max_steps, workloads=tuple(found),
        failure=component_failure(pods, job.spec.backoff_limit),
        model_failure=model_failure(trainer_pods, state.config.trainer_max_restarts),
        active_deadline_seconds=job.spec.active_deadline_seconds,
        stats=figures.stats, stats_error=figures.stats_error, samples_per_second=rate,
        trainer=figures.trainer, trainer_error=figures.trainer_error,
        now=datetime.now(timezone.utc), autoscaling=scaling,
        autoscaling_events=tuple(scaling_events), queue=admission)
    state.registry.remember(key, job, observed)
    state.metrics.record(namespace, job.metadata.name,
                         autoscaling.rollout_replicas(job, scaling),
                         autoscaling.wanted_replicas(job, scaling), scaling)
    return observed


def changed_figures(job: RLJob, observed: Observation) -> Figures | None:
    """The job's figures now, if they differ from the last observation's (else None)."""
    figures = fetch_figures(job, observed.workloads)
    # samples/s decays to 0 once nothing more is accepted: one more refresh shows it.
    changed = (figures.stats != observed.stats or figures.trainer != observed.trainer
               or bool(observed.samples_per_second) or figures.rollout_busy is not None)
    return figures if changed else None


# --------------------------------------------------------------------------- figures over gRPC


def buffer_stats(job: RLJob, address: str | None = None,
                 timeout: float = 1.0) -> tuple[BufferStats | None, str | None]:
    """GetStats from the job's buffer: by default its Service's cluster DNS name, which
    resolves when the operator runs in the cluster. Returns (stats, None) or (None, why)."""
    import grpc

    from asyncrl.v1 import buffer_pb2, buffer_pb2_grpc

    address = address or (f"{builders.child_name(job, 'buffer')}.{job.metadata.namespace}.svc:"
                           f"{builders.BUFFER_PORT}")
    try:
        with grpc.insecure_channel(address) as channel:
            reply = buffer_pb2_grpc.BufferStub(channel).GetStats(
                buffer_pb2.GetStatsRequest(job=job.metadata.name), timeout=timeout)
    except grpc.RpcError as exc:
        return None, f"{address}: {exc.code().name}"
    return BufferStats(reply.trainer_version, reply.trainer_step, reply.accepted_total,
                       reply.consumed_total, tuple(reply.staleness_counts),
                       reply.trainer_finished), None


def trainer_status(job: RLJob, addresses: list[str] | None = None,
                   timeout: float = 1.0) -> tuple[TrainerStatus | None, str | None]:
    """GetStatus from the job's trainer. Each trainer pod serves the status of its first
    process, and only the leader (global rank 0, on whichever pod the rendezvous made it) has
    figures; the others report phase "following". By default the pods are asked in order
    through the headless Service's cluster DNS names (pod 0 first), which resolve when the
    operator runs in the cluster. Returns (status, None) or (None, why)."""
    import grpc

    from asyncrl.v1 import trainer_pb2, trainer_pb2_grpc

    if addresses is None:
        headless = f"{builders.child_name(job, 'trainer-headless')}.{job.metadata.namespace}.svc"
        addresses = [f"{builders.child_name(job, 'trainer')}-{pod}.{headless}:"
                     f"{builders.TRAINER_PORT}" for pod in range(job.spec.trainer.replicas)]
    problems = []
    for address in addresses:
        try:
            with grpc.insecure_channel(address) as channel:
                reply = trainer_pb2_grpc.TrainerStatusServiceStub(channel).GetStatus(
                    trainer_pb2.GetTrainerStatusRequest(), timeout=timeout)
        except grpc.RpcError as exc:
            problems.append(f"{address}: {exc.code().name}")
            continue
        if reply.phase == FOLLOWING:
            problems.append(f"{address}: a following rank")
            continue
        return TrainerStatus(
            step=reply.step, phase=reply.phase,
            tokens_per_second=reply.trained_tokens_per_second, reward_mean=reply.reward_mean,
            eval_accuracy=reply.eval_accuracy if reply.eval_accuracy >= 0 else None,
            eval_stderr=reply.eval_stderr if reply.eval_stderr >= 0 else None,
            waited_seconds_total=reply.waited_seconds_total), None
    return None, "; ".join(problems)


def rollout_busy(job: RLJob, addresses: dict[str, str] | None = None,
                 timeout: float = 1.0) -> dict[str, float]:
    """Each ready rollout pod's engine busy seconds (RolloutControl.GetStatus), by pod name;
    a pod that does not answer is left out. By default the pods are asked at their IPs, which
    the operator reaches when it runs in the cluster (no policy limits the rollout pods'
    ingress)."""
    import grpc

    from asyncrl.v1 import rollout_pb2, rollout_pb2_grpc

    if addresses is None:
        pods = kube.list_pods(job.metadata.namespace, builders.selector_labels(job, "rollout"))
        addresses = {pod["metadata"]["name"]: f"{pod['status']['podIP']}:{builders.ROLLOUT_GRPC}"
                     for pod in pods if _ready(pod) and (pod.get("status") or {}).get("podIP")}
    busy = {}
    for name, address in addresses.items():
        try:
            with grpc.insecure_channel(address) as channel:
                reply = rollout_pb2_grpc.RolloutControlStub(channel).GetStatus(
                    rollout_pb2.GetStatusRequest(), timeout=timeout)
        except grpc.RpcError:
            continue
        busy[name] = reply.busy_seconds_total
    return busy


def _ready(pod: dict) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


# --------------------------------------------------------------------------- status + events


def write_status(body: Any, observed: Observation) -> dict:
    """Recompute status; patch only what changed; an Event for each phase transition. `body`
    carries the status as stored now (with_stored_status, under the job's lock): what changed,
    and which transitions to announce, are measured against it."""
    current = dict(body.get("status") or {})
    new = compute_status(observed, current)
    changes = status_changes(current, new)
    meta = body["metadata"]
    if changes:
        kube.patch_job_status(meta["namespace"], meta["name"], changes)
    old_phase, phase = current.get("phase"), new["phase"]
    if phase != old_phase:
        warning = phase == "Failed"
        reason = next((c["reason"] for c in new["conditions"]
                       if c["status"] == ("False" if c["type"] == "Valid" else "True")
                       and c["type"] in ("Valid", "Failed")), phase) if warning else phase
        message = next((c["message"] for c in new["conditions"] if c["reason"] == reason),
                       f"Phase {old_phase or 'none'} -> {phase}.")
        kube.post_event(body, reason, message, warning=warning)
    for event in observed.autoscaling_events:
        kube.post_event(body, event.reason, event.message)
    return new


def with_stored_status(body: Any) -> dict:
    """`body` with its status as stored now. A kopf handler gets the body of the event that
    started it, and may have waited for the job's lock meanwhile while another reconcile
    wrote a new status: decided again from the old one, an autoscaling decision already
    taken would be taken twice (and its Event posted twice)."""
    return {**body, "status": stored_status(body)}


def stored_status(body: Any) -> dict:
    """The status as stored now: `body` may predate a reconcile that just finished."""
    meta = body["metadata"]
    stored = kube.read_job(meta["namespace"], meta["name"])
    if stored is None:
        stored = body
    return dict(stored.get("status") or {})
