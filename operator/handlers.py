"""kopf's wiring of the RLJob operator: the handlers it calls, and its start-up and clean-up.
Each handler delegates: `asyncrl.operator.reconcile` reconciles a job, `state` remembers what
the operator knows (one `OperatorState`, `STATE`, per process), `observe` and `kube` observe
and talk to the API.

A job is reconciled on create, spec update and operator start (resume); its children are
watched (filtered by the job label), and a child's change reconciles its job again or
refreshes its status; its figures, and its lifetime rules (asyncrl.operator.lifetime: TTL, deadline), are checked every
`ASYNCRL_OPERATOR_INTERVAL` seconds,
and every RLJob is reconciled every `ASYNCRL_OPERATOR_RESYNC_INTERVAL` seconds, which repairs
drift a watch missed. That loop is operator-wide rather than a kopf timer so that RLJobs
carry no finalizer: deletion is the garbage collector's job, through owner references, even
while the operator is down.

Import this module (or run `asyncrl operator`) to register the handlers with kopf.
"""

from __future__ import annotations

import asyncio
import functools

import kopf

from asyncrl.operator import builders, lifetime, reconcile
from asyncrl.operator.builders import OperatorConfig
from asyncrl.operator.kube import KUEUE_WORKLOADS
from asyncrl.operator.state import OperatorState
from asyncrl.spec import GROUP, PLURAL, VERSION

#: Everything this process's operator knows: its settings and each job's memory.
STATE = OperatorState()

#: The children watched, by kopf resource name; Secrets are not (an operator able to list
#: every Secret of the cluster is more than this one needs; the safety-net resync repairs them).
_CHILD_RESOURCES = ("deployments", "statefulsets", "services", "configmaps",
                    "persistentvolumeclaims")


def configure_operator(config: OperatorConfig, *, interval: float | None = None,
                       resync_interval: float | None = None,
                       buffer_stats: bool | None = None) -> None:
    """Settings from `asyncrl operator`'s flags (read at run time, not at import)."""
    STATE.configure(config, interval=interval, resync_interval=resync_interval,
                    buffer_stats=buffer_stats)
    _watch_children(network_policies=config.network_policies)


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger, **_) -> None:
    # The CRD's status schema is strict (kopf's own status fields would be pruned), so kopf
    # keeps its bookkeeping in annotations.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    # Events are posted by `kube.post_event`, for phase transitions.
    settings.posting.enabled = False
    settings.watching.server_timeout = 300
    child_work = functools.partial(reconcile.reconcile_by_name, STATE)
    memo.tasks = [asyncio.create_task(reconcile.resync_forever(STATE, logger)),
                  asyncio.create_task(STATE.registry.child_events.run(child_work, logger)),
                  asyncio.create_task(reconcile.refresh_figures_forever(STATE, logger)),
                  asyncio.create_task(lifetime.lifetime_forever(
                      STATE.interval, STATE.registry.timers,
                      functools.partial(reconcile.reconcile_by_name, STATE, full=True),
                      logger))]


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_) -> None:
    for task in memo.get("tasks", []):
        task.cancel()


@kopf.on.resume(GROUP, VERSION, PLURAL, id="reconcile-on-resume")
@kopf.on.create(GROUP, VERSION, PLURAL, id="reconcile-on-create")
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec", id="reconcile-on-update")
# A job joins or leaves a Kueue queue by its label (asyncrl.operator.kueue).
@kopf.on.update(GROUP, VERSION, PLURAL, field="metadata.labels", id="reconcile-on-labels")
def reconcile_handler(body: kopf.Body, logger, **_) -> None:
    # Returns nothing: kopf would store a result under status, which the CRD's schema prunes.
    reconcile.reconcile(STATE, body, logger=logger)


@kopf.on.event(GROUP, VERSION, PLURAL, id="forget-deleted-jobs")
def forget_deleted_job(event: dict, body: kopf.Body, **_) -> None:
    """A deleted job's per-job state goes with it (its children go by garbage collection)."""
    if event.get("type") == "DELETED":
        namespace, name = body["metadata"].get("namespace"), body["metadata"]["name"]
        STATE.registry.forget(namespace, name, body["metadata"].get("uid"))
        STATE.metrics.forget(namespace, name)


async def _on_child_event(event: dict, body: kopf.Body, **_) -> None:
    STATE.registry.child_events.note(event, body)


def _watch_children(*, network_policies: bool) -> None:
    """kopf handlers for every kind of child, filtered by our job label (so a cluster's other
    objects are never listed), and for the job's pods: a component's restarts past
    spec.backoffLimit make the job Failed, and a crash-looping pod stays not ready, so its
    workload's status does not move again as its restarts mount."""
    if STATE.children_watched:  # once per process
        return
    STATE.children_watched = True
    resources = _CHILD_RESOURCES + (("networkpolicies",) if network_policies else ())
    for resource in resources:
        kopf.on.event(resource, labels={builders.JOB_LABEL: kopf.PRESENT},
                      id=f"watch-{resource}")(_on_child_event)
    kopf.on.event("pods", labels={builders.JOB_LABEL: kopf.PRESENT},
                  id="watch-pods")(_on_child_event)
    # Kueue's word on queued jobs (served only where Kueue's CRDs are installed).
    kopf.on.event(*KUEUE_WORKLOADS, labels={builders.JOB_LABEL: kopf.PRESENT},
                  id="watch-kueue-workloads")(_on_child_event)
