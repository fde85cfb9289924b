"""The user's commands on a real one-node cluster, every pod a real container: `helm install` of
charts/asyncrl with the operator image built here (tests/cluster/images.sh), `kubectl apply` of
a CPU RLJob on the tiny model, then the faults and operations a platform team meets: the
trainer pod and the Redis pod deleted mid-run, `kubectl scale`, suspend and resume, and
`kubectl delete`. The job's run volume and its Redis volume are host folders here, so the test
reads what the job wrote (metrics.jsonl, Redis' append-only file) after the fact.

The tests run in file order on one job: each starts where the previous one left it. The last
ones run short jobs of their own: Megatron-Core training on prompts from the user's own JSONL
files, on a claim of theirs that the pods mount read-only, an episode job whose episode
function comes from such a claim, and jobs whose model is a Hub id, downloaded in the trainer
pod from a Hub stand-in on this machine (the chart's jobs.hubEndpoint points the operator at
it)."""

from __future__ import annotations

import fnmatch
import json
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest
import yaml
from kubernetes import client
from kubernetes.client.rest import ApiException

from asyncrl.model.hub import ALLOW_PATTERNS
from asyncrl.operator.builders.common import RUN_DIR
from asyncrl.operator.builders.model import FETCH_CONTAINER, WAIT_CONTAINER, ready_file
from asyncrl.spec import parse_manifest
from support import ROOT
from support.buffer import group_fates
from support.episodes import TWO_TURNS
from support.hub import HubStandIn, write_tiny_hub_model
from support.dashboard import expressions, load_dashboard, substitute
from support.ports import free_port
from support.prometheus import READY, Prometheus, prometheus_binary, stop, tail
from support.real_pods import (
    CLUSTER,
    JOB,
    MAX_STEPS,
    OPERATOR_NAMESPACE,
    RELEASE,
    base_image,
    images,
    pod_metrics,
    wait_for,
)

# The last test waits for the whole job: longer than the suite's default timeout.
pytestmark = [pytest.mark.real_node, pytest.mark.timeout(1800)]

#: The Hub stand-in's model: the tiny model, gated (its files need HUB_TOKEN).
HUB_REPO = "tiny-org/tiny-chat"
HUB_TOKEN = "hf_e2e_stand_in_token"


