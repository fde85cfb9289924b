"""The operator against a real control plane (tests/cluster): kube-apiserver with the generated
CRD, kube-controller-manager (Deployments -> ReplicaSets -> Pods, garbage collection, volume
binding), kube-scheduler, and kwok fake nodes (CPU nodes and a tainted GPU pool) that run pods
without containers. The operator runs as `asyncrl operator`, a separate process, exactly as a
user would run it against their kubeconfig.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import time
import uuid

import pytest
import yaml

from asyncrl.operator.builders import OperatorConfig, rollout_network_policy
from asyncrl.platform.settings import SGLANG_STARTUP_SECONDS
from asyncrl.spec import parse_manifest

from support import ROOT
from support.operator_cluster import (  # noqa: F401 - fixtures among them
    ASYNCRL,
    RESYNC_SECONDS,
    kube,
    crd,
    OperatorProcess,
    operator,
    namespace,
    events_about,
    wait_for,
    _exists,
    manifest,
    provide_claim,
    provide_run_volume,
    create_job,
    read_job,
    patch_spec,
    status_of,
    phase_is,
    children,
    pods_of,
    expected,
    start_running_job,
)

pytestmark = pytest.mark.slow

# --------------------------------------------------------------------------- tests


def test_crd_is_served_with_scale_and_status(kube, crd):
    served = kube.ext.read_custom_resource_definition("rljobs.asyncrl.io")
    version = served.spec.versions[0]
    assert version.subresources.scale.spec_replicas_path == ".spec.rollout.replicas"
    assert version.subresources.status is not None
    assert [c.name for c in version.additional_printer_columns] == [
        "Phase", "Version", "Step", "Tokens/s", "Staleness", "Reward", "Eval", "Age"]


@pytest.mark.parametrize(("change", "field", "words"), [
    ({"rollout__replicas": "two"}, "spec.rollout.replicas", "must be of type integer"),
    ({"rollout__replicas": -1}, "spec.rollout.replicas", "greater than or equal to 1"),
    ({"algorithm__maxStaleness": -1}, "spec.algorithm.maxStaleness", "greater than or equal to 0"),
    ({"rollout__engine": "vllm"}, "spec.rollout.engine", "Unsupported value"),
    ({"trainer__placement": {"gpus": 2}}, "spec.trainer.placement.nodeSelector",
     "no GPU node pool is selected"),
    # Would be silently trained with pytorch.
    ({"trainer__backend": "deepspeed"}, "spec.trainer.backend",
     'Unsupported value: \\"deepspeed\\"'),  # (quotes as the JSON body escapes them)
    # Settings that leave every advantage 0: the job could never learn.
    ({"algorithm__groupSize": 1}, "spec.algorithm.groupSize", "greater than or equal to 2"),
    ({"rollout__temperature": 0}, "spec.rollout.temperature", "greater than 0"),
    # Accepted before and ignored: the managed Redis serves no TLS.
    ({"buffer__redis": {"tls": True}}, "spec.buffer.redis.tls", "the managed Redis serves plain"),
    # Accepted before, and then the rollout workers and trainer failed at start-up.
    ({"dataset__kind": "jsonl"}, "spec.dataset.kind", 'Unsupported value: \\"jsonl\\"'),
    # The CRD's CEL rule: a file dataset with no files.
    ({"dataset": {"kind": "file"}}, "spec.dataset.path", "kind file reads prompts from files"),
    # ... and file settings on a generated dataset, which would be ignored.
    ({"dataset": {"kind": "arith", "path": "/data/p.jsonl"}}, "spec.dataset.kind",
     "read only with kind file"),
    # The workflow's CEL rules: an episode job without its function, and episode settings on
    # a single-turn job.
    ({"rollout__workflow": {"kind": "episode"}}, "spec.rollout.workflow.function",
     "kind episode runs a function of yours"),
    ({"rollout__workflow": {"egress": ["10.0.0.0/8"]}}, "spec.rollout.workflow.kind",
     "read only with kind episode"),
])
def test_the_api_server_rejects_invalid_specs_naming_the_field(kube, crd, namespace, change,
                                                                field, words):
    from kubernetes.client.rest import ApiException

    with pytest.raises(ApiException) as caught:
        create_job(kube, manifest("bad", namespace, **change))
    assert caught.value.status == 422
    assert field in caught.value.body and words in caught.value.body, caught.value.body


def test_unknown_fields_are_rejected_with_strict_validation(kube, crd, namespace):
    from kubernetes.client.rest import ApiException

    with pytest.raises(ApiException) as caught:
        kube.custom.create_namespaced_custom_object(
            "asyncrl.io", "v1alpha1", namespace, "rljobs",
            manifest("bad", namespace, rollout__replica=2), field_validation="Strict")
    assert caught.value.status == 400
    message = json.loads(caught.value.body)["message"]
    assert 'unknown field "spec.rollout.replica"' in message, message


def test_operator_rejects_what_only_the_model_checks_and_creates_nothing(kube, operator,
                                                                         namespace):
    # Cross-field rule the schema cannot state: dataset kind code is scored by reward kind code.
    create_job(kube, manifest("mixed", namespace, dataset__kind="code"))
    status = wait_for(phase_is(kube, namespace, "mixed", "Failed"), 30, "Failed", operator)
    valid = next(c for c in status["conditions"] if c["type"] == "Valid")
    assert (valid["status"], valid["reason"]) == ("False", "InvalidSpec")
    assert "spec.reward.kind" in valid["message"] and "set reward.kind: code" in valid["message"]
    # A resync pass must not create anything either. A pass is seen when a deleted child of a
    # valid job comes back (only the resync recreates children); passes run one after another,
    # so a second comeback means a whole pass ran after "mixed" had failed.
    def valid_buffer() -> bool:
        found = kube.apps.list_namespaced_deployment(
            namespace, field_selector="metadata.name=valid-buffer").items
        return bool(found) and found[0].metadata.deletion_timestamp is None

    create_job(kube, manifest("valid", namespace))
    wait_for(valid_buffer, 60, "valid-buffer", operator)
    for _ in range(2):
        kube.apps.delete_namespaced_deployment("valid-buffer", namespace)
        wait_for(valid_buffer, 60, "valid-buffer to be recreated by a resync pass", operator)
    assert all(not names for names in children(kube, namespace, "mixed").values())
    events = events_about(kube, namespace, "mixed", "InvalidSpec", operator)
    assert any(e.type == "Warning" and e.reason == "InvalidSpec" for e in events)


def test_apply_creates_owned_children_and_runs_gpu_pods_on_gpu_nodes(kube, operator, namespace):
    status = start_running_job(kube, operator, namespace)
    job = read_job(kube, namespace, "tiny")
    found = children(kube, namespace, "tiny")
    pods = found.pop("Pod")
    assert found == expected("tiny")
    assert len(pods) == 5  # redis, buffer, reward, trainer, one rollout worker

    uid = job["metadata"]["uid"]
    for kind, names in found.items():
        for name in names:
            obj = kube.api.sanitize_for_serialization(_read(kube, kind, namespace, name))
            (ref,) = obj["metadata"]["ownerReferences"]
            assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == \
                ("RLJob", "tiny", uid, True)

    rollout = kube.apps.read_namespaced_deployment("tiny-rollout", namespace)
    container = rollout.spec.template.spec.containers[0]
    assert container.resources.limits["nvidia.com/gpu"] == "1"
    # The GPU rollout runs the GPU image, the CPU trainer the CPU one.
    assert container.image == "example.org/asyncrl:test-gpu"
    trainer = kube.apps.read_namespaced_stateful_set("tiny-trainer", namespace)
    assert trainer.spec.template.spec.containers[0].image == "example.org/asyncrl:test"
    assert container.args[:2] == ["serve", "rollout"]
    assert rollout.spec.template.spec.node_selector == {"node-pool": "gpu"}
    # The scheduler put GPU pods on the GPU pool and everything else on CPU nodes.
    for pod in pods_of(kube, namespace, "tiny", "rollout"):
        assert pod.spec.node_name.startswith("kwok-gpu-"), pod.spec.node_name
    for component in ("redis", "buffer", "reward", "trainer"):
        for pod in pods_of(kube, namespace, "tiny", component):
            assert pod.spec.node_name.startswith("kwok-cpu-"), (component, pod.spec.node_name)
            assert pod.status.phase == "Running"

    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "True"
    assert status["rolloutReplicas"] == status["rolloutReadyReplicas"] == 1
    buffer = next(c for c in status["conditions"] if c["type"] == "BufferReachable")
    assert buffer["status"] == "False"  # the pods run no containers; the operator says so
    trainer = next(c for c in status["conditions"] if c["type"] == "TrainerReachable")
    assert (trainer["status"], trainer["reason"]) == ("False", "GetStatusFailed")
    assert trainer["message"].startswith(f"tiny-trainer-0.tiny-trainer-headless.{namespace}"
                                         f".svc:50071: "), trainer
    events = events_about(kube, namespace, "tiny", "Running", operator)
    # One event per phase transition. Starting is skipped when kwok made every pod ready
    # before the operator's first look (a loaded machine); Running is announced either way.
    messages = {e.reason: e.message for e in events}
    assert sorted(r.reason for r in events) in (["Running", "Starting"], ["Running"]), messages
    assert messages["Running"] == f"Phase {'Starting' if 'Starting' in messages else 'none'}" \
                                  f" -> Running.", messages


def test_the_users_claims_reach_the_pods_that_read_them_read_only(kube, operator, namespace):
    # A file dataset and a python reward, each on a claim of the user's: the pods that read
    # them schedule only once their claims are bound, so Running says the claims were found.
    for claim in ("prompts", "reward-code"):
        provide_claim(kube, namespace, claim)
    start_running_job(kube, operator, namespace, dataset={
        "kind": "file", "path": "/data/arith/train.jsonl", "evalPath": "/data/arith/test.jsonl",
        "volume": "prompts", "fields": {"prompt": "question", "answer": "answer"},
    }, reward={"kind": "python", "python": {"function": "mine.score:reward",
                                            "path": "/rewards/mine", "volume": "reward-code"}})

    def mounts(component: str) -> dict[str, tuple[str, bool, bool]]:
        """{claim: (folder, volume read-only, mount read-only)} of the component's pod."""
        (pod,) = pods_of(kube, namespace, "tiny", component)
        assert pod.status.phase == "Running", (component, pod.status.phase)
        claims = {v.name: v.persistent_volume_claim for v in pod.spec.volumes
                  if v.persistent_volume_claim}
        return {claims[m.name].claim_name: (m.mount_path, bool(claims[m.name].read_only),
                                            bool(m.read_only))
                for m in pod.spec.containers[0].volume_mounts if m.name in claims}

    assert mounts("rollout") == {"tiny-run": ("/run/asyncrl", False, True),
                                 "prompts": ("/data", True, True)}
    assert mounts("trainer") == {"tiny-run": ("/run/asyncrl", False, False),
                                 "prompts": ("/data", True, True)}
    assert mounts("reward") == {"reward-code": ("/rewards", True, True)}
    for component in ("redis", "buffer"):
        assert not {"prompts", "reward-code"} & set(mounts(component)), component


