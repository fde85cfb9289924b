"""A code job's reward pod on the real node (fixture `real_node`), built by operator.builders
exactly as the operator applies it: the job's ConfigMap and reward Deployment from
examples/code.yaml, the service image of tests/cluster/images.sh, and each seccomp setting of
the chart's `rewardSandbox.seccompProfile`. The test process calls the Reward gRPC API at the
pod's IP: a correct program must score 1, and hostile programs, each of which would score 1 if
its attack worked, must score 0.

What the pod's security settings do here (containerd's RuntimeDefault profile, runc, Linux 6):

- as built (root, all capabilities dropped but SYS_ADMIN, SETUID, SETGID, DAC_OVERRIDE): the
  sandbox cages each program in new namespaces, as a uid of its own, under RuntimeDefault
  (which allows unshare and mount to a holder of SYS_ADMIN) as under Unconfined;
- non-root with no capabilities, as every other pod of the job: RuntimeDefault refuses
  unshare; Unconfined lets a user namespace be made, but the kernel then refuses the run's
  fresh /proc under the runtime's masked /proc paths. Seccomp can only take syscalls away, so
  no Localhost profile can do better than Unconfined, and `procMount: Unmasked` needs
  `hostUsers: false` (the API server says so), which this runtime does not support.
"""

from __future__ import annotations

import secrets
import socket
import subprocess
import uuid

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kubernetes import client

from asyncrl.operator import builders
from asyncrl.operator.builders import OperatorConfig
from asyncrl.scoring.types import CodeReference, IoCase, ScoreTask
from asyncrl.spec import parse_manifest
from asyncrl.v1 import reward_pb2, reward_pb2_grpc
from support import ROOT
from support.real_pods import pod_metrics
from support.waiting import wait_for

# The first test's set-up waits for the machine's one real node, may build the images and
# imports the service image (5 GB).
pytestmark = [pytest.mark.real_node, pytest.mark.timeout(3600)]

IMAGES_SCRIPT = ROOT / "tests" / "cluster" / "images.sh"
#: Deadlines that only catch hangs.
READY_SECONDS = 300
RPC_SECONDS = 120

ADD = CodeReference(io_cases=(IoCase("2 3\n", "5\n"),))
CORRECT = "a, b = map(int, input().split())\nprint(a + b)"
FORK_BOMB = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
KILLER = ("import os, signal\nfor pid in (os.getppid(), 1, -1):\n    try:\n"
          "        os.kill(pid, signal.SIGKILL)\n    except OSError:\n        pass")


def fenced(program: str) -> str:
    return f"My solution:\n```python\n{program}\n```"


# --------------------------------------------------------------------------- the pod


