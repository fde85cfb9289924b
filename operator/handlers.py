"""kopf handlers for RLJob: validate, adopt and apply what the builders return, keep status.

Reconciliation is level-based: `reconcile` computes every child from the current spec and
applies it with server-side apply (applying an unchanged object changes nothing), then
recomputes status from what it observes. It runs on create, spec update and operator start
(resume), and a resync loop runs it for every RLJob every `ASYNCRL_OPERATOR_INTERVAL`
seconds, which repairs drift (a deleted child comes back) and refreshes the training figures.
The loop is operator-wide rather than a kopf timer so that RLJobs carry no finalizer: deletion
is the garbage collector's job, through owner references, even while the operator is down.

Import this module (or run `asyncrl operator`) to register the handlers with kopf.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Sequence

import kopf
from pydantic import ValidationError

import asyncrl
from asyncrl.operator import builders
from asyncrl.operator.builders import OperatorConfig
from asyncrl.operator.status import (
    BufferStats,
    Observation,
    TrainerStatus,
    Workload,
    compute_status,
    seen_by_controller,
    status_changes,
    trainer_failure,
)
from asyncrl.spec import API_VERSION, GROUP, KIND, PLURAL, VERSION, RLJob, parse_manifest
from asyncrl.spec.errors import describe

FIELD_MANAGER = "asyncrl-operator"
USER_AGENT = "asyncrl-operator"
#: Seconds between refreshes of each job's figures from its buffer and trainer (gRPC); the API
#: is written only when the status changes. Children are watched, so nothing else polls.
INTERVAL = float(os.environ.get("ASYNCRL_OPERATOR_INTERVAL", "10"))
#: Seconds between full reconciles of every RLJob: a safety net behind the watches.
RESYNC_INTERVAL = float(os.environ.get("ASYNCRL_OPERATOR_RESYNC_INTERVAL", "600"))
#: Ask the job's services for their figures (buffer GetStats, trainer GetStatus); they are
#: reachable when the operator runs in the cluster.
BUFFER_STATS = os.environ.get("ASYNCRL_OPERATOR_BUFFER_STATS", "1") not in ("0", "false", "")

log = logging.getLogger("asyncrl.operator")

#: Set by `asyncrl operator` before kopf starts.
CONFIG = OperatorConfig()


def configure_operator(config: OperatorConfig, *, interval: float | None = None,
                       resync_interval: float | None = None,
                       buffer_stats: bool | None = None) -> None:
    """Settings from `asyncrl operator`'s flags (read at run time, not at import)."""
    global CONFIG, INTERVAL, RESYNC_INTERVAL, BUFFER_STATS
    CONFIG = config
    if interval is not None:
        INTERVAL = interval
    if resync_interval is not None:
        RESYNC_INTERVAL = resync_interval
    if buffer_stats is not None:
        BUFFER_STATS = buffer_stats
    _watch_children(network_policies=config.network_policies)


# --------------------------------------------------------------------------- API access

_client_lock = threading.Lock()
_api_client = None


def api_client():
    """One kubernetes ApiClient: in-cluster credentials, else the current kubeconfig."""
    global _api_client
    with _client_lock:
        if _api_client is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            _api_client = client.ApiClient()
            # Named in the API server's audit log and metrics (kopf's own calls say kopf/...).
            _api_client.user_agent = f"{USER_AGENT}/{asyncrl.__version__}"
        return _api_client


def _core():
    from kubernetes import client

    return client.CoreV1Api(api_client())


def _apps():
    from kubernetes import client

    return client.AppsV1Api(api_client())


def _custom():
    from kubernetes import client

    return client.CustomObjectsApi(api_client())


_dynamic = None


def apply(obj: dict[str, Any]) -> None:
    """Server-side apply of any child, by its apiVersion and kind (the kubernetes client's
    dynamic client finds the resource): created or converged; unchanged objects stay
    untouched."""
    global _dynamic
    from kubernetes.dynamic import DynamicClient

    client = api_client()
    with _client_lock:
        if _dynamic is None:
            _dynamic = DynamicClient(client)
    resource = _dynamic.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
    _dynamic.server_side_apply(resource, body=obj, namespace=obj["metadata"]["namespace"],
                               field_manager=FIELD_MANAGER, force_conflicts=True)


# --------------------------------------------------------------------------- reconcile


def _manifest(body: Any) -> dict[str, Any]:
    meta = body["metadata"]
    return {"apiVersion": API_VERSION, "kind": KIND,
            "metadata": {"name": meta["name"], "namespace": meta.get("namespace")},
            "spec": dict(body.get("spec") or {})}