def test_an_episode_job_mounts_its_code_and_limits_its_rollout_pods_egress(kube, operator,
                                                                          namespace):
    provide_claim(kube, namespace, "episode-code")
    episode = {"rollout__workflow": {
        "kind": "episode", "function": "tools.search:episode", "path": "/episodes/tools",
        "volume": "episode-code", "egress": ["10.20.0.0/16", "2001:db8::/32"]},
        "trainer__microBatchMaxTokens": 2048}  # a micro-batch holds a whole conversation
    start_running_job(kube, operator, namespace, **episode)
    (pod,) = pods_of(kube, namespace, "tiny", "rollout")
    (volume,) = [v for v in pod.spec.volumes if v.name == "workflow"]
    (mount,) = [m for m in pod.spec.containers[0].volume_mounts if m.name == "workflow"]
    assert (volume.persistent_volume_claim.claim_name, volume.persistent_volume_claim.read_only,
            mount.mount_path, mount.read_only) == ("episode-code", True, "/episodes", True)
    # The API server keeps the policy as built (so applying it again changes nothing).
    policy = kube.api.sanitize_for_serialization(
        kube.networking.read_namespaced_network_policy("tiny-rollout", namespace))
    job = parse_manifest(manifest("tiny", namespace, **episode))
    assert policy["spec"] == rollout_network_policy(job, OperatorConfig())["spec"]