def service_image() -> tuple[str, str]:
    """(reference, tar) of the Dockerfile's `service` target, built if its inputs changed."""
    out = subprocess.run(["bash", str(IMAGES_SCRIPT)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.fail(f"{IMAGES_SCRIPT} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    for line in out.stdout.splitlines():
        target, reference, tar = line.split()
        if target == "service":
            return reference, tar
    pytest.fail(f"{IMAGES_SCRIPT} printed no service image:\n{out.stdout}")


@pytest.fixture(scope="module")
def image(real_node) -> str:
    reference, tar = service_image()
    real_node.import_image(tar)
    return reference


def code_job(namespace: str):
    data = yaml.safe_load((ROOT / "examples" / "code.yaml").read_text())
    data["metadata"]["namespace"] = namespace
    return parse_manifest(data)


def without_root(deployment: dict) -> dict:
    """The reward Deployment with the hardening of the job's other pods: non-root, no
    capabilities at all."""
    pod = deployment["spec"]["template"]["spec"]
    uid = builders.APP_UID
    pod["securityContext"].update(runAsNonRoot=True, runAsUser=uid, runAsGroup=uid, fsGroup=uid)
    for container in pod["containers"]:
        container["securityContext"]["capabilities"] = {"drop": ["ALL"]}
    return deployment


class RewardPod:
    """The job's ConfigMap and reward Deployment in a fresh namespace, and its pod: Ready, or
    running and refused by its readiness probe (the health service says NOT_SERVING)."""

    def __init__(self, cluster, image: str, seccomp: str, *, root: bool = True):
        self.cluster = cluster
        self.core = client.CoreV1Api(cluster.api_client())
        self.namespace = f"code-{uuid.uuid4().hex[:8]}"
        self.job = code_job(self.namespace)
        config = OperatorConfig(image=image, image_pull_policy="Never",
                                reward_seccomp_profile=seccomp)
        deployment = builders.reward_deployment(self.job, config)
        self.deployment = deployment if root else without_root(deployment)
        self.name = self.ip = ""

    def start(self, *, ready: bool) -> RewardPod:
        self.core.create_namespace({"metadata": {"name": self.namespace}})
        manifests = [builders.config_map(self.job), self.deployment]
        self.cluster.kubectl("apply", "-f", "-",
                             input=yaml.safe_dump_all(manifests, sort_keys=False))
        pod = self._wait_for(self._ready if ready else self._refused_by_readiness)
        self.name, self.ip = pod.metadata.name, pod.status.pod_ip
        return self

    def stop(self) -> None:
        self.core.delete_namespace(self.namespace)

    def _wait_for(self, wanted):
        selector = ",".join(f"{k}={v}" for k, v in
                            builders.selector_labels(self.job, "reward").items())
        pods = []

        def passing():
            nonlocal pods
            pods = self.core.list_namespaced_pod(self.namespace, label_selector=selector).items
            return next((p for p in pods if wanted(p)), None)

        return wait_for(passing, READY_SECONDS, f"a reward pod to pass {wanted.__name__}",
                        lambda: f"{[p.status for p in pods]}\n{self.logs()}", every=1)

    @staticmethod
    def _ready(pod) -> bool:
        return any(c.type == "Ready" and c.status == "True" for c in pod.status.conditions or [])

    def _refused_by_readiness(self, pod) -> bool:
        """Started (its liveness answers) and unready: the kubelet's gRPC readiness probe was
        answered NOT_SERVING."""
        started = [c.started for c in pod.status.container_statuses or []] == [True]
        events = self.core.list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={pod.metadata.name},"
                                           f"reason=Unhealthy").items
        return started and not self._ready(pod) and any(
            "Readiness probe failed" in e.message and "NOT_SERVING" in e.message
            for e in events)

    def logs(self) -> str:
        return self.cluster.kubectl("-n", self.namespace, "logs", "--tail=40",
                                    f"deployment/{self.deployment['metadata']['name']}",
                                    check=False).stdout

    def exec_python(self, script: str) -> subprocess.CompletedProcess:
        """`script` in the reward container itself, outside the sandbox."""
        return self.cluster.kubectl("-n", self.namespace, "exec", self.name, "--", "python",
                                    "-c", script, check=False)

    def serving(self) -> bool:
        """The pod's grpc.health.v1 answer, as its readiness probe asks it."""
        channel, _ = self.stub()
        with channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=RPC_SECONDS)
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def stub(self) -> tuple[grpc.Channel, reward_pb2_grpc.RewardStub]:
        channel = grpc.insecure_channel(f"{self.ip}:{builders.REWARD_PORT}",
                                        options=[("grpc.enable_http_proxy", 0)])
        return channel, reward_pb2_grpc.RewardStub(channel)

    def sandbox_available(self) -> float:
        """The reward metric the troubleshooting table of docs/kubernetes.md names."""
        return pod_metrics(f"{self.ip}:{builders.REWARD_METRICS}")[
            "asyncrl_reward_sandbox_available"]


def start_pod(request, real_node, image, seccomp: str, *, root: bool) -> RewardPod:
    """Without root the sandbox cannot be built: that pod must run and stay unready."""
    pod = RewardPod(real_node, image, seccomp, root=root)
    request.addfinalizer(pod.stop)
    return pod.start(ready=root)


@pytest.fixture(scope="module", params=["RuntimeDefault", "Unconfined"])
def caged(request, real_node, image):
    """The reward pod as the operator builds it for a code job."""
    pod = start_pod(request, real_node, image, request.param, root=True)
    channel, stub = pod.stub()
    yield pod, stub
    channel.close()


def score(stub, job, *programs_and_references) -> list[tuple[float, int]]:
    tasks = [ScoreTask(f"t{i}", fenced(program), reference).to_pb()
             for i, (program, reference) in enumerate(programs_and_references)]
    reply = stub.ScoreBatch(reward_pb2.ScoreBatchRequest(job=job.metadata.name, tasks=tasks),
                            timeout=RPC_SECONDS)
    return [(r.score, r.failure) for r in reply.results]


# --------------------------------------------------------------------------- as built


def test_the_sandbox_cages_programs_with_namespaces(caged):
    pod, stub = caged
    assert pod.serving(), pod.logs()
    assert "code sandbox: namespaces isolation" in pod.logs()
    assert pod.sandbox_available() == 1


def test_a_correct_program_scores_1(caged):
    pod, stub = caged
    assert score(stub, pod.job, (CORRECT, ADD)) == [(1.0, reward_pb2.FAILURE_UNSPECIFIED)]


@pytest.fixture
def listener(real_node):
    """A TCP listener on the node's address, which the pod's own network reaches."""
    with socket.socket() as sock:
        sock.bind((real_node.plane.node_ip, 0))
        sock.listen()
        sock.settimeout(30)
        yield sock


def test_a_program_cannot_reach_the_network_the_pod_reaches(caged, listener):
    pod, stub = caged
    host, port = listener.getsockname()
    program = (f"import socket\nsocket.create_connection(({host!r}, {port}), timeout=5)\n"
               "print('connected')")
    # Outside the sandbox the pod reaches the listener: only the cage stops the program.
    outside = pod.exec_python(program)
    assert outside.stdout == "connected\n", outside.stderr
    listener.accept()[0].close()
    connected = CodeReference(io_cases=(IoCase("", "connected\n"),))
    assert score(stub, pod.job, (program, connected)) == [(0.0, reward_pb2.FAILURE_RUNTIME_ERROR)]
    listener.setblocking(False)
    with pytest.raises(BlockingIOError):
        listener.accept()  # nothing connected from the sandbox


def test_a_program_cannot_write_outside_its_folder(caged):
    pod, stub = caged
    name = f"escape-{secrets.token_hex(4)}"
    program = (f"import os\nfor path in ('/tmp/{name}', os.path.join('..', '{name}')):\n"
               "    try:\n        open(path, 'w').write('pwned')\n        print('WROTE')\n"
               "        break\n    except OSError:\n        pass")
    wrote = CodeReference(io_cases=(IoCase("", "WROTE\n"),))
    assert score(stub, pod.job, (program, wrote)) == [(0.0, reward_pb2.FAILURE_WRONG_ANSWER)]
    # /tmp is the pod's writable emptyDir, open to every uid: the cage kept the file out.
    listing = pod.exec_python("import os; print(sorted(os.listdir('/tmp')))")
    assert listing.returncode == 0 and name not in listing.stdout, listing


def test_a_program_cannot_see_the_service_or_its_environment(caged):
    pod, stub = caged
    # The service's command line names the job file, its environment (builders) holds
    # PYTHONUNBUFFERED; a program's own has neither.
    program = ("import glob, os\nseen = repr(dict(os.environ))\n"
               "for path in glob.glob('/proc/*/environ') + glob.glob('/proc/*/cmdline'):\n"
               "    try:\n        seen += open(path, 'rb').read().decode(errors='replace')\n"
               "    except OSError:\n        pass\n"
               f"print('LEAK' if 'PYTHONUNBUFFERED' in seen or {builders.JOB_FILE!r} in seen "
               "else 'clean')")
    leak = CodeReference(io_cases=(IoCase("", "LEAK\n"),))
    assert score(stub, pod.job, (program, leak)) == [(0.0, reward_pb2.FAILURE_WRONG_ANSWER)]


def test_bombs_score_0_and_the_next_correct_program_1(caged):
    pod, stub = caged
    results = score(stub, pod.job, (FORK_BOMB, ADD), ("x = bytearray(8 << 30)", ADD),
                    (KILLER, ADD))
    assert [s for s, _ in results] == [0.0, 0.0, 0.0], results
    assert score(stub, pod.job, (CORRECT, ADD)) == [(1.0, reward_pb2.FAILURE_UNSPECIFIED)]
    restarts = pod.core.read_namespaced_pod(pod.name, pod.namespace).status.container_statuses
    assert [c.restart_count for c in restarts] == [0]


# --------------------------------------------------------------------------- without root


@pytest.fixture(scope="module", params=[
    ("RuntimeDefault", "unshare: Operation not permitted"),
    ("Unconfined", "mount proc on /proc: Operation not permitted"),
], ids=["RuntimeDefault", "Unconfined"])
def uncaged(request, real_node, image):
    """The reward pod hardened like the job's other pods; (pod, what the kernel refused)."""
    seccomp, refused = request.param
    pod = start_pod(request, real_node, image, seccomp, root=False)
    return pod, refused


def test_without_root_no_seccomp_setting_lets_the_sandbox_run(uncaged):
    pod, refused = uncaged
    assert not pod.serving()  # and its readiness probe said so: it never became Ready
    assert refused in pod.logs()
    channel, stub = pod.stub()
    with channel:
        with pytest.raises(grpc.RpcError) as error:
            score(stub, pod.job, (CORRECT, ADD))
    assert error.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert refused in error.value.details()
    assert pod.sandbox_available() == 0