class Job:
    """The RLJob under test, read through the API as `kubectl get` would."""

    def __init__(self, cluster, namespace: str, volumes: Path):
        self.cluster, self.namespace, self.volumes = cluster, namespace, volumes
        self.max_steps = MAX_STEPS
        api = cluster.api_client()
        self.core, self.apps = client.CoreV1Api(api), client.AppsV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    @property
    def run_dir(self) -> Path:
        return self.volumes / "run"

    @property
    def redis_dir(self) -> Path:
        return self.volumes / "redis"

    def body(self) -> dict:
        return self.custom.get_namespaced_custom_object("asyncrl.io", "v1alpha1", self.namespace,
                                                        "rljobs", JOB)

    def status(self) -> dict:
        return self.body().get("status") or {}

    def condition(self, kind: str) -> dict:
        return next((c for c in self.status().get("conditions", []) if c["type"] == kind), {})

    def pods(self, component: str | None = None) -> list:
        selector = f"asyncrl.io/job={JOB}"
        if component:
            selector += f",app.kubernetes.io/component={component}"
        return self.core.list_namespaced_pod(self.namespace, label_selector=selector).items

    def ready_pods(self, component: str) -> list:
        return [p for p in self.pods(component) if p.metadata.deletion_timestamp is None and any(
            c.type == "Ready" and c.status == "True" for c in p.status.conditions or [])]

    def step(self) -> int:
        return self.status().get("trainerStep") or 0

    def train_records(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return [r for r in records if r.get("kind") == "train"]

    def steps_recorded(self) -> list[int]:
        return [r["step"] for r in self.train_records()]

    def describe(self) -> str:
        pods = "\n".join(
            f"  {p.metadata.name}: {p.status.phase} restarts="
            f"{sum(c.restart_count for c in p.status.container_statuses or [])}"
            for p in self.pods())
        operator = self.cluster.kubectl("-n", OPERATOR_NAMESPACE, "logs", "--tail=30",
                                        f"deployment/{RELEASE}-asyncrl-operator",
                                        check=False).stdout
        return (f"status: {json.dumps(self.status(), indent=1)}\npods:\n{pods}\n"
                f"operator log tail:\n{operator}")

    def logs(self, component: str, tail: int = 40) -> str:
        return "\n".join(self.cluster.kubectl("-n", self.namespace, "logs", f"--tail={tail}",
                                              p.metadata.name, check=False).stdout
                         for p in self.pods(component))

    def require_steps_left(self, steps: int) -> int:
        """The current step, failing (not waiting) when the job is too close to its end for
        the next fault to happen mid-run."""
        step = self.step()
        assert step + steps < MAX_STEPS, (
            f"the job is at step {step} of {MAX_STEPS}: too close to its end for a fault "
            f"mid-run; raise MAX_STEPS")
        return step

    def wait_step(self, at_least: int, timeout: float = 300) -> int:
        return wait_for(lambda: (s := self.step()) >= at_least and s, timeout,
                        f"trainer step {at_least}", self.describe)


def manifest(namespace: str) -> dict:
    """examples/tiny.yaml as a cluster job: Redis with its append-only file (the volume
    outlives the pod), small CPU requests (the node has 2 cores), enough steps to act on, and
    weights broadcast from the trainer pod to the rollout pods (falling back to the run
    volume when the faults below break the transfer group)."""
    data = yaml.safe_load((ROOT / "examples" / "tiny.yaml").read_text())
    data["metadata"] = {"name": JOB, "namespace": namespace}
    spec = data["spec"]
    spec["algorithm"]["maxSteps"] = MAX_STEPS
    spec["buffer"]["redis"]["persistence"] = "aof"
    spec["trainer"]["weightTransfer"] = "distributed"
    small = {"requests": {"cpu": "50m", "memory": "128Mi"}}
    for component in ("rollout", "trainer", "reward", "buffer"):
        spec.setdefault(component, {})["resources"] = small
    return data


def host_volume(name: str, path: Path, claim: str, namespace: str, mode: str) -> dict:
    """What a storage class would do: a volume bound in advance to the job's claim."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o777)  # the pods run as unprivileged users (asyncrl 10001, redis 999)
    return {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": name},
            "spec": {"capacity": {"storage": "20Gi"}, "accessModes": [mode],
                     "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                     "hostPath": {"path": str(path)},
                     "claimRef": {"namespace": namespace, "name": claim}}}


def users_claim(claim: str, namespace: str, volume: str) -> dict:
    """A claim the user made for their own files (dataset.volume names it), bound to `volume`:
    the job only reads it."""
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim, "namespace": namespace},
            "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "",
                     "volumeName": volume, "resources": {"requests": {"storage": "1Gi"}}}}


def arithmetic_rows(count: int, seed: int) -> list[dict]:
    """Problems with their answers, in the layout of the user's own file."""
    import random

    pick = random.Random(seed).randint
    rows = []
    for _ in range(count):
        a, b = pick(1, 20), pick(1, 20)
        rows.append({"question": f"What is {a} + {b}?", "answer": str(a + b)})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def hub(real_node, tmp_path_factory):
    """A stand-in for the Hugging Face Hub (support.hub) on the node's address, which pods
    reach the host at, serving the tiny model as HUB_REPO, gated by HUB_TOKEN."""
    folder = write_tiny_hub_model(tmp_path_factory.mktemp("hub-model"))
    with HubStandIn(host=real_node.plane.node_ip) as server:
        server.add_model(HUB_REPO, folder, gated_token=HUB_TOKEN)
        yield server


@pytest.fixture(scope="module")
def installed(real_node, hub):
    """The chart installed with the images built here; the operator runs in a pod, its jobs'
    Hub models come from the stand-in (jobs.hubEndpoint)."""
    built = images()
    for tar in (built["operator"][1], built["service"][1], base_image("redis")):
        real_node.import_image(tar)
    operator_repo, operator_tag = built["operator"][0].rsplit(":", 1)
    service_repo, service_tag = built["service"][0].rsplit(":", 1)
    helm = [str(real_node.binaries / "helm"), "--kubeconfig", str(real_node.kubeconfig)]
    subprocess.run([
        *helm, "install", RELEASE, str(ROOT / "charts" / "asyncrl"),
        "--namespace", OPERATOR_NAMESPACE, "--create-namespace", "--wait", "--timeout", "5m",
        "--set", f"operator.image.repository={operator_repo}",
        "--set", f"operator.image.tag={operator_tag}",
        "--set", "operator.image.pullPolicy=Never",
        "--set", "operator.statusInterval=2",
        "--set", f"jobs.image.repository={service_repo}",
        "--set", f"jobs.image.tag={service_tag}",
        "--set", "jobs.redis.image=asyncrl.local/redis:bookworm",
        "--set", f"jobs.hubEndpoint={hub.url}",
    ], check=True, capture_output=True, text=True)
    yield real_node
    subprocess.run([*helm, "uninstall", RELEASE, "--namespace", OPERATOR_NAMESPACE,
                    "--wait"], capture_output=True, text=True)


def start_job(cluster, volumes: Path, change=lambda data: None,
              users_claims: dict[str, Path] | None = None) -> Job:
    """manifest() in a namespace of its own with its volumes, after `change(manifest)`;
    `users_claims`: {claim: host folder} of the user's own files, read-only."""
    namespace = f"e2e-{uuid.uuid4().hex[:6]}"
    cluster.kubectl("create", "namespace", namespace)
    for claim, folder, mode in ((f"{JOB}-run", "run", "ReadWriteMany"),
                                (f"data-{JOB}-redis-0", "redis", "ReadWriteOnce")):
        pv = host_volume(f"{namespace}-{folder}", volumes / folder, claim, namespace, mode)
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(pv))
    for claim, folder in (users_claims or {}).items():
        pv = host_volume(f"{namespace}-{claim}", folder, claim, namespace, "ReadOnlyMany")
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(
            [pv, users_claim(claim, namespace, pv["metadata"]["name"])]))
    data = manifest(namespace)
    change(data)
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(data))
    return Job(cluster, namespace, volumes)