def _read(kube, kind, namespace, name):
    return {
        "ConfigMap": kube.core.read_namespaced_config_map,
        "Secret": kube.core.read_namespaced_secret,
        "Service": kube.core.read_namespaced_service,
        "PersistentVolumeClaim": kube.core.read_namespaced_persistent_volume_claim,
        "Deployment": kube.apps.read_namespaced_deployment,
        "StatefulSet": kube.apps.read_namespaced_stateful_set,
        "NetworkPolicy": kube.networking.read_namespaced_network_policy,
    }[kind](name, namespace)


def test_scale_update_suspend_resume(kube, operator, namespace):
    start_running_job(kube, operator, namespace)
    secret = kube.core.read_namespaced_secret("tiny-redis", namespace).data

    # kubectl scale rljob/tiny --replicas=3 (the scale subresource)
    kube.custom.patch_namespaced_custom_object_scale(
        "asyncrl.io", "v1alpha1", namespace, "rljobs", "tiny", {"spec": {"replicas": 3}},
        _content_type="application/merge-patch+json")
    status = wait_for(phase_is(kube, namespace, "tiny", "Running"), 60, "Running with 3",
                      operator)
    wait_for(lambda: len([p for p in pods_of(kube, namespace, "tiny", "rollout")
                          if p.status.phase == "Running"]) == 3, 60, "3 rollout pods")
    status = wait_for(lambda: (s := status_of(kube, namespace, "tiny")).get(
        "rolloutReadyReplicas") == 3 and s, 30, "rolloutReadyReplicas 3", operator)
    scale = kube.custom.get_namespaced_custom_object_scale(
        "asyncrl.io", "v1alpha1", namespace, "rljobs", "tiny")
    assert (scale["spec"]["replicas"], scale["status"]["replicas"]) == (3, 3)

    # A configuration change rolls the trainer (it resumes from its checkpoint).
    before = kube.apps.read_namespaced_stateful_set("tiny-trainer", namespace)
    patch_spec(kube, namespace, "tiny", {"algorithm": {"learningRate": 0.01}})
    wait_for(lambda: kube.apps.read_namespaced_stateful_set("tiny-trainer", namespace)
             .spec.template.metadata.annotations["asyncrl.io/config-hash"] !=
             before.spec.template.metadata.annotations["asyncrl.io/config-hash"],
             30, "the trainer template to change", operator)
    config = yaml.safe_load(kube.core.read_namespaced_config_map(
        "tiny-config", namespace).data["job.yaml"])
    assert config["spec"]["algorithm"]["learningRate"] == 0.01

    # Suspend: workers to zero, state (Redis, its password, the run volume) kept.
    patch_spec(kube, namespace, "tiny", {"suspend": True})
    wait_for(phase_is(kube, namespace, "tiny", "Suspended"), 60, "Suspended", operator)
    for component in ("rollout", "trainer", "reward"):
        wait_for(lambda c=component: not pods_of(kube, namespace, "tiny", c), 60,
                 f"{component} pods to go")
    assert pods_of(kube, namespace, "tiny", "redis")
    assert kube.core.read_namespaced_secret("tiny-redis", namespace).data == secret
    assert children(kube, namespace, "tiny")["PersistentVolumeClaim"] == ["tiny-run"]

    # Resume: the same workers come back.
    patch_spec(kube, namespace, "tiny", {"suspend": False})
    wait_for(phase_is(kube, namespace, "tiny", "Running"), 90, "Running again", operator)
    # On a loaded machine the Deployment's status can still show the replicas it had before
    # the suspend when the job reads Running: the pods follow.
    wait_for(lambda: len(pods_of(kube, namespace, "tiny", "rollout")) == 3, 60,
             "3 rollout pods again", operator)
    assert kube.core.read_namespaced_secret("tiny-redis", namespace).data == secret


