"""Kueue admission of an RLJob: a job labelled `kueue.x-k8s.io/queue-name` waits in that
LocalQueue until Kueue admits it.

The operator does for an RLJob what Kueue's own job integrations do for a Job: it creates one
Workload (kueue.x-k8s.io/v1beta2) that asks for the pods of the job's workers, owned by the
RLJob (deleted with it), and keeps the workers at zero, as a suspended job's, until Kueue
admits it (`Admitted=True`). Once the job succeeds or fails it marks the Workload
`Finished`, which gives its quota back; once Kueue evicts it (preemption, `spec.active:
false`, a stopped queue) it stops the workers and then clears the reservation, so Kueue queues
it again. Redis and the buffer hold the job's state and run from creation to deletion, as for
a suspended job; they are not in the Workload.

The quota asked is the workers' pods as they run: the trainer's and reward's replicas, and the
rollout's (with rollout.autoscale: its maxReplicas, so the autoscaler never goes above what
was admitted). Kueue's podSets cannot change once created: a spec change that changes them
(replicas, resources, placement) makes a new Workload, and the job queues again.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Mapping

from asyncrl.operator import autoscaling, builders, kube
from asyncrl.operator.builders import OperatorConfig
from asyncrl.operator.status import STAMP
from asyncrl.spec import API_VERSION, KIND, RLJob

log = logging.getLogger("asyncrl.operator")

#: The label that puts a job in a Kueue LocalQueue of its namespace (Kueue's own name for it).
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
API = "/".join(kube.KUEUE_WORKLOADS[:2])
#: On the Workload: the RLJob generation it was made for (a finished one is kept until the
#: spec changes).
GENERATION_ANNOTATION = "asyncrl.io/job-generation"
#: On a Workload the operator deactivated: why (suspend, pods); one it did not deactivate is
#: never activated by it.
DEACTIVATED_ANNOTATION = "asyncrl.io/deactivated-for"
#: The components whose pods the Workload asks for (Redis and the buffer are not in it).
WORKERS = ("trainer", "reward", "rollout")


def queue_name(body: Mapping[str, Any]) -> str | None:
    """The LocalQueue a job waits in, from its label (None: not queued)."""
    return ((body.get("metadata") or {}).get("labels") or {}).get(QUEUE_LABEL) or None


def workload_name(job: RLJob) -> str:
    return f"rljob-{job.metadata.name}"


def as_admitted(job: RLJob) -> RLJob:
    """The job as it runs once admitted: not suspended, and with rollout.autoscale its most
    rollout replicas (what the quota must hold)."""
    autoscale = job.spec.rollout.autoscale
    replicas = autoscale.max_replicas if autoscale is not None else job.spec.rollout.replicas
    running = autoscaling.with_rollout_replicas(job, replicas)
    return running.model_copy(update={"spec": running.spec.model_copy(update={"suspend": False})})


def pod_sets(job: RLJob, config: OperatorConfig) -> list[dict[str, Any]]:
    """The Workload's podSets: one per worker component with pods, its count and a pod
    template that carries what Kueue reads (each container's resources, the node selector and
    tolerations a ResourceFlavor is matched with)."""
    running = as_admitted(job)
    by_component = {
        child["metadata"]["labels"]["app.kubernetes.io/component"]: child
        for child in builders.build_children(running, config, redis_password="")
        if child["kind"] in ("Deployment", "StatefulSet")}
    sets = []
    for component in WORKERS:
        child = by_component.get(component)
        count = (child or {}).get("spec", {}).get("replicas", 0)
        if not count:
            continue
        pod = child["spec"]["template"]["spec"]
        template = {key: pod[key] for key in ("nodeSelector", "tolerations") if pod.get(key)}
        for key in ("initContainers", "containers"):
            if pod.get(key):
                template[key] = [{"name": c["name"], "image": c.get("image", ""),
                                  "resources": c.get("resources") or {}} for c in pod[key]]
        sets.append({"name": component, "count": count, "template": {"spec": template}})
    return sets


def build_workload(job: RLJob, body: Mapping[str, Any], config: OperatorConfig) -> dict[str, Any]:
    """The Workload of a queued job, owned by it (the garbage collector deletes it with the
    job; no finalizer)."""
    meta = body["metadata"]
    return {
        "apiVersion": API, "kind": "Workload",
        "metadata": {
            "name": workload_name(job), "namespace": meta["namespace"],
            "labels": {builders.JOB_LABEL: job.metadata.name},
            "annotations": {GENERATION_ANNOTATION: str(meta.get("generation")),
                            **({DEACTIVATED_ANNOTATION: "suspend"} if job.spec.suspend else {})},
            "ownerReferences": [{"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"],
                                 "uid": meta["uid"], "controller": True,
                                 "blockOwnerDeletion": True}],
        },
        # A suspended job gives its quota back: Kueue evicts an inactive Workload.
        "spec": {"queueName": queue_name(body), "active": not job.spec.suspend,
                 "podSets": pod_sets(job, config)},
    }


# --------------------------------------------------------------------------- what Kueue says


@dataclass(frozen=True)
class Admission:
    """A queued job's Workload as Kueue left it."""

    queue: str
    workload: str
    exists: bool = False
    admitted: bool = False        # Admitted=True and not evicted: the workers may run
    evicted: str | None = None    # Evicted=True: its reason, until the reservation is cleared
    finished: bool = False        # Finished=True: its quota is given back
    cluster_queue: str | None = None
    reason: str = "NoWorkload"
    message: str = ""

    def as_status(self) -> dict[str, Any]:
        """status.queue, as stored (a merge patch drops null fields, so none are written)."""
        status = {"name": self.queue, "workload": self.workload, "admitted": self.admitted}
        if self.cluster_queue is not None:
            status["clusterQueue"] = self.cluster_queue
        return status