@pytest.fixture(scope="module")
def job(installed, tmp_path_factory):
    started = start_job(installed, tmp_path_factory.mktemp("volumes"))
    yield started
    installed.kubectl("delete", "namespace", started.namespace, "--wait=false", check=False)


def pod_targets(job: Job) -> list[dict]:
    """What the chart's PodMonitor selects, as Prometheus file_sd targets (Debian's Prometheus
    is built without Kubernetes discovery): every running pod of the job, its ports named
    "metrics" and "http", labelled with service (the component) and replica (the pod)."""
    targets = []
    for pod in job.pods():
        if pod.status.phase != "Running" or not pod.status.pod_ip:
            continue
        for container in pod.spec.containers:
            for port in container.ports or []:
                if port.name in ("metrics", "http"):
                    targets.append({
                        "targets": [f"{pod.status.pod_ip}:{port.container_port}"],
                        "labels": {"service": pod.metadata.labels[
                                       "app.kubernetes.io/component"],
                                   "replica": pod.metadata.name}})
    return targets


@pytest.fixture(scope="module")
def prometheus(job, tmp_path_factory):
    """The dashboard test's Prometheus on this machine, scraping the job's pods by their IPs
    (the node's pod network is routed from the host). `refresh()` rewrites its targets."""
    folder = tmp_path_factory.mktemp("prometheus")
    targets = folder / "targets.json"
    targets.write_text("[]")
    config = folder / "prometheus.yml"
    config.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "asyncrl-pods", "metrics_path": "/metrics",
                            "file_sd_configs": [{"files": [str(targets)],
                                                 "refresh_interval": "1s"}]}]}))
    port, log = free_port(), folder / "prometheus.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [prometheus_binary(), f"--config.file={config}",
             f"--storage.tsdb.path={folder / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}",
             "--log.level=warn"], stdout=out, stderr=subprocess.STDOUT)
    server = Prometheus(f"http://127.0.0.1:{port}")
    server.log = log
    server.refresh = lambda: targets.write_text(json.dumps(pod_targets(job)))

    def ready() -> bool:
        assert process.poll() is None, f"Prometheus exited:\n{tail(log)}"
        try:
            return server.http.get("/-/ready").status_code == 200
        except httpx.TransportError:
            return False

    wait_for(ready, 60, "Prometheus to be ready", lambda: tail(log))
    yield server
    stop(process, signal.SIGTERM, timeout=30)


# --------------------------------------------------------------------------- the suite


def test_every_child_becomes_ready_and_kubectl_get_shows_the_buffers_figures(job, prometheus):
    wait_for(lambda: job.status().get("phase") == "Running", 600, "the job to be Running",
             job.describe)
    for component in ("redis", "buffer", "reward", "rollout", "trainer"):
        assert job.ready_pods(component), f"no ready {component} pod\n{job.describe()}"
    job.wait_step(2)
    # The operator runs in a pod: it reaches the job's buffer through the cluster's DNS.
    reachable = wait_for(lambda: job.condition("BufferReachable").get("status") == "True",
                         120, "BufferReachable", job.describe)
    assert reachable
    status = wait_for(lambda: (s := job.status()).get("tokensPerSecond") and
                      s.get("stalenessMean") is not None and s, 120, "the job's figures",
                      job.describe)
    assert status["policyVersion"] >= 1 and status["trainerStep"] >= 2
    table = job.cluster.kubectl("-n", job.namespace, "get", "rljobs").stdout
    header, row = table.splitlines()[:2]
    assert header.split()[:6] == ["NAME", "PHASE", "VERSION", "STEP", "TOKENS/S", "STALENESS"]
    cells = row.split()
    assert cells[0] == JOB and cells[1] == "Running"
    assert int(cells[2]) >= 1 and int(cells[3]) >= 2 and float(cells[4]) > 0
    print(f"\n$ kubectl get rljobs\n{table}")