def test_a_deleted_child_comes_back(kube, operator, namespace):
    start_running_job(kube, operator, namespace)
    kube.apps.delete_namespaced_deployment("tiny-buffer", namespace)
    wait_for(lambda: _exists(lambda: kube.apps.read_namespaced_deployment(
        "tiny-buffer", namespace)) and
        kube.apps.read_namespaced_deployment("tiny-buffer", namespace).metadata
        .deletion_timestamp is None, 30, "tiny-buffer to be recreated", operator)
    wait_for(phase_is(kube, namespace, "tiny", "Running"), 60, "Running", operator)


def test_operator_restart_converges_without_duplicates(kube, operator, namespace):
    start_running_job(kube, operator, namespace)
    operator.stop(signal.SIGKILL)  # a crash, mid-flight
    try:
        patch_spec(kube, namespace, "tiny", {"rollout": {"replicas": 2}})
        # No operator runs (stop waited for it to exit), so nothing can apply the change: the
        # update is missed, with no need to wait and see.
        assert kube.apps.read_namespaced_deployment("tiny-rollout", namespace).spec.replicas == 1
    finally:
        operator.start()
    wait_for(lambda: kube.apps.read_namespaced_deployment("tiny-rollout", namespace)
             .spec.replicas == 2, 60, "the missed update to be applied", operator)
    wait_for(phase_is(kube, namespace, "tiny", "Running"), 60, "Running", operator)
    found = children(kube, namespace, "tiny")
    found.pop("Pod")
    assert found == expected("tiny")
    replica_sets = kube.apps.list_namespaced_replica_set(
        namespace, label_selector="asyncrl.io/job=tiny,app.kubernetes.io/component=rollout").items
    assert len(replica_sets) == 1  # no spurious rollout: the pod template did not change
    assert len(pods_of(kube, namespace, "tiny", "rollout")) == 2