def _condition(workload: Mapping[str, Any], kind: str) -> Mapping[str, Any] | None:
    return next((c for c in (workload.get("status") or {}).get("conditions") or []
                 if c.get("type") == kind), None)


def _true(workload: Mapping[str, Any], kind: str) -> bool:
    condition = _condition(workload, kind)
    return condition is not None and condition.get("status") == "True"


def read_admission(queue: str, name: str, workload: Mapping[str, Any] | None) -> Admission:
    """What a Workload (as the API returns it, None when there is none yet) says of its job."""
    if workload is None:
        return Admission(queue, name, message=(
            f"The Workload {name} does not exist yet: is Kueue installed (its "
            f"{API} Workloads), and may the operator create them?"))
    status = workload.get("status") or {}
    finished, evicted = _true(workload, "Finished"), _true(workload, "Evicted")
    reserved, admitted = _true(workload, "QuotaReserved"), _true(workload, "Admitted")
    # What the job's status says: the first of these that holds, else why it waits.
    shown = next((_condition(workload, kind) for kind in ("Finished", "Evicted", "Admitted")
                  if _true(workload, kind)), None) or _condition(workload, "QuotaReserved")
    if shown is None:
        reason, message = "Pending", f"Waiting in LocalQueue {queue} for Kueue to admit it."
    else:
        reason, message = shown.get("reason") or shown["type"], shown.get("message") or ""
    eviction = _condition(workload, "Evicted") if evicted and reserved else None
    return Admission(
        queue, name, exists=True, admitted=admitted and not evicted and not finished,
        evicted=(eviction.get("reason") or "Evicted") if eviction else None,
        finished=finished, cluster_queue=(status.get("admission") or {}).get("clusterQueue"),
        reason=reason, message=message)


def with_admission(body: Mapping[str, Any], admission: Admission | None) -> Mapping[str, Any]:
    """`body` with status.queue as `admission` says (unchanged for a job not queued)."""
    if admission is None:
        return body
    return {**body, "status": {**(body.get("status") or {}), "queue": admission.as_status()}}


def holds(body: Mapping[str, Any]) -> bool:
    """Whether the job's workers stay at zero for its queue: it is queued, and its last status
    does not say it is admitted, or says it finished (its Workload is then marked Finished
    once they have stopped)."""
    if queue_name(body) is None:
        return False
    admitted = ((body.get("status") or {}).get("queue") or {}).get("admitted", False)
    return not admitted or done_at_spec(body)


# --------------------------------------------------------------------------- status writes