def test_prometheus_gets_data_for_every_dashboard_expression_from_the_pods(job, prometheus):
    ready = {expr.replace('"tiny"', f'"{JOB}"'): what for expr, what in READY.items()}
    # The operator's own series (asyncrl_operator_*) exist for autoscaled jobs only, and this
    # job broadcasts its weights (trainer.weightTransfer distributed), which autoscaling
    # refuses: tests/chart/test_dashboard_prometheus.py gets data for them from an autoscaled
    # `asyncrl run --metrics`.
    queries = [(where, substitute(expr, JOB)) for where, expr in expressions(load_dashboard())
               if "asyncrl_operator_" not in expr]

    def missing() -> list[str]:
        prometheus.refresh()  # pods come and go
        waiting = [what for expr, what in ready.items() if prometheus.failure(expr)]
        return waiting or [f"{where}: {why}: {expr}" for where, expr in queries
                           if (why := prometheus.failure(expr))]

    def targets() -> str:
        found = prometheus.http.get("/api/v1/targets").json()["data"]["activeTargets"]
        return (f"still missing: {missing()}\ntargets: "
                f"{[(t['labels'].get('replica'), t['health']) for t in found]}\n"
                f"{tail(prometheus.log)}")

    wait_for(lambda: not missing(), 300, "data for every dashboard expression", targets)
    services = {series["metric"]["service"] for series in prometheus.query("up == 1")}
    assert services >= {"buffer", "reward", "rollout", "trainer"}, services


def test_a_deleted_trainer_pod_comes_back_and_resumes_from_its_checkpoint(job):
    # A checkpoint every 2 steps (tiny.yaml): wait for one to be on the run volume.
    job.wait_step(3)
    job.require_steps_left(8)
    (trainer,) = job.pods("trainer")
    job.cluster.kubectl("-n", job.namespace, "delete", "pod", trainer.metadata.name,
                        "--grace-period=0", "--force")
    wait_for(lambda: any(p.metadata.uid != trainer.metadata.uid for p in
                         job.ready_pods("trainer")), 300, "a new trainer pod", job.describe)
    # The new pod starts from the newest checkpoint on the run volume, not from step 0.
    started = wait_for(lambda: re.search(r"trainer starts at step (\d+)",
                                         job.logs("trainer", tail=400)), 300,
                       "the new trainer to start", job.describe)
    assert int(started.group(1)) >= 2, job.logs("trainer")
    job.wait_step(int(started.group(1)) + 2)
    # The rollout pod finds the new trainer's transfer group and joins it: versions are
    # broadcast again, not left on disk for the rest of the job.
    wait_for(lambda: any(r["step"] > int(started.group(1)) and r["weight_transfer"] ==
                         "distributed" for r in job.train_records()), 300,
             "a version the new trainer broadcast",
             lambda: f"{job.logs('rollout', tail=40)}\n{job.describe()}")


def test_a_deleted_redis_pod_comes_back_on_its_volume_and_the_job_rides_through(job):
    before = job.require_steps_left(8)
    (redis,) = job.pods("redis")
    job.cluster.kubectl("-n", job.namespace, "delete", "pod", redis.metadata.name,
                        "--grace-period=0", "--force")
    wait_for(lambda: any(p.metadata.uid != redis.metadata.uid for p in job.ready_pods("redis")),
             300, "a new Redis pod", job.describe)
    job.wait_step(before + 2)
    # Nobody crash-looped through the outage: the services waited for Redis.
    for component in ("buffer", "rollout", "trainer"):
        for pod in job.pods(component):
            restarts = sum(c.restart_count for c in pod.status.container_statuses or [])
            previous = job.cluster.kubectl("-n", job.namespace, "logs", "--previous",
                                           "--tail=60", pod.metadata.name, check=False)
            assert restarts == 0, (f"{pod.metadata.name} restarted {restarts} times; its "
                                   f"previous log:\n{previous.stdout}{previous.stderr}\n"
                                   f"{job.describe()}")


def test_kubectl_scale_adds_a_rollout_pod_and_suspend_keeps_the_state(job, prometheus):
    job.require_steps_left(6)
    job.cluster.kubectl("-n", job.namespace, "scale", f"rljob/{JOB}", "--replicas=2")
    wait_for(lambda: len(job.ready_pods("rollout")) == 2, 300, "two ready rollout pods",
             job.describe)
    # The new pod takes slots from the same staleness gate: both generate.
    query = f'asyncrl_rollout_generated_tokens_total{{rljob="{JOB}"}} > 0'

    def generating() -> set[str]:
        prometheus.refresh()
        return {s["metric"]["replica"] for s in prometheus.query(query)} & {
            p.metadata.name for p in job.ready_pods("rollout")}

    wait_for(lambda: len(generating()) == 2, 300, "both rollout pods to generate",
             lambda: f"generating: {generating()}\n{job.describe()}")

    job.cluster.kubectl("-n", job.namespace, "patch", f"rljob/{JOB}", "--type=merge",
                        "-p", '{"spec": {"suspend": true}}')
    wait_for(lambda: job.status().get("phase") == "Suspended" and not any(
        job.pods(c) for c in ("rollout", "trainer", "reward")), 300,
        "rollout, trainer and reward pods to be gone", job.describe)
    assert job.ready_pods("redis"), "Redis must stay while suspended"
    assert job.core.read_namespaced_persistent_volume_claim(f"{JOB}-run", job.namespace)
    # The trainer may have trained a step or two that its status never showed: the run
    # volume's record is the truth.
    suspended_at = max([job.step(), *job.steps_recorded()])

    # Resume, and end the job a few steps on (nothing trains while suspended).
    job.max_steps = suspended_at + 6
    job.cluster.kubectl("-n", job.namespace, "patch", f"rljob/{JOB}", "--type=merge", "-p",
                        json.dumps({"spec": {"suspend": False,
                                             "algorithm": {"maxSteps": job.max_steps}}}))
    wait_for(lambda: len(job.ready_pods("rollout")) == 2 and job.ready_pods("trainer"), 300,
             "the workers to be back", job.describe)