def _redis_password(job: RLJob) -> str:
    """The stored generated password, or a new one the first time."""
    from kubernetes.client.rest import ApiException

    if builders.redis_secret(job, "") is None:
        return ""
    try:
        secret = _core().read_namespaced_secret(builders.child_name(job, "redis"),
                                                job.metadata.namespace)
    except ApiException as exc:
        if exc.status == 404:
            return secrets.token_hex(24)
        raise
    return base64.b64decode((secret.data or {})["password"]).decode()


# Per-job memory, keyed by (namespace, name); `forget` drops it when the job is deleted.
_job_locks: dict[tuple[str, str], threading.Lock] = {}
_job_locks_lock = threading.Lock()
#: The job as last parsed and what was last observed of it (the figures refresh compares).
_jobs: dict[tuple[str, str], RLJob] = {}
_observed: dict[tuple[str, str], Observation] = {}


def _key(body: Any) -> tuple[str, str]:
    return body["metadata"].get("namespace"), body["metadata"]["name"]


def _job_lock(body: Any) -> threading.Lock:
    with _job_locks_lock:
        return _job_locks.setdefault(_key(body), threading.Lock())


def forget(namespace: str, name: str, uid: str | None) -> None:
    """Drops everything kept in memory about a deleted job."""
    key = (namespace, name)
    with _job_locks_lock:
        _job_locks.pop(key, None)
    _jobs.pop(key, None)
    _observed.pop(key, None)
    _accepted.pop(uid or name, None)
    _CHILD_EVENTS.forget(key)


def reconcile(body: Any, *, logger: logging.Logger | logging.LoggerAdapter = log) -> dict:
    """Validate, apply every child, write status. Raises kopf.PermanentError for an invalid
    spec (nothing is created) and kopf.TemporaryError when the API refuses a child.

    kopf's handlers and the resync loop may reconcile the same job at once; one at a time per
    job, so a phase transition is seen (and announced as an Event) once."""
    with _job_lock(body):
        return _reconcile(body, logger=logger)


def _reconcile(body: Any, *, logger: logging.Logger | logging.LoggerAdapter) -> dict:
    from kubernetes.client.rest import ApiException

    try:
        job = parse_manifest(_manifest(body))
    except ValidationError as exc:
        message = describe(exc)
        _write_status(body, Observation(generation=body["metadata"].get("generation"),
                                        suspend=False, max_steps=0, invalid=message))
        raise kopf.PermanentError(message) from None

    try:
        children = builders.build_children(job, CONFIG, redis_password=_redis_password(job))
        for child in children:
            kopf.adopt(child, owner=body)
            apply(child)
        logger.debug(f"applied {len(children)} children")
    except ApiException as exc:
        raise kopf.TemporaryError(f"applying children failed: {exc.status} {exc.reason}: "
                                  f"{_api_message(exc)}", delay=5) from exc
    return _write_status(body, observe(job, body))


def _api_message(exc) -> str:
    import json

    try:
        return json.loads(exc.body).get("message", "")
    except (TypeError, ValueError):
        return str(exc.body)[:300]


# --------------------------------------------------------------------------- observe

_accepted: dict[str, tuple[int, float]] = {}


@dataclass(frozen=True)
class Figures:
    """What the job's buffer and trainer say over gRPC (None where not ready or not asked)."""
    stats: BufferStats | None = None
    stats_error: str | None = None
    trainer: TrainerStatus | None = None
    trainer_error: str | None = None


def fetch_figures(job: RLJob, workloads: Sequence[Workload]) -> Figures:
    """Asks only the ready ones: a pod that is not ready answers nothing worth the wait."""
    if not BUFFER_STATS:
        return Figures()
    ready = {w.component for w in workloads if w.ready}
    stats, stats_error = buffer_stats(job) if "buffer" in ready else (None, None)
    trainer, trainer_error = trainer_status(job) if "trainer" in ready else (None, None)
    return Figures(stats, stats_error, trainer, trainer_error)