def _set(conditions: list[dict], kind: str, status: bool, reason: str, message: str,
         now: str) -> list[dict]:
    """`conditions` with `kind` set (lastTransitionTime moves only when its status does)."""
    value = "True" if status else "False"
    out, found = [], False
    for condition in conditions:
        if condition.get("type") == kind:
            found = True
            moved = condition.get("status") != value
            condition = {**condition, "status": value, "reason": reason, "message": message,
                         "lastTransitionTime": now if moved else condition.get(
                             "lastTransitionTime", now)}
        out.append(condition)
    if not found:
        out.append({"type": kind, "status": value, "reason": reason, "message": message,
                    "lastTransitionTime": now})
    return out


def finished_status(workload: Mapping[str, Any], succeeded: bool, message: str,
                    now: datetime | None = None) -> dict[str, Any]:
    """The Workload's status with `Finished=True`: Kueue gives its quota back."""
    stamp = (now or datetime.now(timezone.utc)).strftime(STAMP)
    conditions = list((workload.get("status") or {}).get("conditions") or [])
    conditions = _set(conditions, "Finished", True, "Succeeded" if succeeded else "Failed",
                      message, stamp)
    return {"conditions": conditions}


def released_status(workload: Mapping[str, Any], now: datetime | None = None) -> dict[str, Any]:
    """The Workload's status once an evicted job's workers stopped: no reservation, no
    admission, and requeued, as Kueue's job integrations leave it; Kueue queues it again (a
    deactivated one once it is active again)."""
    stamp = (now or datetime.now(timezone.utc)).strftime(STAMP)
    eviction = _condition(workload, "Evicted") or {}
    reason, message = eviction.get("reason") or "Evicted", eviction.get("message") or ""
    conditions = list((workload.get("status") or {}).get("conditions") or [])
    conditions = _set(conditions, "QuotaReserved", False, "Pending", message, stamp)
    conditions = _set(conditions, "Admitted", False, "NoReservation",
                      "The workload has no reservation", stamp)
    conditions = _set(conditions, "Requeued", reason in ("Preempted", "NodeFailures"), reason,
                      message, stamp)
    return {"conditions": conditions, "admission": None}


# --------------------------------------------------------------------------- reconciling


def _signature(pod_sets_: list[dict[str, Any]]) -> list[tuple]:
    """What of the podSets asks for quota (the API server may default other fields)."""
    def of(pod_set: dict[str, Any]) -> tuple:
        pod = pod_set["template"]["spec"]
        return (pod_set.get("name"), pod_set.get("count"), pod.get("nodeSelector") or {},
                pod.get("tolerations") or [],
                [(c.get("name"), c.get("resources") or {})
                 for key in ("initContainers", "containers") for c in pod.get(key) or []])
    return [of(pod_set) for pod_set in pod_sets_]


def done_at_spec(body: Mapping[str, Any]) -> bool:
    """Whether the job's last status says it finished at its current spec: it succeeded, or
    failed and was not edited since."""
    status = body.get("status") or {}
    generation = body["metadata"].get("generation")
    if status.get("phase") == "Succeeded":
        return status.get("observedGeneration") == generation
    return status.get("phase") == "Failed" and \
        (status.get("failure") or {}).get("generation") == generation