def test_the_job_succeeds_with_every_step_recorded_once_and_no_sample_lost(job):
    wait_for(lambda: job.status().get("phase") == "Succeeded", 900, "Succeeded", job.describe)
    status = job.status()
    # The trainer's restart from its checkpoint republished under a new version, so the
    # version may run ahead of the step; the step is exact.
    assert status["trainerStep"] == job.max_steps and status["policyVersion"] >= job.max_steps
    # Nothing along the way counted as a failure: not the deleted pods, not the suspend.
    warnings = job.cluster.kubectl(
        "-n", job.namespace, "get", "events", "-o", "name",
        "--field-selector", f"involvedObject.kind=RLJob,involvedObject.name={JOB},type=Warning")
    assert not warnings.stdout.strip(), job.cluster.kubectl(
        "-n", job.namespace, "describe", "rljob", JOB).stdout
    assert job.steps_recorded() == list(range(1, job.max_steps + 1))
    # Versions went pod to pod over the transfer group, and through the run volume while a
    # rollout pod was not in it: before every pod had joined (on a loaded machine the first
    # steps can come first) and once a fault had broken it.
    transfers = [r["weight_transfer"] for r in job.train_records()]
    assert "distributed" in transfers and set(transfers) <= {"distributed", "disk"}, transfers
    print(f"\nweight transfer per step: {transfers}")
    # What a user sees at the end (docs/kubernetes.md shows it).
    for command in (("get", "rljobs"), ("describe", "rljob", JOB), ("get", "pods")):
        shown = job.cluster.kubectl("-n", job.namespace, *command).stdout
        print(f"\n$ kubectl {' '.join(command)}\n{shown}")


def test_kubectl_delete_removes_every_child_and_redis_kept_every_accepted_sample(job):
    job.cluster.kubectl("-n", job.namespace, "delete", "rljob", JOB, "--wait=true")

    def leftovers() -> list[str]:
        names = [p.metadata.name for p in job.pods()]
        for lister in (job.apps.list_namespaced_deployment, job.apps.list_namespaced_stateful_set,
                       job.core.list_namespaced_service, job.core.list_namespaced_config_map,
                       job.core.list_namespaced_secret):
            names += [o.metadata.name for o in lister(job.namespace,
                                                      label_selector=f"asyncrl.io/job={JOB}").items]
        return names

    wait_for(lambda: not leftovers(), 300, "every child to be removed",
             lambda: f"left: {leftovers()}")
    # Redis has stopped: its append-only file holds the whole history of the buffer.
    fates = group_fates(job.redis_dir, JOB)
    assert len(set(fates.accepted)) == len(fates.accepted)
    fates.assert_each_prompt_used_once()  # across the faults, the scale and the suspend
    assert len(fates.trained) >= job.max_steps * 2  # batchSize 2 groups per step


def rollout_generated(job: Job) -> dict[str, float]:
    """Each running rollout pod's asyncrl_rollout_generated_tokens_total, read from the pod's
    own metrics endpoint."""
    found: dict[str, float] = {}
    for target in pod_targets(job):
        if target["labels"]["service"] != "rollout":
            continue
        try:
            metrics = pod_metrics(target["targets"][0], timeout=5)
        except OSError:
            continue
        replica = target["labels"]["replica"]
        found[replica] = (found.get(replica, 0.0)
                          + metrics.get("asyncrl_rollout_generated_tokens_total", 0.0))
    return found


def job_events(job: Job, reason: str) -> list:
    return job.core.list_namespaced_event(
        job.namespace, field_selector=f"involvedObject.name={JOB},reason={reason}").items