def observe(job: RLJob, body: Any, figures: Figures | None = None) -> Observation:
    """The job's children as they are now; `figures` when the caller has just fetched them."""
    from kubernetes.client.rest import ApiException

    namespace = job.metadata.namespace
    found = []
    for kind, component in builders.workloads(job):
        name = builders.child_name(job, component)
        desired = builders.desired_replicas(job, component)
        # The object itself (not its /status subresource): the chart's RBAC grants `get` on
        # the workloads and nothing on their subresources.
        read = (_apps().read_namespaced_deployment if kind == "Deployment"
                else _apps().read_namespaced_stateful_set)
        try:
            workload = read(name, namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            found.append(Workload(component, desired))
            continue
        status = workload.status
        found.append(Workload(component, desired, exists=True,
                              replicas=status.replicas or 0,
                              ready=status.ready_replicas or 0,
                              updated=status.updated_replicas or 0,
                              current=seen_by_controller(status.observed_generation,
                                                         workload.metadata.generation)))

    selector = ",".join(f"{k}={v}" for k, v in builders.selector_labels(job, "trainer").items())
    pods = _core().list_namespaced_pod(namespace, label_selector=selector).items
    failure = trainer_failure([api_client().sanitize_for_serialization(p) for p in pods],
                              CONFIG.trainer_max_restarts)

    figures = figures or fetch_figures(job, found)
    rate = None
    if figures.stats is not None:
        uid = body["metadata"].get("uid", job.metadata.name)
        now = time.monotonic()
        before = _accepted.get(uid)
        if before is not None and now > before[1]:
            rate = max(0.0, (figures.stats.accepted_total - before[0]) / (now - before[1]))
        _accepted[uid] = (figures.stats.accepted_total, now)
    observed = Observation(
        generation=body["metadata"].get("generation"), suspend=job.spec.suspend,
        max_steps=job.spec.algorithm.max_steps, workloads=tuple(found), trainer_failure=failure,
        stats=figures.stats, stats_error=figures.stats_error, samples_per_second=rate,
        trainer=figures.trainer, trainer_error=figures.trainer_error,
        now=datetime.now(timezone.utc))
    _jobs[_key(body)], _observed[_key(body)] = job, observed
    return observed


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


#: The phase a trainer process that is not the leader reports (see trainer.proto).
FOLLOWING = "following"


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
            eval_accuracy=reply.eval_accuracy if reply.eval_accuracy >= 0 else None), None
    return None, "; ".join(problems)


# --------------------------------------------------------------------------- status + events


def _write_status(body: Any, observed: Observation) -> dict:
    """Recompute status; patch only what changed; an Event for each phase transition."""
    current = _stored_status(body)
    new = compute_status(observed, current)
    changes = status_changes(current, new)
    meta = body["metadata"]
    if changes:
        _custom().patch_namespaced_custom_object_status(
            GROUP, VERSION, meta["namespace"], PLURAL, meta["name"], {"status": changes},
            _content_type="application/merge-patch+json")
    old_phase, phase = current.get("phase"), new["phase"]
    if phase != old_phase:
        warning = phase == "Failed"
        reason = next((c["reason"] for c in new["conditions"]
                       if c["status"] == ("False" if c["type"] == "Valid" else "True")
                       and c["type"] in ("Valid", "Failed")), phase) if warning else phase
        message = next((c["message"] for c in new["conditions"] if c["reason"] == reason),
                       f"Phase {old_phase or 'none'} -> {phase}.")
        post_event(body, reason, message, warning=warning)
    return new


def _stored_status(body: Any) -> dict:
    """The status as stored now: `body` may predate a reconcile that just finished."""
    from kubernetes.client.rest import ApiException

    meta = body["metadata"]
    try:
        stored = _custom().get_namespaced_custom_object(GROUP, VERSION, meta["namespace"], PLURAL,
                                                        meta["name"])
    except ApiException as exc:
        if exc.status != 404:
            raise
        stored = body
    return dict(stored.get("status") or {})


def post_event(body: Any, reason: str, message: str, *, warning: bool = False) -> None:
    """A core/v1 Event about the RLJob (what `kubectl describe rljob` shows).

    Not `kopf.event`: kopf (1.45) queues events only inside its own per-object handler tasks
    (`posting.event_queue_var`), while most phase transitions are seen by the child-watch,
    figures and resync tasks outside them, where `kopf.event` raises LookupError. One path
    for every transition, posted right here, keeps them alike."""
    from kubernetes.client.rest import ApiException

    meta = body["metadata"]
    now = datetime.now(timezone.utc)
    event = {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {"apiVersion": API_VERSION, "kind": KIND, "name": meta["name"],
                           "namespace": meta["namespace"], "uid": meta.get("uid")},
        "reason": reason, "message": message[:1024], "type": "Warning" if warning else "Normal",
        "source": {"component": FIELD_MANAGER}, "reportingComponent": FIELD_MANAGER,
        "reportingInstance": FIELD_MANAGER,
        "firstTimestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "lastTimestamp": now.strftime("%Y-%m-%dT%H:%M:%SZ"), "count": 1,
    }
    try:
        _core().create_namespaced_event(meta["namespace"], event)
    except ApiException as exc:  # events are best effort
        log.warning("could not post event %s for %s: %s", reason, meta["name"], exc.reason)


