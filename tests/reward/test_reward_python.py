"""Python rewards (reward.kind: python) through a real reward gRPC service: the job's function,
from a module in a temporary folder, runs in the service's worker processes; what it returns,
raises, hangs or crashes becomes a score, a named failure and metrics, and the service goes on.
"""

import os
import subprocess
import sys
import textwrap

import grpc
import pytest

from asyncrl.platform.grpc_health import is_serving_at
from asyncrl.data.prompts import PromptItem
from asyncrl.clients.reward import PromptScorer, RewardClient, reward_reference, reward_scorer
from asyncrl.scoring.metrics import MAX_EXTRA_FIELDS, RewardMetrics
from asyncrl.scoring.scorer import RewardScorer
from asyncrl.scoring.types import (
    CodeReference,
    Failure,
    MathReference,
    RowReference,
    ScoreResult,
    ScoreTask,
)
from asyncrl.scoring.worker_pool import WorkerStartError
from asyncrl.spec import RewardSpec, load_manifest
from support import ROOT
from support.ports import free_port
from support.reward import RewardThread
from support.servers import LoopThread

JOB = "python-reward-test"

REWARDS = '''
import asyncio
import os
import time


def score(response, row):
    """What the response asks for: `<what>:<argument>`."""
    what, _, argument = response.partition(":")
    if what == "float":
        return float(argument)
    if what == "match":
        return argument == str(row["answer"])
    if what == "dict":
        words = len(row["question"].split())
        return {"score": float(argument), "format_bonus": 0.1, "words": words}
    if what == "raise":
        raise ValueError("no verdict for " + argument)
    if what == "hang":
        time.sleep(3600)
    if what == "crash":
        os._exit(3)
    if what == "print":
        print("a reward function that prints")  # must not reach the worker's replies
        return 0.75
    return "high"


async def async_score(response, row):
    await asyncio.sleep(0)
    return {"score": float(response == row["answer"]), "awaited": 1.0}
'''


def python_spec(folder, function="rewards:score", timeout=3.0):
    return RewardSpec.model_validate({"kind": "python", "python": {
        "function": function, "path": str(folder), "timeoutSeconds": timeout}})


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rewards")
    (folder / "rewards.py").write_text(REWARDS)
    return folder


@pytest.fixture(scope="module")
def service(folder):
    thread = RewardThread(python_spec(folder), job=JOB, kinds=["python"]).start()
    yield thread
    thread.close()


ROW = RowReference.of("What is 2 + 2?", {"question": "What is 2 + 2?", "answer": 4})


def score(service, *responses, reference=ROW):
    tasks = [ScoreTask(f"t{i}", response, reference) for i, response in enumerate(responses)]

    async def call():
        async with RewardClient(service.address, service.job, kind="python") as client:
            return await client.score(tasks)

    return service.run(call())


def metric(service, name, **labels):
    return service.metrics.registry.get_sample_value(name, {"rljob": JOB, **labels}) or 0.0


def test_a_number_a_bool_and_a_dict_with_extras_are_scores(service):
    results = score(service, "float:0.25", "match:4", "match:5", "dict:0.5", "print:")
    assert [(r.score, r.failure) for r in results] == [
        (0.25, Failure.NONE), (1.0, Failure.NONE), (0.0, Failure.NONE), (0.5, Failure.NONE),
        (0.75, Failure.NONE)]
    assert results[3].extras == {"format_bonus": 0.1, "words": 5.0}
    assert metric(service, "asyncrl_reward_extra_count", field="format_bonus") >= 1
    assert metric(service, "asyncrl_reward_extra_sum", field="words") >= 5.0
    assert metric(service, "asyncrl_reward_scored_responses_total", kind="python") >= 5


def test_an_exception_scores_zero_naming_its_type_and_line(service):
    [result] = score(service, "raise:this")
    assert (result.score, result.failure) == (0.0, Failure.EXCEPTION)
    assert result.detail.startswith("ValueError: no verdict for this (at rewards.py:")
    assert metric(service, "asyncrl_reward_failures_total", reason="exception") >= 1


def test_a_value_that_is_not_a_number_is_an_invalid_score(service):
    [result] = score(service, "words")
    assert (result.score, result.failure) == (0.0, Failure.INVALID_SCORE)
    assert "str, not a number" in result.detail


