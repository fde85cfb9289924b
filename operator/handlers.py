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
from datetime import datetime, timezone
from typing import Any

import kopf
from pydantic import ValidationError

from asyncrl.operator import builders
from asyncrl.operator.builders import OperatorConfig
from asyncrl.operator.status import (
    BufferStats,
    Observation,
    TrainerStatus,
    Workload,
    compute_status,
    status_changes,
    trainer_failure,
)
from asyncrl.spec import API_VERSION, GROUP, KIND, PLURAL, VERSION, RLJob, parse_manifest
from asyncrl.spec_errors import describe

FIELD_MANAGER = "asyncrl-operator"
APPLY = "application/apply-patch+yaml"
INTERVAL = float(os.environ.get("ASYNCRL_OPERATOR_INTERVAL", "10"))
#: Ask the job's services for their figures (buffer GetStats, trainer GetStatus); they are
#: reachable when the operator runs in the cluster.
BUFFER_STATS = os.environ.get("ASYNCRL_OPERATOR_BUFFER_STATS", "1") not in ("0", "false", "")

log = logging.getLogger("asyncrl.operator")

#: Set by `asyncrl operator` before kopf starts.
CONFIG = OperatorConfig()


def configure_operator(config: OperatorConfig, *, interval: float | None = None,
                       buffer_stats: bool | None = None) -> None:
    """Settings from `asyncrl operator`'s flags (read at run time, not at import)."""
    global CONFIG, INTERVAL, BUFFER_STATS
    CONFIG = config
    if interval is not None:
        INTERVAL = interval
    if buffer_stats is not None:
        BUFFER_STATS = buffer_stats


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
        return _api_client


def _core():
    from kubernetes import client

    return client.CoreV1Api(api_client())


def _apps():
    from kubernetes import client

    return client.AppsV1Api(api_client())


def _networking():
    from kubernetes import client

    return client.NetworkingV1Api(api_client())


def _custom():
    from kubernetes import client

    return client.CustomObjectsApi(api_client())


_APPLY_METHODS = {
    "ConfigMap": ("core", "patch_namespaced_config_map"),
    "Secret": ("core", "patch_namespaced_secret"),
    "Service": ("core", "patch_namespaced_service"),
    "PersistentVolumeClaim": ("core", "patch_namespaced_persistent_volume_claim"),
    "Deployment": ("apps", "patch_namespaced_deployment"),
    "StatefulSet": ("apps", "patch_namespaced_stateful_set"),
    "NetworkPolicy": ("networking", "patch_namespaced_network_policy"),
}


def apply(obj: dict[str, Any]) -> None:
    """Server-side apply: create or converge `obj`; unchanged objects stay untouched."""
    group, method = _APPLY_METHODS[obj["kind"]]
    api = {"core": _core, "apps": _apps, "networking": _networking}[group]()
    meta = obj["metadata"]
    getattr(api, method)(meta["name"], meta["namespace"], obj, field_manager=FIELD_MANAGER,
                         force=True, _content_type=APPLY)


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


_job_locks: dict[tuple[str, str], threading.Lock] = {}
_job_locks_lock = threading.Lock()


def _job_lock(body: Any) -> threading.Lock:
    key = (body["metadata"].get("namespace"), body["metadata"]["name"])
    with _job_locks_lock:
        return _job_locks.setdefault(key, threading.Lock())


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


def observe(job: RLJob, body: Any) -> Observation:
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
            status = read(name, namespace).status
        except ApiException as exc:
            if exc.status != 404:
                raise
            found.append(Workload(component, desired))
            continue
        found.append(Workload(component, desired, exists=True,
                              replicas=status.replicas or 0,
                              ready=status.ready_replicas or 0,
                              updated=status.updated_replicas or 0))

    selector = ",".join(f"{k}={v}" for k, v in builders.selector_labels(job, "trainer").items())
    pods = _core().list_namespaced_pod(namespace, label_selector=selector).items
    failure = trainer_failure([api_client().sanitize_for_serialization(p) for p in pods],
                              CONFIG.trainer_max_restarts)

    stats, stats_error, rate = None, None, None
    buffer = next(w for w in found if w.component == "buffer")
    if BUFFER_STATS and buffer.ready:
        stats, stats_error = buffer_stats(job)
        uid = body["metadata"].get("uid", job.metadata.name)
        if stats is not None:
            now = time.monotonic()
            before = _accepted.get(uid)
            if before is not None and now > before[1]:
                rate = max(0.0, (stats.accepted_total - before[0]) / (now - before[1]))
            _accepted[uid] = (stats.accepted_total, now)

    trainer, trainer_error = None, None
    if BUFFER_STATS and next(w for w in found if w.component == "trainer").ready:
        trainer, trainer_error = trainer_status(job)
    return Observation(
        generation=body["metadata"].get("generation"), suspend=job.spec.suspend,
        max_steps=job.spec.algorithm.max_steps, workloads=tuple(found), trainer_failure=failure,
        stats=stats, stats_error=stats_error, samples_per_second=rate,
        trainer=trainer, trainer_error=trainer_error, now=datetime.now(timezone.utc))


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
                       reply.consumed_total, tuple(reply.staleness_counts)), None


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
    """A core/v1 Event about the RLJob (what `kubectl describe rljob` shows)."""
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
    settings.posting.enabled = False  # Events are posted explicitly, for phase transitions.
    settings.watching.server_timeout = 300
    memo.resync = asyncio.create_task(_resync_forever(logger))


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_) -> None:
    task = memo.get("resync")
    if task is not None:
        task.cancel()


@kopf.on.resume(GROUP, VERSION, PLURAL, id="reconcile-on-resume")
@kopf.on.create(GROUP, VERSION, PLURAL, id="reconcile-on-create")
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec", id="reconcile-on-update")
def reconcile_handler(body: kopf.Body, logger, **_) -> None:
    # Returns nothing: kopf would store a result under status, which the CRD's schema prunes.
    reconcile(body, logger=logger)


async def _resync_forever(logger) -> None:
    """Level-based safety net: every RLJob is reconciled again every INTERVAL seconds."""
    while True:
        await asyncio.sleep(INTERVAL)
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