def test_delete_garbage_collects_everything(kube, operator, namespace):
    start_running_job(kube, operator, namespace)
    kube.custom.delete_namespaced_custom_object("asyncrl.io", "v1alpha1", namespace, "rljobs",
                                                "tiny")
    wait_for(lambda: not _exists(lambda: read_job(kube, namespace, "tiny")), 30,
             "the RLJob to go (no finalizer holds it)")
    wait_for(lambda: all(not names for names in children(kube, namespace, "tiny").values()),
             120, "every child to be garbage-collected")
    assert not kube.apps.list_namespaced_replica_set(namespace).items


def test_status_and_kubectl_get_show_the_trainers_figures(kube, crd, namespace, monkeypatch):
    """What the operator writes from a real trainer's GetStatus survives the CRD's status
    schema and fills `kubectl get rljobs`' columns. The trainer runs on loopback here (kwok
    pods run nothing), so the handler is given its address."""
    from support.trainer_status import TrainerStatusThread

    from asyncrl.operator import kube as operator_kube
    from asyncrl.operator.observe import trainer_status, with_stored_status, write_status
    from asyncrl.operator.reconcile import job_manifest
    from asyncrl.operator.status import Observation
    from asyncrl.spec import parse_manifest
    from asyncrl.trainer.service import Status

    monkeypatch.setattr(operator_kube, "CLIENTS", operator_kube.Clients(kube.api))
    body = create_job(kube, manifest("figures", namespace))
    job = parse_manifest(job_manifest(body))
    served = Status(version=7, step=7, max_steps=job.spec.algorithm.max_steps, phase="training",
                    trained_tokens_per_second=812.5, reward_mean=0.625, eval_accuracy=0.375)
    with TrainerStatusThread(served) as server:
        trainer, error = trainer_status(job, [server.address])
    assert error is None
    write_status(with_stored_status(body), Observation(
        generation=body["metadata"]["generation"], suspend=False,
        max_steps=job.spec.algorithm.max_steps, trainer=trainer))

    status = wait_for(lambda: (s := status_of(kube, namespace, "figures")).get("trainerStep")
                      == 7 and s, 30, "the trainer's figures in status")
    assert (status["tokensPerSecond"], status["rewardMean"], status["evalAccuracy"]) == \
        (812.5, 0.625, 0.375)
    reachable = next(c for c in status["conditions"] if c["type"] == "TrainerReachable")
    assert (reachable["status"], reachable["reason"]) == ("True", "GetStatusAnswered")

    # kubectl get rljobs: the API server's Table rendering of the printer columns.
    table = kube.custom.get_namespaced_custom_object(
        "asyncrl.io", "v1alpha1", namespace, "rljobs", "figures",
        _headers={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"})
    columns = [c["name"] for c in table["columnDefinitions"]]
    (row,) = table["rows"]
    shown = dict(zip(columns, row["cells"]))
    assert (shown["Step"], shown["Tokens/s"], shown["Reward"], shown["Eval"]) == \
        (7, 812.5, 0.625, 0.375), shown


def test_examples_gpu_cluster_is_accepted_by_the_api_server(kube, crd, namespace):
    data = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "gpu-cluster.yaml").read_text()))
    data["metadata"]["namespace"] = namespace
    kube.custom.create_namespaced_custom_object("asyncrl.io", "v1alpha1", namespace, "rljobs",
                                                data, dry_run="All", field_validation="Strict")


