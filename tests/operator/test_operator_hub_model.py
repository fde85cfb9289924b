"""A Hub model in a cluster (asyncrl.operator.builders.model): the trainer pods download it
into the run volume with the job's token and the operator's endpoint, the rollout pods wait
for it, both load it from there with the Hub off; a failed download fails the job saying
why (asyncrl.operator.status.model_failure)."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from asyncrl.model.hub import PERMANENT_EXIT
from asyncrl.operator.builders import OperatorConfig, build_children
from asyncrl.operator.builders.model import HUB_CACHE, ready_file
from asyncrl.operator.status import MODEL_FAILED, Observation, compute_status, model_failure
from asyncrl.spec import parse_manifest
from support import ROOT

CONFIG = OperatorConfig(image="asyncrl:test", hub_endpoint="http://hub-mirror.internal")
REPO = "Qwen/Qwen2.5-0.5B-Instruct"


def hub_job(replicas: int = 1, **model):
    data = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    data["metadata"]["namespace"] = "ml"
    data["spec"]["model"] = {"source": REPO, **model}
    data["spec"]["trainer"] = {**data["spec"].get("trainer", {}), "replicas": replicas}
    return parse_manifest(data)


def pod_of(job, kind: str, name: str, config=CONFIG) -> dict:
    (child,) = [c for c in build_children(job, config, redis_password="pw")
                if c["kind"] == kind and c["metadata"]["name"] == name]
    return child["spec"]["template"]["spec"]


def env_of(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def test_the_trainer_pods_download_the_model_into_the_run_volume_first():
    job = hub_job(revision="v2", hubTokenSecret={"name": "hf-token", "key": "token"})
    pod = pod_of(job, "StatefulSet", "tiny-trainer")
    (fetch,) = pod["initContainers"]
    assert fetch["name"] == "fetch-model"
    assert fetch["command"] == ["python", "-m", "asyncrl.model.hub", REPO, "v2",
                                ready_file(job)]
    assert ready_file(job).startswith(f"{HUB_CACHE}/ready/")
    assert env_of(fetch) == {
        "HOME": "/tmp", "HF_HOME": "/tmp/hf", "HF_HUB_CACHE": HUB_CACHE,
        "PYTHONUNBUFFERED": "1", "HF_ENDPOINT": "http://hub-mirror.internal",
        "HF_TOKEN": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
    assert fetch["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert {m["name"]: m.get("readOnly", False) for m in fetch["volumeMounts"]} == {
        "run": False, "tmp": False}
    (trainer,) = pod["containers"]
    assert env_of(trainer)["HF_HUB_CACHE"] == HUB_CACHE
    assert env_of(trainer)["HF_HUB_OFFLINE"] == "1"


def test_without_a_token_secret_or_endpoint_none_is_passed():
    pod = pod_of(hub_job(), "StatefulSet", "tiny-trainer", config=OperatorConfig())
    assert "HF_TOKEN" not in env_of(pod["initContainers"][0])
    assert "HF_ENDPOINT" not in env_of(pod["initContainers"][0])


def test_a_multi_pod_trainer_downloads_before_its_rendezvous():
    pod = pod_of(hub_job(replicas=2), "StatefulSet", "tiny-trainer")
    assert [c["name"] for c in pod["initContainers"]] == ["fetch-model", "wait-for-rendezvous"]


def test_the_rollout_pods_wait_for_the_download_and_load_it_offline():
    job = hub_job()
    pod = pod_of(job, "Deployment", "tiny-rollout")
    (wait,) = pod["initContainers"]
    assert wait["name"] == "wait-for-model"
    assert wait["command"][-1] == ready_file(job)
    assert wait["volumeMounts"] == [{"name": "run", "mountPath": "/run/asyncrl",
                                     "readOnly": True}]
    env = env_of(pod["containers"][0])
    assert (env["HF_HUB_CACHE"], env["HF_HUB_OFFLINE"]) == (HUB_CACHE, "1")


def test_a_builtin_or_local_model_gets_no_download():
    for source in ("tiny-random", "/models/qwen"):
        data = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
        data["spec"]["model"] = {"source": source}
        job = parse_manifest(data)
        for kind, name in (("StatefulSet", "tiny-trainer"), ("Deployment", "tiny-rollout")):
            pod = pod_of(job, kind, name)
            assert "initContainers" not in pod
            assert "HF_HUB_OFFLINE" not in env_of(pod["containers"][0])


def test_another_revision_waits_for_its_own_ready_file():
    assert ready_file(hub_job(revision="v1")) != ready_file(hub_job(revision="v2"))


def test_the_pods_are_valid_kubernetes_objects():
    job = hub_job(replicas=2, hubTokenSecret={"name": "hf-token", "key": "token"})
    for child in build_children(job, CONFIG, redis_password="pw"):
        kubernetes_validate.validate(child, latest_version(), strict=True)


def fetch_status(exit_code: int, restarts: int, message: str) -> dict:
    """A trainer pod whose fetch-model init container exited as a kubelet reports it."""
    return {"metadata": {"name": "tiny-trainer-0"}, "status": {"initContainerStatuses": [{
        "name": "fetch-model", "restartCount": restarts,
        "state": {"waiting": {"reason": "CrashLoopBackOff"}},
        "lastState": {"terminated": {"exitCode": exit_code, "reason": "Error",
                                     "message": f"Fetching 6 files\n{message}\n"}}}]}}


def test_a_refused_download_fails_the_job_at_once_saying_why():
    gated = "model.source 'Qwen/x' is a gated model and no HF_TOKEN is set: accept ..."
    why = model_failure([fetch_status(PERMANENT_EXIT, 0, gated)], max_restarts=5)
    assert why == f"downloading the model failed: {gated}"
    status = compute_status(Observation(generation=1, suspend=False, max_steps=10,
                                        model_failure=why), None)
    assert status["phase"] == "Failed"
    (failed,) = [c for c in status["conditions"] if c["type"] == "Failed"]
    assert (failed["status"], failed["reason"]) == ("True", MODEL_FAILED)
    assert failed["message"] == (f"{why} Its workers are stopped and its state kept; change "
                                 "the spec to start them again.")


def test_an_unreachable_hub_is_retried_until_the_restart_limit():
    unreachable = "model.source 'Qwen/x' (revision main) is not in the Hugging Face cache ..."
    assert model_failure([fetch_status(1, 2, unreachable)], max_restarts=5) is None
    assert model_failure([fetch_status(1, 5, unreachable)], max_restarts=5) == \
        f"downloading the model failed: {unreachable}"
    done = {"metadata": {"name": "p"}, "status": {"initContainerStatuses": [{
        "name": "fetch-model", "restartCount": 0,
        "state": {"terminated": {"exitCode": 0}}}]}}
    assert model_failure([done], max_restarts=5) is None
