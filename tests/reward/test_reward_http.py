"""HTTP rewards (reward.kind: http) through a real reward gRPC service and a real scoring
endpoint on loopback (support.reward.Judge): the body it is sent, retries of 5xx answers and
timeouts, failures that are the answer's own, and an endpoint that is down, which holds the
responses (health NOT_SERVING) until it is up and then scores them."""

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest

from asyncrl.platform.grpc_health import is_serving_at
from asyncrl.data.prompts import PromptItem
from asyncrl.clients.reward import PromptScorer, RewardClient
from asyncrl.scoring.types import Failure, RowReference, ScoreTask
from asyncrl.spec import RewardSpec
from support.ports import free_port
from support.reward import Judge, RewardThread
from support.waiting import wait_for

JOB = "http-reward-test"
# Short delays between attempts keep the tests quick; what they test does not depend on them.
FAST = {"retry_delay": 0.05, "max_hold_delay": 0.5}
ROW = RowReference.of("What is 2 + 2?", {"question": "What is 2 + 2?", "answer": "4"})


def http_spec(url, **settings):
    return RewardSpec.model_validate({"kind": "http", "http": {
        "url": url, "scoreField": "result.score", **settings}})


@pytest.fixture(scope="module")
def judge():
    judge = Judge().start()
    yield judge
    judge.close()


class Service:
    """A reward service for an http reward at `url`, closed on leaving."""

    def __init__(self, url, **settings):
        self.thread = RewardThread(http_spec(url, **settings), job=JOB, kinds=["http"],
                                   http_options=FAST)

    def __enter__(self) -> RewardThread:
        return self.thread.start()

    def __exit__(self, *_):
        self.thread.close()


def score(service, *responses):
    tasks = [ScoreTask(f"t{i}", response, ROW) for i, response in enumerate(responses)]

    async def call():
        async with RewardClient(service.address, JOB, kind="http") as client:
            return await client.score(tasks)

    return service.run(call(), timeout=120)


def failures(service, reason):
    return service.metrics.registry.get_sample_value(
        "asyncrl_reward_failures_total", {"rljob": JOB, "reason": reason})


class _Characters:
    @staticmethod
    def decode(ids, skip_special_tokens=True):
        return "".join(map(chr, ids))


def test_responses_are_posted_with_prompt_and_row_and_scored_from_the_dotted_field(judge):
    item = PromptItem("p1", [1], None, row={"question": "2 + 2?", "answer": "4", "level": 1},
                      text="What is 2 + 2?")
    with Service(judge.url("/score"), maxConcurrency=2) as service:
        async def scores():
            async with RewardClient(service.address, JOB, kind="http") as client:
                return await PromptScorer(client, _Characters).score(
                    item, [[ord("4")], [ord("5")], [ord("4")]])

        assert service.run(scores()) == [1.0, 0.0, 1.0]
        assert is_serving_at(service.address)
    bodies = sorted(judge.bodies["/score"], key=lambda body: body["response"])
    row = {"question": "2 + 2?", "answer": "4", "level": 1}
    assert bodies == [{"prompt": "What is 2 + 2?", "response": r, "row": row}
                      for r in ("4", "4", "5")]


def test_a_5xx_answer_is_retried_and_then_scored(judge):
    with Service(judge.url("/flaky"), retries=2) as service:
        results = score(service, "4", "5")
        assert failures(service, "http_error") == 0
    assert [(r.score, r.failure) for r in results] == [(1.0, Failure.NONE), (0.0, Failure.NONE)]
    assert sorted(body["response"] for body in judge.bodies["/flaky"]) == ["4", "4", "5", "5"]


def test_an_endpoint_that_does_not_answer_in_time_is_retried_then_scores_zero(judge):
    with Service(judge.url("/hang"), timeoutSeconds=0.5, retries=1) as service:
        [result] = score(service, "4")
        assert failures(service, "timeout") == 1
        assert is_serving_at(service.address)  # it is there, only slow: no hold
    assert (result.score, result.failure) == (0.0, Failure.TIMEOUT)
    assert "timeoutSeconds" in result.detail and "after 2 attempts" in result.detail
    assert len(judge.bodies["/hang"]) == 2


@pytest.mark.parametrize("path, failure, detail", [
    ("/reject", Failure.HTTP_ERROR, "HTTP 400"),
    ("/noscore", Failure.INVALID_SCORE, "the answer has no 'result.score'"),
])
def test_an_answer_without_a_score_scores_zero_at_once(judge, path, failure, detail):
    with Service(judge.url(path), retries=3) as service:
        [result] = score(service, "4")
        assert failures(service, failure.label) == 1
    assert (result.score, result.failure) == (0.0, failure)
    assert detail in result.detail
    assert len(judge.bodies[path]) == 1  # the same answer again would not help


def test_an_unreachable_endpoint_holds_the_responses_until_it_answers():
    port = free_port()  # nothing listens here yet: connections are refused
    with Service(f"http://127.0.0.1:{port}/score", retries=0) as service:
        with ThreadPoolExecutor(1) as pool:
            scoring = pool.submit(score, service, "4", "5")
            wait_until(lambda: not is_serving_at(service.address))  # it met the outage
            assert not scoring.done()
            judge = Judge(port).start()
            try:
                results = scoring.result(timeout=120)
            finally:
                judge.close()
        assert is_serving_at(service.address)
        assert failures(service, "http_error") == failures(service, "timeout") == 0
    assert [(r.score, r.failure) for r in results] == [(1.0, Failure.NONE), (0.0, Failure.NONE)]
    assert sorted(body["response"] for body in judge.bodies["/score"]) == ["4", "5"]


def test_health_recovers_without_traffic_once_the_endpoint_is_back():
    """When the held calls are gone (their callers went away), the health check itself asks
    the endpoint again, so the service does not stay NOT_SERVING for want of traffic."""
    port = free_port()
    with Service(f"http://127.0.0.1:{port}/score") as service:
        async def start_scoring():
            return asyncio.ensure_future(service.scorer.score([ScoreTask("t", "4", ROW)]))

        held = service.run(start_scoring())
        wait_until(lambda: not is_serving_at(service.address))
        service.loop.call_soon_threadsafe(held.cancel)
        judge = Judge(port).start()
        try:
            wait_until(lambda: is_serving_at(service.address))
        finally:
            judge.close()
    assert "/score" not in judge.bodies  # the cancelled call sent nothing more


def wait_until(condition, timeout=60.0):
    """Polls `condition` until true; the limit only catches a hang."""
    wait_for(condition, timeout, "the condition", every=0.05)
