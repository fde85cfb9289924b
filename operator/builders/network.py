"""The job's NetworkPolicies (where `OperatorConfig.network_policies` is on): only the job's
own pods (and the operator, for buffer statistics and trainer status) reach Redis, the buffer
and the trainer; reward pods, which may run untrusted programs, make no outgoing connection
at all (but to a reward kind http's endpoint); the rollout pods of an episode job, which run
the user's episode code and its tools, reach only DNS, the job's own services and the CIDRs
of rollout.workflow.egress. Metrics ports stay open to Prometheus."""

from __future__ import annotations

import ipaddress
from typing import Any
from urllib.parse import urlsplit

from asyncrl.operator.builders.common import (
    BUFFER_METRICS,
    BUFFER_PORT,
    JOB_LABEL,
    REDIS_PORT,
    REWARD_METRICS,
    REWARD_PORT,
    TRAINER_METRICS,
    TRAINER_PORT,
    OperatorConfig,
    object_meta,
    selector_labels,
)
from asyncrl.operator.builders.redis import manages_redis
from asyncrl.operator.builders.trainer import distributed_weights
from asyncrl.spec import RLJob

#: Carried by the operator's own pods (the chart sets it): they may read every job's buffer.
OPERATOR_LABEL = "asyncrl.io/operator"


def _network_policy(job: RLJob, component: str, *, ingress: list[dict] | None = None,
                    egress: list[dict] | None = None) -> dict[str, Any]:
    """The policy of the job's `component` pods: `ingress` and `egress` rules, each direction
    left open where None, and `egress=[]` denying all outgoing connections."""
    spec: dict[str, Any] = {"podSelector": {"matchLabels": selector_labels(job, component)},
                            "policyTypes": []}
    if ingress is not None:
        spec["policyTypes"].append("Ingress")
        spec["ingress"] = ingress
    if egress is not None:
        # Egress listed with no egress rules denies it all. (An explicit `egress: []` is
        # dropped by the API server, so every apply would change the object again.)
        spec["policyTypes"].append("Egress")
        if egress:
            spec["egress"] = egress
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": object_meta(job, component), "spec": spec}


def _tcp(ports: list[int]) -> list[dict[str, Any]]:
    return [{"protocol": "TCP", "port": port} for port in ports]


def _from_own_pods(job: RLJob, ports: list[int] | None) -> dict[str, Any]:
    """From the job's own pods, on `ports` (None: every port)."""
    rule: dict[str, Any] = {
        "from": [{"podSelector": {"matchLabels": {JOB_LABEL: job.metadata.name}}}]}
    if ports is not None:
        rule["ports"] = _tcp(ports)
    return rule


def _from_operator(port: int) -> dict[str, Any]:
    """The operator's pods, in whatever namespace the chart put them, read the figures of
    status (buffer statistics, trainer status)."""
    return {"from": [{"namespaceSelector": {},
                      "podSelector": {"matchLabels": {OPERATOR_LABEL: "true"}}}],
            "ports": _tcp([port])}


def _from_anywhere(ports: list[int]) -> dict[str, Any]:
    """Metrics: Prometheus runs wherever the platform team put it."""
    return {"ports": _tcp(ports)}


def redis_network_policy(job: RLJob, config: OperatorConfig) -> dict[str, Any] | None:
    if not config.network_policies or not manages_redis(job):
        return None
    return _network_policy(job, "redis", ingress=[_from_own_pods(job, [REDIS_PORT])])


def buffer_network_policy(job: RLJob, config: OperatorConfig) -> dict[str, Any] | None:
    if not config.network_policies:
        return None
    return _network_policy(job, "buffer", ingress=[
        _from_own_pods(job, [BUFFER_PORT]), _from_operator(BUFFER_PORT),
        _from_anywhere([BUFFER_METRICS])])


def trainer_network_policy(job: RLJob, config: OperatorConfig) -> dict[str, Any] | None:
    """The job's own pods on every port (torchrun's rendezvous, then the process group's
    ports, which torch.distributed picks at run time); the operator on the status port."""
    if not config.network_policies:
        return None
    return _network_policy(job, "trainer", ingress=[
        _from_own_pods(job, None), _from_operator(TRAINER_PORT),
        _from_anywhere([TRAINER_METRICS])])


def reward_network_policy(job: RLJob, config: OperatorConfig) -> dict[str, Any] | None:
    """Reward pods may run untrusted programs: no egress at all (not even DNS), and only the
    job's own pods may ask for scores. Reward kind http runs none, and calls its endpoint
    wherever it is served: its egress stays open."""
    if not config.network_policies:
        return None
    return _network_policy(job, "reward", egress=[] if job.spec.reward.kind != "http" else None,
                           ingress=[_from_own_pods(job, [REWARD_PORT]),
                                    _from_anywhere([REWARD_METRICS])])


def rollout_network_policy(job: RLJob, config: OperatorConfig) -> dict[str, Any] | None:
    """Episode jobs only: their rollout pods run the user's episode code, whose tools may run
    anything, so their egress is DNS, the job's own Redis, buffer and reward pods (and, with
    distributed weights, the trainer and the other rollout pods, which form one
    torch.distributed group with them), and the CIDRs of rollout.workflow.egress. The
    episode's OpenAI client reaches its own worker inside the pod, which no policy governs.
    Single-turn rollout pods run only asyncrl's code: no policy."""
    workflow = job.spec.rollout.workflow
    if not config.network_policies or workflow.kind != "episode":
        return None
    egress = [_to_dns(), _to_redis(job), _to_own_pods(job, "buffer", [BUFFER_PORT]),
              _to_own_pods(job, "reward", [REWARD_PORT])]
    if distributed_weights(job):
        # The transfer group's store, then the process group's ports, which torch.distributed
        # picks at run time; every member connects to every other.
        egress += [_to_own_pods(job, "trainer", None), _to_own_pods(job, "rollout", None)]
    if workflow.egress:
        egress.append({"to": [{"ipBlock": {"cidr": cidr}} for cidr in workflow.egress]})
    return _network_policy(job, "rollout", egress=egress)


def _to_dns() -> dict[str, Any]:
    """Names of the job's Services (and of the hosts in workflow.egress), wherever the
    cluster's resolver runs."""
    return {"ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]}


def _to_own_pods(job: RLJob, component: str, ports: list[int] | None) -> dict[str, Any]:
    """To the job's pods of one component, on `ports` (None: every port)."""
    rule: dict[str, Any] = {
        "to": [{"podSelector": {"matchLabels": selector_labels(job, component)}}]}
    if ports is not None:
        rule["ports"] = _tcp(ports)
    return rule


def _to_redis(job: RLJob) -> dict[str, Any]:
    """The managed Redis's pods; an external Redis on its URL's port, at its address where
    the URL gives one, else anywhere (a host name's addresses are unknown to a policy)."""
    if manages_redis(job):
        return _to_own_pods(job, "redis", [REDIS_PORT])
    url = urlsplit(job.spec.buffer.redis.url)
    ports = _tcp([url.port or REDIS_PORT])
    try:
        address = ipaddress.ip_address(url.hostname or "")
    except ValueError:
        return {"ports": ports}
    return {"to": [{"ipBlock": {"cidr": f"{address}/{address.max_prefixlen}"}}], "ports": ports}