def test_an_autoscaled_rollout_scales_out_while_the_trainer_waits_and_back_in(
        installed, tmp_path_factory):
    # η = 0: the trainer waits for each batch while one rollout pod generates it, so the
    # operator scales the rollout out to its maximum, the new pod starting on the current
    # policy. Then the platform team lets the trainer wait up to 98% of its time (the trainer
    # has caught up with what the job asks of it): the operator scales back in, without a
    # restart of the pods that keep running, and the pod scaled away hands its prompts back.
    # The targets leave wide margins on this node (2 cores): the trainer waits 15-25% of its
    # time, any wait scales out (target 0, no tolerance), and two engines generating ~30-45%
    # of theirs need one (2 x 0.45 rounds up to 1 at target 1).
    def autoscaled(manifest: dict) -> None:
        spec = manifest["spec"]
        spec["algorithm"]["maxStaleness"] = 0
        spec["trainer"]["weightTransfer"] = "disk"  # a new pod cannot join a broadcast group
        spec["rollout"]["maxNewTokens"] = 8  # shorter generation: engines idle more
        spec["rollout"]["autoscale"] = {"maxReplicas": 2, "cooldownSeconds": 10,
                                        "targetTrainerIdle": 0.0, "targetRolloutBusy": 0.05,
                                        "tolerance": 0.0}

    job = start_job(installed, tmp_path_factory.mktemp("autoscaled"), autoscaled)
    try:
        def scaling() -> dict:
            return job.status().get("autoscaling") or {}

        out = wait_for(lambda: (s := scaling()).get("replicas") == 2 and s, 600,
                       "the autoscaler to scale out", job.describe)
        # The status says the decision until the next look reads the signals again; the
        # Event keeps it (kubectl describe).
        assert out["active"] and out.get("lastScaleTime"), out
        print(f"\nscaled out: {json.dumps(out)}")
        [event] = job_events(job, "ScaledOut")
        assert event.message.startswith("1 -> 2 rollout replicas: over"), event.message
        assert "the trainer waited" in event.message
        assert job.body()["spec"]["rollout"]["replicas"] == 1  # the spec is the user's
        version_at_scale_out = job.status()["policyVersion"]
        trainer_pod = job.pods("trainer")[0].metadata.name
        kept = {p.metadata.name for p in job.ready_pods("rollout")}
        wait_for(lambda: len(job.ready_pods("rollout")) == 2, 300, "two ready rollout pods",
                 job.describe)
        # The new pod loads the newest weights when it starts, and takes prompts beside the
        # first one.
        wait_for(lambda: len([v for v in rollout_generated(job).values() if v > 0]) == 2, 300,
                 "both rollout pods to generate",
                 lambda: f"generated: {rollout_generated(job)}\n{job.describe()}")
        [added] = {p.metadata.name for p in job.ready_pods("rollout")} - kept
        loaded = installed.kubectl("-n", job.namespace, "logs", added).stdout
        first = re.search(r"version (\d+) applied", loaded)
        assert first and int(first[1]) >= version_at_scale_out, loaded[-3000:]

        job.cluster.kubectl("-n", job.namespace, "patch", f"rljob/{JOB}", "--type=merge",
                            "-p", json.dumps({"spec": {"rollout": {"autoscale": {
                                "targetTrainerIdle": 0.98, "targetRolloutBusy": 1.0}}}}))
        back = wait_for(lambda: (s := scaling()).get("replicas") == 1 and s, 300,
                        "the autoscaler to scale in",
                        lambda: f"{json.dumps(scaling())}\n{job.describe()}")
        assert back["active"] and back["lastScaleTime"] > out["lastScaleTime"], back
        print(f"scaled in: {json.dumps(back)}")
        [event] = job_events(job, "ScaledIn")
        assert event.message.startswith("2 -> 1 rollout replicas"), event.message
        wait_for(lambda: len(job.pods("rollout")) == 1, 300, "one rollout pod", job.describe)
        # Retuning the autoscaler restarted nothing: the trainer pod is the same one.
        assert [p.metadata.name for p in job.pods("trainer")] == [trainer_pod]
        at = job.step()
        job.wait_step(at + 3)

        job.cluster.kubectl("-n", job.namespace, "delete", "rljob", JOB, "--wait=true")
        wait_for(lambda: not job.pods(), 300, "every pod to be gone", job.describe)
        # Redis has stopped: its append-only file says what became of every prompt handed
        # out, to either pod, before and after the scaling.
        fates = group_fates(job.redis_dir, JOB)
        fates.assert_each_prompt_used_once()
        print(f"prompts: {len(fates.cursors)} accepted of {fates.next_cursor} handed out, "
              f"{len(fates.held + fates.to_reissue)} pending")
    finally:
        installed.kubectl("delete", "namespace", job.namespace, "--wait=false", check=False)


