"""The operator's access to the Kubernetes API, all of it: the clients (`CLIENTS`), server-side
apply of children, the reads of what it observes (workloads, trainer pods, Secrets, RLJobs),
the status patch and Events. kopf's own calls (watches, its annotations) are kopf's.

The kubernetes client is imported where it is used, so that importing the operator's modules
costs nothing until it runs.
"""

from __future__ import annotations

import json
import logging
import threading
from datetime import datetime, timezone
from typing import Any

import asyncrl
from asyncrl.spec import API_VERSION, GROUP, KIND, PLURAL, VERSION

FIELD_MANAGER = "asyncrl-operator"
USER_AGENT = "asyncrl-operator"

log = logging.getLogger("asyncrl.operator")


class Clients:
    """One kubernetes ApiClient, made on first use from in-cluster credentials, else the
    current kubeconfig (unless given one), and the dynamic client over it."""

    def __init__(self, api=None):
        self._lock = threading.Lock()
        self._api = api
        self._dynamic = None

    def api(self):
        with self._lock:
            if self._api is None:
                from kubernetes import client, config

                try:
                    config.load_incluster_config()
                except config.ConfigException:
                    config.load_kube_config()
                self._api = client.ApiClient()
                # Named in the API server's audit log and metrics (kopf's own calls say kopf/...).
                self._api.user_agent = f"{USER_AGENT}/{asyncrl.__version__}"
            return self._api

    def dynamic(self):
        """The dynamic client, which finds any resource by apiVersion and kind."""
        from kubernetes.dynamic import DynamicClient

        api = self.api()
        with self._lock:
            if self._dynamic is None:
                self._dynamic = DynamicClient(api)
            return self._dynamic


#: The process's clients (a test may put its own in their place).
CLIENTS = Clients()


def api_client():
    """The one kubernetes ApiClient: in-cluster credentials, else the current kubeconfig."""
    return CLIENTS.api()


def core():
    from kubernetes import client

    return client.CoreV1Api(api_client())


def apps():
    from kubernetes import client

    return client.AppsV1Api(api_client())


def custom():
    from kubernetes import client

    return client.CustomObjectsApi(api_client())


def api_message(exc) -> str:
    """The API server's message in an ApiException (its body is a Status object)."""
    try:
        return json.loads(exc.body).get("message", "")
    except (TypeError, ValueError):
        return str(exc.body)[:300]


# --------------------------------------------------------------------------- children


def apply(obj: dict[str, Any]) -> None:
    """Server-side apply of any child, by its apiVersion and kind (the kubernetes client's
    dynamic client finds the resource): created or converged; unchanged objects stay
    untouched."""
    dynamic = CLIENTS.dynamic()
    resource = dynamic.resources.get(api_version=obj["apiVersion"], kind=obj["kind"])
    dynamic.server_side_apply(resource, body=obj, namespace=obj["metadata"]["namespace"],
                              field_manager=FIELD_MANAGER, force_conflicts=True)


def read_secret_data(namespace: str, name: str) -> dict[str, str] | None:
    """A Secret's data (base64, as stored), or None when there is no such Secret."""
    from kubernetes.client.rest import ApiException

    try:
        secret = core().read_namespaced_secret(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise
    return secret.data or {}


def read_workload(kind: str, namespace: str, name: str):
    """A Deployment or StatefulSet, or None when it is not there. The object itself (not its
    /status subresource): the chart's RBAC grants `get` on the workloads and nothing on their
    subresources."""
    from kubernetes.client.rest import ApiException

    read = (apps().read_namespaced_deployment if kind == "Deployment"
            else apps().read_namespaced_stateful_set)
    try:
        return read(name, namespace)
    except ApiException as exc:
        if exc.status != 404:
            raise
        return None


def list_pods(namespace: str, labels: dict[str, str]) -> list[dict]:
    """The pods with these labels, as plain dicts (the API's own field names)."""
    selector = ",".join(f"{k}={v}" for k, v in labels.items())
    pods = core().list_namespaced_pod(namespace, label_selector=selector).items
    return [api_client().sanitize_for_serialization(p) for p in pods]


# --------------------------------------------------------------------------- RLJobs


def read_job(namespace: str, name: str) -> dict | None:
    """The RLJob as stored now, or None when it is gone."""
    from kubernetes.client.rest import ApiException

    try:
        return custom().get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
    except ApiException as exc:
        if exc.status != 404:
            raise
        return None


def delete_job(namespace: str, name: str) -> None:
    """Deletes an RLJob (ttlSecondsAfterFinished); what it owns goes by garbage collection, in
    the background. Gone already is fine."""
    from kubernetes.client.rest import ApiException

    try:
        custom().delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                                 propagation_policy="Background")
    except ApiException as exc:
        if exc.status != 404:
            raise


def list_jobs() -> list[dict]:
    """Every RLJob of the cluster."""
    return custom().list_cluster_custom_object(GROUP, VERSION, PLURAL)["items"]


def patch_job_status(namespace: str, name: str, changes: dict[str, Any]) -> None:
    """A merge patch of the RLJob's status subresource."""
    custom().patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, name, {"status": changes},
        _content_type="application/merge-patch+json")


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
        core().create_namespaced_event(meta["namespace"], event)
    except ApiException as exc:  # events are best effort
        log.warning("could not post event %s for %s: %s", reason, meta["name"], exc.reason)


# --------------------------------------------------------------------------- Kueue Workloads

#: Kueue's Workload resource (asyncrl.operator.kueue): group, version, plural.
KUEUE_WORKLOADS = ("kueue.x-k8s.io", "v1beta2", "workloads")


def read_queue_workload(namespace: str, name: str) -> dict | None:
    """A Kueue Workload, or None when there is none (or Kueue's CRDs are not installed)."""
    from kubernetes.client.rest import ApiException

    try:
        return custom().get_namespaced_custom_object(*KUEUE_WORKLOADS[:2], namespace,
                                                     KUEUE_WORKLOADS[2], name)
    except ApiException as exc:
        if exc.status != 404:
            raise
        return None


def create_queue_workload(workload: dict) -> dict:
    return custom().create_namespaced_custom_object(
        *KUEUE_WORKLOADS[:2], workload["metadata"]["namespace"], KUEUE_WORKLOADS[2], workload)


def delete_queue_workload(namespace: str, name: str) -> None:
    """Deletes a Workload at once (foreground would wait for nothing: it owns nothing)."""
    from kubernetes.client.rest import ApiException

    try:
        custom().delete_namespaced_custom_object(*KUEUE_WORKLOADS[:2], namespace,
                                                 KUEUE_WORKLOADS[2], name)
    except ApiException as exc:
        if exc.status != 404:
            raise


def patch_queue_workload(workload: dict, change: dict[str, Any]) -> None:
    """A merge patch of a Workload (its spec.active)."""
    meta = workload["metadata"]
    custom().patch_namespaced_custom_object(
        *KUEUE_WORKLOADS[:2], meta["namespace"], KUEUE_WORKLOADS[2], meta["name"], change,
        _content_type="application/merge-patch+json")


def patch_queue_workload_status(workload: dict, status: dict[str, Any]) -> None:
    """A merge patch of a Workload's status, at the resourceVersion read (a merge patch
    replaces the conditions list whole: a write Kueue made in between is a conflict, 409,
    not lost)."""
    meta = workload["metadata"]
    custom().patch_namespaced_custom_object_status(
        *KUEUE_WORKLOADS[:2], meta["namespace"], KUEUE_WORKLOADS[2], meta["name"],
        {"metadata": {"resourceVersion": meta["resourceVersion"]}, "status": status},
        _content_type="application/merge-patch+json")