def test_a_hang_past_the_timeout_is_killed_and_the_next_batch_scores(service):
    replaced = service.scorer.custom.pool.replaced
    [hung, quick] = score(service, "hang:", "float:1")
    assert (hung.score, hung.failure) == (0.0, Failure.TIMEOUT)
    assert "timeoutSeconds" in hung.detail and "killed" in hung.detail
    assert (quick.score, quick.failure) == (1.0, Failure.NONE)
    assert service.scorer.custom.pool.replaced == replaced + 1
    assert [r.score for r in score(service, "float:0.5", "float:0.5")] == [0.5, 0.5]
    assert metric(service, "asyncrl_reward_failures_total", reason="timeout") >= 1


def test_a_crashed_worker_scores_zero_and_the_service_goes_on(service):
    [crashed] = score(service, "crash:")
    assert (crashed.score, crashed.failure) == (0.0, Failure.KILLED)
    assert "exited with code 3" in crashed.detail
    assert is_serving_at(service.address)
    results = score(service, "match:4", "float:0.5", "dict:1")
    assert [(r.score, r.failure) for r in results] == [
        (1.0, Failure.NONE), (0.5, Failure.NONE), (1.0, Failure.NONE)]
    assert metric(service, "asyncrl_reward_failures_total", reason="killed") >= 1


def test_a_math_job_refuses_row_tasks():
    service = RewardThread(RewardSpec(), job=JOB, kinds=[]).start()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            score(service, "float:1")
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "reward kind math" in refused.value.details()
    finally:
        service.close()


def test_an_async_function_is_awaited(folder):
    service = RewardThread(python_spec(folder, "rewards:async_score"), workers=1,
                           kinds=["python"]).start()
    try:
        row = RowReference.of("p", {"answer": "yes"})
        results = score(service, "yes", "no", "yes", reference=row)
    finally:
        service.close()
    assert [r.score for r in results] == [1.0, 0.0, 1.0]
    assert results[0].extras == {"awaited": 1.0}