def test_a_megatron_core_job_trains_in_pods_on_the_users_files_to_the_end(installed,
                                                                          tmp_path_factory):
    # trainer.backend: megatron, in the service image, under the operator's torchrun command;
    # its prompts from the user's JSONL files on a claim of theirs (dataset.volume), which the
    # rollout pod (training prompts) and the trainer pod (evaluation prompts) mount read-only.
    volumes = tmp_path_factory.mktemp("megatron")
    data = volumes / "prompts"
    write_jsonl(data / "arith" / "train.jsonl", arithmetic_rows(24, seed=1))
    write_jsonl(data / "arith" / "test.jsonl", arithmetic_rows(4, seed=2))

    def megatron_on_files(manifest: dict) -> None:
        spec = manifest["spec"]
        spec["algorithm"]["maxSteps"] = 3
        spec["trainer"]["backend"] = "megatron"
        spec["dataset"] = {"kind": "file", "path": "/data/arith/train.jsonl",
                           "evalPath": "/data/arith/test.jsonl", "volume": "prompts",
                           "fields": {"prompt": "question", "answer": "answer"}}

    megatron_job = start_job(installed, volumes, megatron_on_files, users_claims={"prompts": data})
    megatron_job.max_steps = 3
    try:
        (rollout,) = wait_for(lambda: megatron_job.ready_pods("rollout"), 600,
                              "a ready rollout pod", megatron_job.describe)
        # The claim's folder is open to everyone (host_volume): only the mount keeps the pod
        # from writing to it.
        write = megatron_job.cluster.kubectl(
            "-n", megatron_job.namespace, "exec", rollout.metadata.name, "--", "python3", "-c",
            "open('/data/written-by-the-pod', 'w')", check=False)
        assert write.returncode != 0 and "Read-only file system" in write.stderr, write
        wait_for(lambda: megatron_job.status().get("phase") == "Succeeded", 600, "Succeeded",
                 megatron_job.describe)
        assert megatron_job.steps_recorded() == [1, 2, 3]
        assert {r["backend"] for r in megatron_job.train_records()} == {"megatron"}
        # The trainer evaluated on evalPath's prompts from the claim.
        records = [json.loads(line) for line in
                   (megatron_job.run_dir / "metrics.jsonl").read_text().splitlines()]
        assert [r for r in records if r.get("kind") == "eval"], records[-3:]
        assert [p.name for p in data.iterdir()] == ["arith"]
    finally:
        installed.kubectl("delete", "namespace", megatron_job.namespace, "--wait=false",
                          check=False)


def test_an_episode_job_runs_the_users_code_from_their_claim_to_succeeded(installed,
                                                                          tmp_path_factory):
    # rollout.workflow.kind: episode, the episode function on a claim of the user's
    # (workflow.volume), mounted read-only in the rollout pod; its calls go to the worker's
    # own OpenAI-compatible API inside the pod. The model trains a LoRA adapter (model.lora):
    # each version and checkpoint is the adapter, on the run volume as a peft directory.
    volumes = tmp_path_factory.mktemp("episodes")
    claim = volumes / "claim"  # mounted at /episodes, the first folder of workflow.path
    (claim / "mine").mkdir(parents=True)
    (claim / "mine" / "my_episodes.py").write_text(TWO_TURNS)

    def episodes(manifest: dict) -> None:
        spec = manifest["spec"]
        spec["algorithm"]["maxSteps"] = 2
        spec["algorithm"]["skipUniformGroups"] = False
        spec["model"]["lora"] = {"rank": 4, "alpha": 8}
        spec["rollout"]["workflow"] = {
            "kind": "episode", "function": "my_episodes:episode", "path": "/episodes/mine",
            "volume": "episodes", "maxTurns": 2, "maxContextTokens": 512}

    episode_job = start_job(installed, volumes, episodes, users_claims={"episodes": claim})
    episode_job.max_steps = 2
    try:
        wait_for(lambda: episode_job.status().get("phase") in ("Succeeded", "Failed"), 600,
                 "Succeeded", episode_job.describe)
        assert episode_job.status()["phase"] == "Succeeded", episode_job.describe()
        assert episode_job.steps_recorded() == [1, 2]
        # Each episode's two answers came back as one sample (groupSize 2, batchSize 2).
        assert {r["trained_samples"] for r in episode_job.train_records()} == {4}
        # Each version moved the adapter only, float32: 2 layers x rank 4 x (in + out) of the
        # q, k, v, o, gate, up and down projections (hidden 64, key/value 32, MLP 128).
        adapter_bytes = 2 * 4 * (128 + 96 + 96 + 128 + 192 + 192 + 192) * 4
        assert {r["version_bytes"] for r in episode_job.train_records()} == {adapter_bytes}
        (checkpoint,) = (episode_job.run_dir / "checkpoints").glob("step-*")
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {
            p.name for p in checkpoint.iterdir()}
        # The user's tools run in the rollout pod: its egress is held to the job's services.
        policy = client.NetworkingV1Api(installed.api_client()).read_namespaced_network_policy(
            f"{JOB}-rollout", episode_job.namespace)
        assert policy.spec.policy_types == ["Egress"]
    finally:
        installed.kubectl("delete", "namespace", episode_job.namespace, "--wait=false",
                          check=False)