def test_examples_gpu_cluster_gets_gpu_pods_that_can_run_it(kube, operator, namespace):
    """examples/gpu-cluster.yaml as written (SGLang rollout, 2 x 8-GPU trainer nodes, external
    Redis): what the operator applies, as the API server stored it."""
    data = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "gpu-cluster.yaml").read_text()))
    data["metadata"]["namespace"] = namespace
    create_job(kube, data)
    wait_for(lambda: children(kube, namespace, "qwen-math")["Deployment"] ==
             ["qwen-math-buffer", "qwen-math-reward", "qwen-math-rollout"] and
             _exists(lambda: kube.apps.read_namespaced_stateful_set("qwen-math-trainer",
                                                                    namespace)),
             60, "the job's workloads", operator)

    def pod_template(kind, name):
        return kube.api.sanitize_for_serialization(
            _read(kube, kind, namespace, name))["spec"]["template"]["spec"]

    rollout = pod_template("Deployment", "qwen-math-rollout")
    (worker,) = rollout["containers"]
    assert worker["image"] == "example.org/asyncrl:test-gpu"
    startup = worker["startupProbe"]
    # /health answers once SGLang is healthy, which may take SGLANG_STARTUP_SECONDS.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600 + SGLANG_STARTUP_SECONDS
    assert {"name": "dshm", "mountPath": "/dev/shm"} in worker["volumeMounts"]
    assert {"name": "tmp", "mountPath": "/tmp"} in worker["volumeMounts"]  # HOME, caches

    trainer = pod_template("StatefulSet", "qwen-math-trainer")
    (node,) = trainer["containers"]
    assert node["image"] == "example.org/asyncrl:test-gpu"
    assert node["command"][0] == "torchrun"
    (wait,) = trainer["initContainers"]
    assert wait["image"] == "example.org/asyncrl:test-gpu"
    assert wait["command"][-2:] == ["qwen-math-trainer-0.qwen-math-trainer-headless", "29400"]

    for name in ("qwen-math-buffer", "qwen-math-reward"):
        (container,) = pod_template("Deployment", name)["containers"]
        assert container["image"] == "example.org/asyncrl:test", name


