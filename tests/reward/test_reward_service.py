"""The reward service over real gRPC: a grpc.aio server on a loopback port with real math
workers and a real sandbox, the Python client, metrics, and `asyncrl serve reward`."""

import os
import subprocess
import sys
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from asyncrl.platform.grpc_health import LIVENESS, is_serving_at
from asyncrl.clients.reward import RewardClient
from asyncrl.scoring.sandbox import Isolation
from asyncrl.scoring.types import CodeReference, Failure, IoCase, MathReference, ScoreTask
from asyncrl.spec import RewardSpec
from asyncrl.v1 import reward_pb2, reward_pb2_grpc
from support.ports import free_port
from support.reward import RewardThread

JOB = "reward-test"
SPEC = RewardSpec.model_validate({
    "kind": "code",
    "math": {"extract": ["boxed", "answer_is"], "timeoutSeconds": 3},
    # Long enough that a busy machine never turns a correct program into a timeout; the
    # programs that must time out ask for a short limit (`ADD_TIMED`).
    "code": {"timeoutSeconds": 30, "memoryMb": 256, "maxProcesses": 16, "maxFileSizeMb": 4},
})
ADD = CodeReference(io_cases=(IoCase("2 3\n", "5\n"),))
ADD_TIMED = CodeReference(io_cases=ADD.io_cases, timeout_seconds=1.5)
CORRECT = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"


@pytest.fixture(scope="module")
def service():
    thread = RewardThread(SPEC, job=JOB).start()
    yield thread
    thread.close()


@pytest.fixture(scope="module")
def stub(service):
    with grpc.insecure_channel(service.address) as channel:
        yield reward_pb2_grpc.RewardStub(channel)


def batch(*tasks, job=JOB):
    return reward_pb2.ScoreBatchRequest(job=job, tasks=[t.to_pb() for t in tasks])


