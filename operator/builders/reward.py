"""The reward service's Deployment and Service (gRPC 50081, metrics 9102): the most locked
down pods of a job, since for code rewards they run untrusted programs."""

from __future__ import annotations

from typing import Any

from asyncrl.operator.builders.common import (
    JOB_FILE,
    REWARD_METRICS,
    REWARD_PORT,
    OperatorConfig,
    desired_replicas,
)
from asyncrl.operator.builders.pods import (
    build_deployment,
    build_service,
    grpc_probes,
    resource_requirements,
    service_container,
)
from asyncrl.operator.builders.volumes import reward_volumes
from asyncrl.platform.settings import serve_command
from asyncrl.spec import RLJob

#: What the code sandbox needs to build its cage as root: namespaces and mounts (SYS_ADMIN;
#: the runtime's default seccomp profile then allows unshare and mount too), a uid of its own
#: per slot (SETUID, SETGID), and the program's files written into that uid's scratch tmpfs
#: (DAC_OVERRIDE). The programs themselves run with none.
SANDBOX_CAPABILITIES = ("SYS_ADMIN", "SETUID", "SETGID", "DAC_OVERRIDE")


def reward_deployment(job: RLJob, config: OperatorConfig) -> dict[str, Any]:
    """Reward pods run untrusted programs (code reward), so they are the most locked down:
    no service-account token, no service links, read-only root, no capabilities but, for code
    rewards, the four the sandbox needs to cage each program (`_run_sandbox_as_root`)."""
    reward = job.spec.reward
    args = serve_command("reward", job_file=JOB_FILE, host="0.0.0.0", grpc_port=REWARD_PORT,
                         metrics_port=REWARD_METRICS)
    volumes, mounts = reward_volumes(job)
    container = service_container(job, config, "reward", args, gpus=reward.placement.gpus,
                                  ports=[("grpc", REWARD_PORT), ("metrics", REWARD_METRICS)],
                                  resources=resource_requirements(reward.resources, "reward",
                                                                  gpus=reward.placement.gpus),
                                  **grpc_probes(REWARD_PORT), mounts=mounts)
    deployment = build_deployment(job, config, "reward", desired_replicas(job, "reward"),
                                  [container], placement=reward.placement, volumes=volumes)
    pod = deployment["spec"]["template"]["spec"]
    pod["enableServiceLinks"] = False
    pod["securityContext"]["seccompProfile"] = seccomp_profile(config.reward_seccomp_profile)
    if reward.kind == "code":
        _run_sandbox_as_root(pod, container)
    return deployment


def _run_sandbox_as_root(pod: dict, container: dict) -> None:
    """Non-root, the sandbox would need a user namespace, and there the kernel refuses the
    fresh /proc of each run under the runtime's masked /proc paths whatever the seccomp
    profile (`procMount: Unmasked` needs `hostUsers: false`, which few runtimes support). As
    root with SANDBOX_CAPABILITIES it builds its namespaces; each program runs as a dedicated
    uid with no capabilities and no-new-privs."""
    pod["securityContext"].update(runAsNonRoot=False, runAsUser=0, runAsGroup=0, fsGroup=0)
    container["securityContext"]["capabilities"]["add"] = list(SANDBOX_CAPABILITIES)


def seccomp_profile(text: str) -> dict[str, str]:
    kind, _, path = text.partition(":")
    if kind in ("RuntimeDefault", "Unconfined") and not path:
        return {"type": kind}
    if kind == "Localhost" and path:
        return {"type": "Localhost", "localhostProfile": path}
    raise ValueError(f"seccomp profile {text!r}: expected RuntimeDefault, Unconfined or "
                     "Localhost:<profile path relative to the kubelet's seccomp folder>")


def reward_service(job: RLJob) -> dict[str, Any]:
    return build_service(job, "reward", [("grpc", REWARD_PORT), ("metrics", REWARD_METRICS)])