def test_a_component_past_its_backoff_limit_fails_the_job_and_stops_its_workers(
        kube, operator, namespace):
    start_running_job(kube, operator, namespace)
    (pod,) = pods_of(kube, namespace, "tiny", "rollout")
    # Take the pod's status away from kwok, then report what a kubelet reports for a rollout
    # worker that keeps crashing, its last log lines in its termination message
    # (terminationMessagePolicy FallbackToLogsOnError).
    kube.core.patch_namespaced_pod(pod.metadata.name, namespace, {"metadata": {"annotations": {
        "kwok.x-k8s.io/status": "custom"}}})
    container = pod.spec.containers[0]
    assert container.termination_message_policy == "FallbackToLogsOnError"
    log_tail = "Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: boom"
    kube.core.patch_namespaced_pod_status(pod.metadata.name, namespace, {"status": {
        "containerStatuses": [{
            "name": container.name, "image": container.image, "imageID": "", "ready": False,
            "restartCount": 7, "started": False,
            "state": {"waiting": {"reason": "CrashLoopBackOff",
                                  "message": "back-off 5m0s restarting failed container"}},
            "lastState": {"terminated": {"reason": "Error", "exitCode": 1, "message": log_tail,
                                         "startedAt": "2026-01-01T00:00:00Z",
                                         "finishedAt": "2026-01-01T00:00:01Z"}},
        }]}})
    status = wait_for(phase_is(kube, namespace, "tiny", "Failed"), 30, "Failed", operator)
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "RolloutFailed"
    assert failed["message"].startswith(
        f"rollout pods restarted 7 times, more than backoffLimit 6; pod {pod.metadata.name} "
        "last exited: Error, code 1. Its last log lines:\nTraceback")
    assert status["failure"]["component"] == "rollout"
    events = events_about(kube, namespace, "tiny", "RolloutFailed", operator)
    [event] = [e for e in events if e.reason == "RolloutFailed"]
    assert event.type == "Warning" and "ValueError: boom" in event.message
    # Its workers stop (no GPU held by a job that cannot go on); its state stays.
    for kind, component in (("deployment", "rollout"), ("deployment", "reward"),
                            ("stateful_set", "trainer")):
        read = getattr(kube.apps, f"read_namespaced_{kind}")
        wait_for(lambda: read(f"tiny-{component}", namespace).spec.replicas == 0, 30,
                 f"the {component} at zero", operator)
    assert kube.apps.read_namespaced_stateful_set("tiny-redis", namespace).spec.replicas == 1
    assert kube.apps.read_namespaced_deployment("tiny-buffer", namespace).spec.replicas == 1
    # Failed it stays, though the crashing pod is gone ...
    time.sleep(2 * RESYNC_SECONDS)
    assert status_of(kube, namespace, "tiny")["phase"] == "Failed"
    # ... until the spec changes: the workers come back.
    patch_spec(kube, namespace, "tiny", {"algorithm": {"learningRate": 0.002}})
    wait_for(lambda: kube.apps.read_namespaced_deployment("tiny-rollout", namespace)
             .spec.replicas == 1, 30, "the rollout back", operator)
    status = wait_for(lambda: (s := status_of(kube, namespace, "tiny"))["phase"] != "Failed"
                      and s, 60, "the job out of Failed", operator)
    assert status.get("failure") is None