def test_health_is_the_standard_service(service):
    assert is_serving_at(service.address)
    with grpc.insecure_channel(service.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        alive = health.Check(health_pb2.HealthCheckRequest(service=LIVENESS), timeout=10)
        assert alive.status == health_pb2.HealthCheckResponse.SERVING


def test_a_mixed_batch_is_scored_in_order(stub):
    tasks = [
        ScoreTask("m-right", r"so it is \boxed{\frac{1}{2}}", MathReference("0.5")),
        ScoreTask("m-phrase", "The answer is 12.", MathReference("12")),
        ScoreTask("m-wrong", r"\boxed{3}", MathReference("4")),
        ScoreTask("c-right", CORRECT, ADD),
        ScoreTask("c-loop", "```python\nwhile True: pass\n```", ADD_TIMED),
        ScoreTask("c-none", "no code", ADD),
    ]
    reply = stub.ScoreBatch(batch(*tasks), timeout=60)
    got = {r.task_id: (r.score, r.failure) for r in reply.results}
    assert [r.task_id for r in reply.results] == [t.task_id for t in tasks]
    assert got == {
        "m-right": (1.0, reward_pb2.FAILURE_UNSPECIFIED),
        "m-phrase": (1.0, reward_pb2.FAILURE_UNSPECIFIED),
        "m-wrong": (0.0, reward_pb2.FAILURE_WRONG_ANSWER),
        "c-right": (1.0, reward_pb2.FAILURE_UNSPECIFIED),
        "c-loop": (0.0, reward_pb2.FAILURE_TIMEOUT),
        "c-none": (0.0, reward_pb2.FAILURE_NO_ANSWER),
    }
    right = reply.results[3]
    assert (right.passed, right.total) == (1, 1) and right.wall_seconds > 0


def test_the_service_still_scores_after_hostile_programs(stub):
    bombs = [
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "x = bytearray(8 << 30)",
        "while True:\n    print('x' * 1000)",
        "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\nos.kill(-1, signal.SIGKILL)",
    ]
    tasks = [ScoreTask(f"bomb{i}", f"```python\n{b}\n```", ADD_TIMED)
             for i, b in enumerate(bombs)]
    reply = stub.ScoreBatch(batch(*tasks), timeout=60)
    assert [r.score for r in reply.results] == [0.0] * len(bombs)
    # The RPC's limit only catches a hang; how fast it answers is measured in bench/.
    reply = stub.ScoreBatch(batch(ScoreTask("after", CORRECT, ADD)), timeout=60)
    assert (reply.results[0].score, reply.results[0].failure) == (
        1.0, reward_pb2.FAILURE_UNSPECIFIED)


async def _client_scores(address, tasks):
    async with RewardClient(address, JOB) as client:
        return await client.score(tasks), await client.healthy()


def test_the_client_returns_domain_results(service):
    results, health = service.run(_client_scores(service.address, [
        ScoreTask("a", r"\boxed{2^{10}}", MathReference("1024")),
        ScoreTask("b", CORRECT, ADD),
    ]))
    assert [(r.task_id, r.score, r.failure) for r in results] == [
        ("a", 1.0, Failure.NONE), ("b", 1.0, Failure.NONE)]
    assert health is True


def test_a_group_scores_in_process(service):
    """What a rollout workflow calls without gRPC: the n responses to one prompt."""
    responses = [r"\boxed{4}", "the answer is 4", r"\boxed{5}", "no idea"]
    results = service.run(service.scorer.score(ScoreTask.for_group(MathReference("4"), responses,
                                                                  "g1")))
    assert [(r.task_id, r.score) for r in results] == [
        ("g1#0", 1.0), ("g1#1", 1.0), ("g1#2", 0.0), ("g1#3", 0.0)]
    assert results[3].failure is Failure.NO_ANSWER


def test_bad_requests_are_invalid_arguments(stub):
    with pytest.raises(grpc.RpcError) as wrong_job:
        stub.ScoreBatch(batch(ScoreTask("x", "1", MathReference("1")), job="other"), timeout=10)
    assert wrong_job.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "reward-test" in wrong_job.value.details()
    no_reference = reward_pb2.ScoreBatchRequest(tasks=[reward_pb2.ScoreTask(task_id="x")])
    with pytest.raises(grpc.RpcError) as missing:
        stub.ScoreBatch(no_reference, timeout=10)
    assert missing.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "no reference" in missing.value.details()


def test_metrics_count_scores_failures_and_sandbox_runs(service, stub):
    stub.ScoreBatch(batch(ScoreTask("slow", "```python\nimport time\ntime.sleep(9)\n```", ADD),
                          ScoreTask("m", r"\boxed{7}", MathReference("8"))), timeout=60)
    registry = service.metrics.registry

    def value(name, labels=None):  # every series carries the job's name as `rljob`
        return registry.get_sample_value(name, {"rljob": JOB, **(labels or {})})

    assert value("asyncrl_reward_scored_responses_total", {"kind": "code"}) >= 1
    assert value("asyncrl_reward_scored_responses_total", {"kind": "math"}) >= 1
    assert value("asyncrl_reward_failures_total", {"reason": "timeout"}) >= 1
    assert value("asyncrl_reward_failures_total", {"reason": "wrong_answer"}) >= 1
    assert value("asyncrl_reward_sandbox_timeouts_total") >= 1
    assert value("asyncrl_reward_sandbox_seconds_count") >= 1
    assert value("asyncrl_reward_score_ratio_count", {"kind": "math"}) >= 1
    assert value("asyncrl_reward_sandbox_available") == 1


def test_a_refusing_sandbox_fails_code_batches_and_health():
    # A sandbox that may only run unisolated, which it refuses to do without the unsafe mode.
    service = RewardThread(SPEC, job=JOB, workers=1, isolation=Isolation.NONE).start()
    try:
        with grpc.insecure_channel(service.address) as channel:
            stub = reward_pb2_grpc.RewardStub(channel)
            assert not is_serving_at(service.address)  # readiness: the pod leaves its Service
            with pytest.raises(grpc.RpcError) as refused:
                stub.ScoreBatch(batch(ScoreTask("c", CORRECT, ADD)), timeout=30)
            assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert "allowUnsafeNoNetworkNamespace" in refused.value.details()
            math = stub.ScoreBatch(batch(ScoreTask("m", r"\boxed{1}", MathReference("1"))),
                                   timeout=30)
            assert math.results[0].score == 1.0  # math does not need the sandbox
        assert service.metrics.registry.get_sample_value(
            "asyncrl_reward_sandbox_available", {"rljob": JOB}) == 0
    finally:
        service.close()


def test_serve_reward_command(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(
        "apiVersion: asyncrl.io/v1alpha1\nkind: RLJob\nmetadata:\n  name: cli-reward\n"
        "spec:\n  dataset:\n    kind: code\n  reward:\n    kind: code\n"
        "    code:\n      timeoutSeconds: 2\n")
    grpc_port, metrics_port = free_port(), free_port()
    env = {**os.environ, "ASYNCRL_WORKERS": "1"}
    process = subprocess.Popen(
        [sys.executable, "-m", "asyncrl.cli", "serve", "reward", "--job-file", str(job),
         "--grpc-port", str(grpc_port), "--metrics-port", str(metrics_port)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            grpc.channel_ready_future(channel).result(timeout=60)
            stub = reward_pb2_grpc.RewardStub(channel)
            assert is_serving_at(f"127.0.0.1:{grpc_port}")
            request = reward_pb2.ScoreBatchRequest(job="cli-reward",
                                                   tasks=[ScoreTask("c", CORRECT, ADD).to_pb()])
            assert stub.ScoreBatch(request, timeout=30).results[0].score == 1.0
        body = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
        scored = [s for family in text_string_to_metric_families(body.decode())
                  for s in family.samples if s.name == "asyncrl_reward_scored_responses_total"
                  and s.labels["kind"] == "code"]
        assert [(s.labels["rljob"], s.value) for s in scored] == [("cli-reward", 1.0)]
        process.terminate()
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        output = process.communicate()[0]
    assert "namespaces isolation" in output