# --------------------------------------------------------------------------- kopf wiring


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger, **_) -> None:
    # The CRD's status schema is strict (kopf's own status fields would be pruned), so kopf
    # keeps its bookkeeping in annotations.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.posting.enabled = False  # Events are posted by `post_event`, for phase transitions.
    settings.watching.server_timeout = 300
    memo.tasks = [asyncio.create_task(_resync_forever(logger)),
                  asyncio.create_task(_CHILD_EVENTS.run(logger)),
                  asyncio.create_task(_refresh_figures_forever(logger))]


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_) -> None:
    for task in memo.get("tasks", []):
        task.cancel()


@kopf.on.resume(GROUP, VERSION, PLURAL, id="reconcile-on-resume")
@kopf.on.create(GROUP, VERSION, PLURAL, id="reconcile-on-create")
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec", id="reconcile-on-update")
def reconcile_handler(body: kopf.Body, logger, **_) -> None:
    # Returns nothing: kopf would store a result under status, which the CRD's schema prunes.
    reconcile(body, logger=logger)


@kopf.on.event(GROUP, VERSION, PLURAL, id="forget-deleted-jobs")
def forget_deleted_job(event: dict, body: kopf.Body, **_) -> None:
    """A deleted job's per-job state goes with it (its children go by garbage collection)."""
    if event.get("type") == "DELETED":
        forget(body["metadata"].get("namespace"), body["metadata"]["name"],
               body["metadata"].get("uid"))


# --------------------------------------------------------------------------- child watches

#: The children watched, by kopf resource name; Secrets are not (an operator able to list
#: every Secret of the cluster is more than this one needs; the safety-net resync repairs them).
_CHILD_RESOURCES = ("deployments", "statefulsets", "services", "configmaps",
                    "persistentvolumeclaims")
#: Children whose status the job's status is made from: a change of theirs only refreshes it.
_OBSERVED = ("Deployment", "StatefulSet", "Pod")


class ChildEvents:
    """Turns watch events of children into work for their job, coalesced: a burst of events
    for one job (a rollout, a deletion of many children) becomes one reconcile."""

    def __init__(self, settle_seconds: float = 0.3):
        self.settle_seconds = settle_seconds
        self.pending: dict[tuple[str, str], bool] = {}  # job -> full reconcile (else status)
        #: child uid -> (its job, the generation last seen)
        self.generations: dict[str, tuple[tuple[str, str], int | None]] = {}
        self.pods: dict[str, tuple] = {}  # trainer pod uid -> what its status said
        self._wake: asyncio.Event | None = None

    def note(self, event: dict, body: Any) -> None:
        meta = body["metadata"]
        job = (meta["namespace"], meta["labels"][builders.JOB_LABEL])
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

    def _status_moved(self, job: tuple[str, str], kind: str, body: Any) -> bool:
        """Whether what the job's status reads of this child changed: a workload's replica
        counts, a trainer pod's phase, restarts and waiting reason."""
        status = body.get("status") or {}
        if kind == "Pod":
            signature = (status.get("phase"), body["metadata"].get("deletionTimestamp"),
                         tuple((c.get("restartCount"), (c.get("state") or {}).get("waiting"))
                               for c in status.get("containerStatuses") or []))
            uid = body["metadata"].get("uid", "")
            moved = self.pods.get(uid) != signature
            self.pods[uid] = signature
            return moved
        observed = _observed.get(job)
        component = body["metadata"]["labels"].get("app.kubernetes.io/component")
        workload = next((w for w in observed.workloads if w.component == component),
                        None) if observed else None
        counts = (status.get("replicas") or 0, status.get("readyReplicas") or 0,
                  status.get("updatedReplicas") or 0,
                  seen_by_controller(status.get("observedGeneration"),
                                     body["metadata"].get("generation")))
        return workload is None or (workload.replicas, workload.ready, workload.updated,
                                    workload.current) != counts

    def forget(self, job: tuple[str, str]) -> None:
        self.pending.pop(job, None)
        for uid in [u for u, (owner, _) in self.generations.items() if owner == job]:
            del self.generations[uid]

    async def run(self, logger) -> None:
        self._wake = asyncio.Event()
        while True:
            await self._wake.wait()
            await asyncio.sleep(self.settle_seconds)
            self._wake.clear()
            work, self.pending = self.pending, {}
            for (namespace, name), full in work.items():
                logger.debug(f"{namespace}/{name}: a child changed, "
                             f"{'reconciling' if full else 'refreshing its status'}")
                try:
                    await asyncio.to_thread(_reconcile_by_name, namespace, name, full)
                except Exception as exc:  # noqa: BLE001 - one job's trouble must not stop others
                    logger.warning(f"reconciling {namespace}/{name} after a child changed: {exc}")


