"""The trainer's StatefulSet (gRPC 50071) and headless Service: PPO updates on `replicas`
nodes x `processesPerReplica` processes under torchrun, meeting at pod 0 (rendezvous 29400;
with trainer.weightTransfer distributed, the weight transfer group's store on 29500)."""

from __future__ import annotations

from typing import Any

from asyncrl.launch.torchrun import torchrun_arguments
from asyncrl.operator.builders.common import (
    BUFFER_PORT,
    JOB_FILE,
    RENDEZVOUS_PORT,
    REWARD_PORT,
    RUN_DIR,
    TRAINER_METRICS,
    TRAINER_PORT,
    WEIGHTS_PORT,
    OperatorConfig,
    child_name,
    desired_replicas,
    object_meta,
    selector_labels,
)
from asyncrl.operator.builders.pods import (
    add_shared_memory,
    build_service,
    container_security,
    grpc_probes,
    image_for,
    pod_name_env,
    pod_spec,
    pod_template,
    resource_requirements,
    service_container,
)
from asyncrl.operator.builders.model import fetch_model_container, hub_env
from asyncrl.operator.builders.tracking import tracking_env
from asyncrl.operator.builders.volumes import dataset_volumes, run_mount, run_volume
from asyncrl.platform.settings import serve_command
from asyncrl.spec import RLJob


def trainer_statefulset(job: RLJob, config: OperatorConfig) -> dict[str, Any]:
    """Trainer pods: `replicas` nodes x `processesPerReplica` processes. More than one process
    in all runs under torchrun: on its own in a single pod (`--standalone`), else meeting at
    pod 0 through the headless Service, each pod starting torchrun only once that rendezvous
    can work (`rendezvous_wait_container`). A template change restarts the pods, and the
    trainer resumes from the last checkpoint in the run volume."""
    trainer = job.spec.trainer
    serve = serve_command(
        "trainer", job_file=JOB_FILE, host="0.0.0.0", grpc_port=TRAINER_PORT,
        metrics_port=TRAINER_METRICS, buffer_address=f"{child_name(job, 'buffer')}:{BUFFER_PORT}",
        reward_address=f"{child_name(job, 'reward')}:{REWARD_PORT}", run_dir=RUN_DIR,
        consumer="$(POD_NAME)")
    env = [pod_name_env(),
           {"name": "ASYNCRL_NNODES", "value": str(trainer.replicas)},
           {"name": "ASYNCRL_NPROC_PER_NODE", "value": str(trainer.processes_per_replica)},
           *hub_env(job), *tracking_env(job)]
    command = None
    rendezvous_host = trainer_rendezvous_host(job) if trainer.replicas > 1 else None
    if trainer.replicas * trainer.processes_per_replica > 1:
        # A rank that dies stops the pod's torchrun (no --max-restarts); the pod restarts and
        # every node resumes from the last checkpoint.
        command = ["torchrun", *torchrun_arguments(
            trainer.processes_per_replica, nnodes=trainer.replicas,
            rendezvous_endpoint=(f"{rendezvous_host}:{RENDEZVOUS_PORT}" if rendezvous_host
                                 else None),
            rendezvous_id=job.metadata.name)]
    data_volumes, data_mounts = dataset_volumes(job)  # the evaluation prompts
    container = service_container(job, config, "trainer", serve, env=env, command=command,
                                  gpus=trainer.placement.gpus,
                                  ports=trainer_ports(job),
                                  resources=resource_requirements(trainer.resources, "trainer",
                                                                  gpus=trainer.placement.gpus),
                                  **grpc_probes(TRAINER_PORT), mounts=[run_mount(), *data_mounts])
    pod = pod_spec(job, [container], placement=trainer.placement,
                   volumes=[run_volume(job), *data_volumes],
                   gpu_tolerations=config.gpu_tolerations)
    if trainer.placement.gpus:
        add_shared_memory(pod, container)
    # The model first: a rendezvous is no use to a pod that cannot load it.
    init = [c for c in [fetch_model_container(job, config, trainer.placement.gpus)] if c]
    if rendezvous_host:
        init.append(rendezvous_wait_container(
            rendezvous_host, image=image_for(config, trainer.placement.gpus),
            pull_policy=config.image_pull_policy))
    if init:
        pod["initContainers"] = init
    return {
        "apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": object_meta(job, "trainer"),
        "spec": {
            "serviceName": child_name(job, "trainer-headless"),
            "replicas": desired_replicas(job, "trainer"),
            # All nodes of a torch job start together; none waits for another to be Ready.
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": selector_labels(job, "trainer")},
            "template": pod_template(job, "trainer", pod),
        },
    }


def distributed_weights(job: RLJob) -> bool:
    return job.spec.trainer.weight_transfer == "distributed"


def trainer_ports(job: RLJob) -> list[tuple[str, int]]:
    """The trainer's ports; with distributed weights also the transfer group's store, where
    rollout workers join (through the headless Service: pod 0's stable name)."""
    ports = [("grpc", TRAINER_PORT), ("metrics", TRAINER_METRICS), ("rendezvous", RENDEZVOUS_PORT)]
    return ports + ([("weights", WEIGHTS_PORT)] if distributed_weights(job) else [])


def trainer_rendezvous_host(job: RLJob) -> str:
    """Trainer pod 0's name under the headless Service: torchrun's rendezvous across pods."""
    return f"{child_name(job, 'trainer')}-0.{child_name(job, 'trainer-headless')}"


#: Run by `rendezvous_wait_container` as `python -c WAIT_FOR_RENDEZVOUS <host> <port>`.
WAIT_FOR_RENDEZVOUS = """\
import os, socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
hosting = host.split(".")[0] == socket.gethostname()
while True:
    try:
        if hosting:
            if os.environ["POD_IP"] in {a[4][0] for a in socket.getaddrinfo(host, port)}:
                break
        else:
            socket.create_connection((host, port), timeout=5).close()
            break
    except OSError:
        pass
    print(f"waiting for the trainer rendezvous at {host}:{port}", flush=True)
    time.sleep(2)
"""


def rendezvous_wait_container(host: str, *, image: str, pull_policy: str) -> dict[str, Any]:
    """Init container of a multi-pod trainer. torch's c10d rendezvous picks the pod that hosts
    its store by resolving the endpoint's name when torchrun starts, and the other pods give
    up after 60 s without a store: pod 0 waits until its name under the headless Service
    resolves to its own address, the others until pod 0's store accepts connections (pod 0
    may still be pulling the image). Otherwise torchrun fails and the pod restarts, and a
    trainer restarting `trainer_max_restarts` times fails the job."""
    return {
        "name": "wait-for-rendezvous", "image": image, "imagePullPolicy": pull_policy,
        "command": ["python", "-c", WAIT_FOR_RENDEZVOUS, host, str(RENDEZVOUS_PORT)],
        "env": [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
        "resources": {"requests": {"cpu": "10m", "memory": "32Mi"}},
        "securityContext": container_security(read_only_root=True),
    }


def trainer_headless_service(job: RLJob) -> dict[str, Any]:
    ports = [p for p in trainer_ports(job) if p[0] != "metrics"]
    service = build_service(job, "trainer", ports, name=child_name(job, "trainer-headless"))
    service["spec"]["clusterIP"] = "None"
    # Rendezvous happens before any trainer is Ready.
    service["spec"]["publishNotReadyAddresses"] = True
    return service