def hub_model(source: str, token_secret: str | None = None):
    """A change for start_job: a two-step job on the Hub model `source`."""
    def change(manifest: dict) -> None:
        manifest["spec"]["algorithm"]["maxSteps"] = 2
        manifest["spec"]["model"] = {"source": source}
        if token_secret:
            manifest["spec"]["model"]["hubTokenSecret"] = {"name": token_secret, "key": "token"}
    return change


def init_container_state(pod, name: str) -> dict:
    """The state of the pod's init container `name` as the API shows it ({} before any)."""
    status = next((c for c in pod.status.init_container_statuses or [] if c.name == name), None)
    return status.state.to_dict() if status else {}


def test_a_hub_model_is_downloaded_once_by_the_trainer_pod_and_the_job_succeeds(
        installed, hub, tmp_path_factory):
    # model.source a Hub id of a gated model, the token in the Secret hubTokenSecret names;
    # the trainer pod's fetch-model init container downloads it into the run volume (from the
    # stand-in: the operator's HF_ENDPOINT), the rollout pod's wait-for-model waits for its
    # ready file, and both load it from there with the Hub off.
    volumes = tmp_path_factory.mktemp("hub-job")
    change = hub_model(HUB_REPO, token_secret="hf-token")
    hub_job = start_job(installed, volumes, change)
    hub_job.max_steps = 2
    repo = hub.repos[HUB_REPO]
    try:
        # The token's Secret is created after the job, as a user may: until then the trainer
        # pod's download cannot start, and the rollout pod waits.
        def rollout_waiting() -> bool:
            return any("waiting for the trainer pods to download the model" in
                       installed.kubectl("-n", hub_job.namespace, "logs", pod.metadata.name,
                                         "-c", WAIT_CONTAINER, check=False).stdout
                       for pod in hub_job.pods("rollout"))

        wait_for(rollout_waiting, 300, "the rollout pod to wait for the model",
                 hub_job.describe)

        def fetch_blocked() -> bool:
            return [(init_container_state(pod, FETCH_CONTAINER).get("waiting") or {}).get(
                "reason") for pod in hub_job.pods("trainer")] == ["CreateContainerConfigError"]

        wait_for(fetch_blocked, 120, "the trainer pod's download to wait for its Secret",
                 hub_job.describe)
        assert repo.downloads == []
        installed.kubectl("-n", hub_job.namespace, "create", "secret", "generic", "hf-token",
                          f"--from-literal=token={HUB_TOKEN}")

        wait_for(lambda: hub_job.status().get("phase") in ("Succeeded", "Failed"), 600,
                 "Succeeded", hub_job.describe)
        assert hub_job.status()["phase"] == "Succeeded", hub_job.describe()
        assert hub_job.steps_recorded() == [1, 2]
        # Downloaded once, by the trainer pod: each file a job loads, and nothing else of the
        # repository (another format, a pickle).
        wanted = sorted(name for name in repo.files
                        if any(fnmatch.fnmatch(name, pattern) for pattern in ALLOW_PATTERNS))
        assert sorted(repo.downloads) == wanted, repo.downloads
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(wanted)
        # The ready file the rollout pod waited for names the snapshot on the run volume.
        spec = manifest(hub_job.namespace)
        change(spec)
        ready = ready_file(parse_manifest(spec))
        snapshot = Path((hub_job.run_dir / Path(ready).relative_to(RUN_DIR)).read_text().strip())
        on_host = hub_job.run_dir / snapshot.relative_to(RUN_DIR)
        assert snapshot.name == repo.refs["main"]
        assert sorted(p.name for p in on_host.iterdir()) == sorted(wanted)
        # The trainer's last checkpoint, a model folder, is on the run volume.
        checkpoint = hub_job.run_dir / "checkpoints" / "step-000002"
        assert {"model.safetensors", "config.json", "state.json"} <= {
            p.name for p in checkpoint.iterdir()}, sorted(checkpoint.iterdir())
    finally:
        installed.kubectl("delete", "namespace", hub_job.namespace, "--wait=false",
                          check=False)


def test_a_hub_id_the_hub_does_not_know_fails_the_job_saying_why(installed, hub,
                                                                  tmp_path_factory):
    volumes = tmp_path_factory.mktemp("hub-missing")
    missing = start_job(installed, volumes, hub_model("tiny-org/no-such-model"))
    try:
        wait_for(lambda: missing.status().get("phase") in ("Failed", "Succeeded"), 300,
                 "Failed", missing.describe)
        assert missing.status()["phase"] == "Failed", missing.describe()
        failed = missing.condition("Failed")
        assert failed["status"] == "True" and failed["reason"] == "ModelDownloadFailed", failed
        # The download's own one-line error, from the pod's termination message.
        assert failed["message"].startswith(
            f"downloading the model failed: model.source 'tiny-org/no-such-model': no such "
            f"model on the Hub ({hub.url})"), failed["message"]
        assert not (missing.run_dir / "metrics.jsonl").exists()
    finally:
        installed.kubectl("delete", "namespace", missing.namespace, "--wait=false",
                          check=False)