_CHILD_EVENTS = ChildEvents()


async def _on_child_event(event: dict, body: kopf.Body, **_) -> None:
    _CHILD_EVENTS.note(event, body)


_children_watched = False


def _watch_children(*, network_policies: bool) -> None:
    """kopf handlers for every kind of child, filtered by our job label (so a cluster's other
    objects are never listed), and for trainer pods (their restarts make a job Failed)."""
    global _children_watched
    if _children_watched:  # once per process
        return
    _children_watched = True
    resources = _CHILD_RESOURCES + (("networkpolicies",) if network_policies else ())
    for resource in resources:
        kopf.on.event(resource, labels={builders.JOB_LABEL: kopf.PRESENT},
                      id=f"watch-{resource}")(_on_child_event)
    kopf.on.event("pods", labels={builders.JOB_LABEL: kopf.PRESENT,
                                  "app.kubernetes.io/component": "trainer"},
                  id="watch-trainer-pods")(_on_child_event)


def _reconcile_by_name(namespace: str, name: str, full: bool,
                       figures: Figures | None = None) -> None:
    from kubernetes.client.rest import ApiException

    try:
        body = _custom().get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except ApiException as exc:
        if exc.status == 404:
            return  # the job is gone; its children go by garbage collection
        raise
    if body["metadata"].get("deletionTimestamp"):
        return
    if full:
        try:
            reconcile(body)
        except kopf.PermanentError:
            pass  # status already says why
    else:
        refresh_status(body, figures)


def refresh_status(body: Any, figures: Figures | None = None) -> dict | None:
    """The job's status from a fresh observation, without applying children."""
    try:
        job = parse_manifest(_manifest(body))
    except ValidationError:
        return None  # an invalid spec's status says so already
    with _job_lock(body):
        return _write_status(body, observe(job, body, figures))


# --------------------------------------------------------------------------- periodic work


async def _refresh_figures_forever(logger) -> None:
    """Every INTERVAL: each job's figures from its buffer and trainer (gRPC, no API call);
    a job whose figures changed gets its status refreshed."""
    while True:
        await asyncio.sleep(INTERVAL)
        if not BUFFER_STATS:
            continue
        for key, observed in list(_observed.items()):
            try:
                figures = await asyncio.to_thread(_changed_figures, key, observed)
                if figures is not None:
                    logger.debug(f"{key[0]}/{key[1]}: its figures changed")
                    await asyncio.to_thread(_reconcile_by_name, *key, False, figures)
            except Exception as exc:  # noqa: BLE001 - keep refreshing the others
                logger.warning(f"refreshing {key[0]}/{key[1]}: {exc}")


def _changed_figures(key: tuple[str, str], observed: Observation) -> Figures | None:
    """The job's figures now, if they differ from the last observation's (else None)."""
    job = _jobs.get(key)
    if job is None:
        return None
    figures = fetch_figures(job, observed.workloads)
    # samples/s decays to 0 once nothing more is accepted: one more refresh shows it.
    changed = (figures.stats != observed.stats or figures.trainer != observed.trainer
               or bool(observed.samples_per_second))
    return figures if changed else None


async def _resync_forever(logger) -> None:
    """Level-based safety net: every RLJob is reconciled again every RESYNC_INTERVAL seconds."""
    while True:
        await asyncio.sleep(RESYNC_INTERVAL)
        try:
            await asyncio.to_thread(resync_all)
        except Exception as exc:  # noqa: BLE001 - keep resyncing whatever one pass hit
            logger.warning(f"resync pass failed: {exc}")


def resync_all() -> None:
    jobs = _custom().list_cluster_custom_object(GROUP, VERSION, PLURAL)["items"]
    for body in jobs:
        if body["metadata"].get("deletionTimestamp"):
            continue
        try:
            reconcile(body)
        except kopf.PermanentError:
            pass  # status already says why
        except Exception as exc:  # noqa: BLE001 - one job's trouble must not stop the others
            log.warning("resync of %s/%s: %s", body["metadata"].get("namespace"),
                        body["metadata"]["name"], exc)