def sync_workload(job: RLJob, body: Mapping[str, Any], config: OperatorConfig) -> str | None:
    """Brings a queued job's Workload in line with its spec; returns what it did (for the
    log), None when nothing.

    - none yet: created (but for a job that finished at this spec: a Workload deleted after it
      finished, by Kueue's retention policy, is not made again);
    - finished: kept while the job's spec is the one it finished at (the generation it was
      made for); made anew once the spec is edited (a failed job's fix runs again);
    - asking for other pods or another queue than the spec now does (Kueue's pod sets cannot
      change): deactivated first while it holds quota, so that Kueue evicts it and the workers
      stop before the quota goes (asyncrl.operator.reconcile clears the reservation once they
      have), then made anew;
    - `spec.active` false while the job is suspended (a suspended job gives its quota back),
      true again once it is resumed; a Workload someone else deactivated (Kueue's way to stop
      a job) stays so.
    A job whose label is gone has its Workload deleted (status.queue says it had one)."""
    namespace = body["metadata"]["namespace"]
    name = workload_name(job)
    queue = queue_name(body)
    if queue is None:
        if (body.get("status") or {}).get("queue"):
            kube.delete_queue_workload(namespace, name)
            return f"the job left its queue: Workload {name} deleted"
        return None
    wanted = build_workload(job, body, config)
    current = kube.read_queue_workload(namespace, name)
    if current is None:
        if done_at_spec(body):
            return None
        kube.create_queue_workload(wanted)
        return f"Workload {name} created in LocalQueue {queue}"
    made_for = (current["metadata"].get("annotations") or {}).get(GENERATION_ANNOTATION)
    edited = made_for != str(body["metadata"].get("generation"))
    if _true(current, "Finished"):
        if not edited:
            return None
        return _replace(current, wanted, "the job's spec changed after it finished")
    other = (_signature(current["spec"].get("podSets") or []) !=
             _signature(wanted["spec"]["podSets"]) or current["spec"].get("queueName") != queue)
    if other:
        if _true(current, "QuotaReserved"):
            if current["spec"].get("active", True):
                _deactivate(current, "pods")
                return (f"Workload {name} deactivated: the job's pods or queue changed, and its "
                        "workers stop before it is made anew")
            return None
        return _replace(current, wanted, "the job's pods or queue changed")
    active = current["spec"].get("active", True)
    if job.spec.suspend and active:
        _deactivate(current, "suspend")
        return f"Workload {name} deactivated: the job is suspended"
    if not job.spec.suspend and not active and \
            (current["metadata"].get("annotations") or {}).get(DEACTIVATED_ANNOTATION) == "suspend":
        kube.patch_queue_workload(current, {
            "metadata": {"annotations": {DEACTIVATED_ANNOTATION: None}},
            "spec": {"active": True}})
        return f"Workload {name} active again: the job is resumed"
    return None


def _deactivate(workload: Mapping[str, Any], why: str) -> None:
    kube.patch_queue_workload(workload, {
        "metadata": {"annotations": {DEACTIVATED_ANNOTATION: why}}, "spec": {"active": False}})


def _replace(current: Mapping[str, Any], wanted: dict[str, Any], why: str) -> str:
    """A new Workload for `current`; one deactivated by someone else stays inactive."""
    meta = current["metadata"]
    ours = (meta.get("annotations") or {}).get(DEACTIVATED_ANNOTATION) is not None
    if not current["spec"].get("active", True) and not ours:
        wanted = {**wanted, "spec": {**wanted["spec"], "active": False}}
    kube.delete_queue_workload(meta["namespace"], meta["name"])
    kube.create_queue_workload(wanted)
    return f"Workload {meta['name']} made anew: {why}"


def observe_admission(job: RLJob, body: Mapping[str, Any]) -> Admission | None:
    """What Kueue says of a queued job now (None: not queued)."""
    queue = queue_name(body)
    if queue is None:
        return None
    name = workload_name(job)
    return read_admission(queue, name, kube.read_queue_workload(body["metadata"]["namespace"],
                                                                name))


def settle(body: Mapping[str, Any], admission: Admission | None,
           workers_stopped: bool) -> str | None:
    """The Workload's status after the job's, once its workers have stopped: `Finished`
    when the job succeeded or failed (the workers of a finished queued job stop: `holds`);
    the reservation cleared when Kueue evicted it. Returns what it did (for the log), None
    when nothing. A conflict (Kueue wrote in between) waits for the next pass, which the
    Workload's own change brings."""
    from kubernetes.client.rest import ApiException

    if admission is None or not admission.exists or not workers_stopped:
        return None
    status = body.get("status") or {}
    finish = done_at_spec(body) and not admission.finished
    if not (finish or admission.evicted):
        return None
    workload = kube.read_queue_workload(body["metadata"]["namespace"], admission.workload)
    if workload is None:
        return None
    if finish:
        failure = status.get("failure") or {}
        succeeded = status.get("phase") == "Succeeded"
        message = ("The RLJob succeeded." if succeeded else
                   f"The RLJob failed: {failure.get('reason', 'Failed')}.")
        change, done = finished_status(workload, succeeded, message), \
            f"Workload {admission.workload} finished: its quota is given back"
    else:
        change, done = released_status(workload), (
            f"Workload {admission.workload} evicted ({admission.evicted}): its workers "
            "stopped, its reservation cleared")
    try:
        kube.patch_queue_workload_status(workload, change)
    except ApiException as exc:
        if exc.status in (404, 409):
            log.debug("Workload %s changed meanwhile (%s): next pass", admission.workload,
                      exc.status)
            return None
        raise
    return done