def test_a_job_past_its_deadline_fails_and_is_deleted_after_its_ttl_keeping_its_volume(
        kube, operator, namespace):
    provide_run_volume(kube, namespace, "brief")
    create_job(kube, manifest("brief", namespace, activeDeadlineSeconds=4,
                              ttlSecondsAfterFinished=3, keepRunVolume=True))
    started = wait_for(lambda: status_of(kube, namespace, "brief").get("startTime"), 60,
                       "a start time", operator)
    # The operator's lifetime pass fails it without waiting for any event of its children.
    status = wait_for(phase_is(kube, namespace, "brief", "Failed"), 60, "Failed", operator)
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "DeadlineExceeded"
    assert f"since {started}, past activeDeadlineSeconds 4." in failed["message"]
    events_about(kube, namespace, "brief", "DeadlineExceeded", operator)
    assert status["completionTime"]
    # ttlSecondsAfterFinished later the RLJob is gone, its children with it, but for the run
    # volume's claim, which it never owned.
    wait_for(lambda: not _exists(lambda: read_job(kube, namespace, "brief")), 60,
             "the RLJob deleted", operator)
    wait_for(lambda: not _exists(lambda: kube.apps.read_namespaced_deployment(
        "brief-buffer", namespace)), 60, "its children garbage-collected")
    claim = kube.core.read_namespaced_persistent_volume_claim("brief-run", namespace)
    assert not claim.metadata.owner_references


def test_a_replica_that_loses_the_lease_exits(kube, crd, namespace, control_plane, tmp_path):
    """Leader election: once another identity holds the Lease, the replica that led stops
    reconciling and exits non-zero (Kubernetes restarts it as a follower); it does not take
    the Lease back."""
    from datetime import datetime, timezone

    from kubernetes import client
    from kubernetes.client.rest import ApiException

    leases = client.CoordinationV1Api(kube.api)
    lease = f"asyncrl-operator-{uuid.uuid4().hex[:6]}"
    leader = OperatorProcess(control_plane, tmp_path / "operator.log")
    env = {**os.environ, "KUBECONFIG": str(control_plane.kubeconfig), "POD_NAME": "replica-a",
           "POD_NAMESPACE": namespace, "ASYNCRL_OPERATOR_LEASE_NAME": lease}
    with leader.log.open("ab") as handle:
        leader.process = subprocess.Popen(
            [ASYNCRL, "operator", "--leader-election", "--namespace", namespace,
             "--interval", str(RESYNC_SECONDS), "--image", "example.org/asyncrl:test",
             "--gpu-image", "example.org/asyncrl:test-gpu", "--verbose"],
            env=env, stdout=handle, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def holder() -> str | None:
        try:
            return leases.read_namespaced_lease(lease, namespace).spec.holder_identity
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def now() -> str:
        return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")

    try:
        wait_for(lambda: (holder() or "").startswith("replica-a_")
                 and "leading: lease" in leader.tail(), 60, "replica-a to lead", leader)
        # Another replica takes the Lease and keeps renewing it, as a new leader would; the
        # old one must notice at its next renewal and exit (the deadline only catches a hang).
        usurper, acquired = "replica-b_0000", now()
        deadline = time.monotonic() + 120
        while leader.process.poll() is None:
            assert time.monotonic() < deadline, f"the operator kept running:\n{leader.tail()}"
            leases.patch_namespaced_lease(lease, namespace, {"spec": {
                "holderIdentity": usurper, "acquireTime": acquired, "renewTime": now(),
                "leaseDurationSeconds": 15}})
            time.sleep(1)
        assert leader.process.returncode == 1, leader.tail()
        assert "lost the lease" in leader.tail()
        assert holder() == usurper
    finally:
        leader.stop()