BROKEN = {
    "missing_module": ("nowhere:score", None, "cannot import nowhere",
                       "ModuleNotFoundError: No module named 'nowhere'"),
    "syntax_error": ("broken:score", "def score(response, row)\n    return 1\n",
                     "cannot import broken", "SyntaxError: expected ':'"),
    "raises_on_import": ("broken:score", "raise RuntimeError('no model file')\n",
                         "cannot import broken", "RuntimeError: no model file (at broken.py:1"),
    "missing_name": ("broken:scores", "def score(response, row):\n    return 1\n",
                     "module broken", "has no 'scores'"),
    "not_callable": ("broken:score", "score = 3\n", "score is a int", "not a function"),
    "wrong_arguments": ("broken:score", "def score(text):\n    return 1\n",
                        "cannot be called as score(response=..., row=...)", "'text'"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_function_that_cannot_be_loaded_fails_the_start_naming_module_and_error(case,
                                                                               tmp_path):
    function, source, *expected = BROKEN[case]
    if source is not None:
        (tmp_path / "broken.py").write_text(source)
    scorer = RewardScorer.from_spec(python_spec(tmp_path, function), workers=1)
    loop = LoopThread()
    try:
        with pytest.raises(WorkerStartError) as failed:
            loop.run(scorer.start(["python"]))
    finally:
        loop.run(scorer.close())
        loop.stop()
    message = str(failed.value)
    assert message.startswith(f"reward.python.function {function!r}: ")
    for part in expected:
        assert part in message


def test_serve_reward_exits_at_start_with_the_import_error(tmp_path):
    """What a pod (and `asyncrl run`, which runs the same command) shows."""
    (tmp_path / "broken.py").write_text("def score(response, row)\n")
    job = tmp_path / "job.yaml"
    job.write_text(textwrap.dedent(f"""\
        apiVersion: asyncrl.io/v1alpha1
        kind: RLJob
        metadata:
          name: broken-reward
        spec:
          reward:
            kind: python
            python:
              function: broken:score
              path: {tmp_path}
        """))
    done = subprocess.run(
        [sys.executable, "-m", "asyncrl.cli", "serve", "reward", "--job-file", str(job),
         "--grpc-port", str(free_port()), "--metrics-port", "0"],
        env={**os.environ, "ASYNCRL_WORKERS": "1"}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == (
        "reward service cannot start: reward.python.function 'broken:score': cannot import "
        f"broken (reward.python.path: {tmp_path}): SyntaxError: expected ':' "
        f"({tmp_path}/broken.py, line 1)")


class _Characters:
    """A tokenizer of one token per character, enough for PromptScorer."""

    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return "".join(map(chr, ids))

    @staticmethod
    def encode(text):
        return [ord(c) for c in text]


def test_a_job_without_a_reward_service_scores_with_its_function_in_process(folder):
    spec = python_spec(folder, "rewards:async_score")
    item = PromptItem("p1", [1, 2], reference=None, row={"answer": "yes", "id": 7},
                      text="Say yes.")
    loop = LoopThread()

    async def scores():
        reward = reward_scorer(None, JOB, spec)
        try:
            return await PromptScorer(reward, _Characters).score(
                item, [_Characters.encode("yes"), _Characters.encode("no")])
        finally:
            await reward.close()

    try:
        assert loop.run(scores()) == [1.0, 0.0]
    finally:
        loop.stop()


def test_the_example_reward_scores_the_answer_and_the_format():
    reward = load_manifest(ROOT / "examples/rewards/format_bonus.yaml").spec.reward
    assert reward.python.path == "examples/rewards"  # `asyncrl run` makes it absolute
    reward.python.path = str(ROOT / reward.python.path)
    arith = RowReference.of("Ben has 5 marbles...", {"prompt_id": "a", "answer": 18})
    gsm8k = RowReference.of("Natalia sold clips...",
                            {"question": "...", "answer": "48 + 24 = 72\n#### 72"})
    tasks = [ScoreTask("right", "5 + 13 = 18, so \\boxed{18}", arith),
             ScoreTask("unformatted", "\\boxed{18} is it", arith),
             ScoreTask("wrong", "\\boxed{17}", arith),
             ScoreTask("none", "18", arith),
             ScoreTask("gsm8k", "\\boxed{72}", gsm8k)]
    scorer = reward_scorer(None, JOB, reward)
    loop = LoopThread()
    try:
        results = loop.run(scorer.score(tasks))
    finally:
        loop.run(scorer.close())
        loop.stop()
    assert [r.score for r in results] == [1.1, 1.0, 0.1, 0.0, 1.1]
    assert results[1].extras == {"correct": 1.0, "format_bonus": 0.0}


def test_the_row_a_reward_reads_for_file_and_generated_datasets():
    from asyncrl.data.code_tasks import CodeTask

    file_item = PromptItem("f1", [1], None, row={"question": "2+2?", "answer": 4}, text="2+2?")
    assert reward_reference(file_item, "python") == RowReference.of(
        "2+2?", {"question": "2+2?", "answer": 4})
    arith = PromptItem("a1", [1], 12, text="What is 3 * 4?")
    assert reward_reference(arith, "http").row == {
        "prompt_id": "a1", "prompt": "What is 3 * 4?", "answer": 12}
    task = CodeTask("c1", "Write f.", "assert f(1) == 2")
    code = PromptItem("c1", [1], task, text=task.prompt)
    assert reward_reference(code, "python").row == {
        "prompt_id": "c1", "prompt": task.prompt, "question": "Write f.",
        "test_code": "assert f(1) == 2"}
    # Math and code jobs still get their own references.
    assert reward_reference(arith, "math") == MathReference("12")
    assert reward_reference(code, "code") == CodeReference(test_code="assert f(1) == 2")


def test_extra_fields_past_the_bound_are_not_recorded(caplog):
    metrics = RewardMetrics("t")
    extras = {f"field{i}": 1.0 for i in range(MAX_EXTRA_FIELDS + 3)}
    for _ in range(2):
        metrics.observe_result("python", ScoreResult("a", 1.0, extras=extras))
    recorded = {sample.labels["field"] for family in metrics.registry.collect()
                if family.name == "asyncrl_reward_extra" for sample in family.samples}
    assert recorded == {f"field{i}" for i in range(MAX_EXTRA_FIELDS)}
    warnings = [r for r in caplog.records if "extra fields" in r.getMessage()]
    assert len(warnings) == 1 and f"field{MAX_EXTRA_FIELDS}" in warnings[0].getMessage()
