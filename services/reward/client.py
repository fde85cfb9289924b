"""The reward service's client: `await RewardClient(address).score(tasks)`."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Sequence

import grpc

from asyncrl.grpc_health import is_serving
from asyncrl.grpc_service import channel
from asyncrl.reward.types import CodeReference, MathReference, ScoreResult, ScoreTask
from asyncrl.v1 import reward_pb2, reward_pb2_grpc

if TYPE_CHECKING:
    from asyncrl.reward.scorer import RewardScorer

# Scoring is idempotent, so a call may be repeated while the service restarts.
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE}


class RewardClient:
    def __init__(self, address: str, job: str = "", *, timeout: float = 600.0,
                 attempts: int = 20, retry_delay: float = 0.25):
        self._channel = channel(address)
        self.stub = reward_pb2_grpc.RewardStub(self._channel)
        self.job = job
        self._timeout = timeout
        self._attempts = attempts
        self._retry_delay = retry_delay

    async def score(self, tasks: Sequence[ScoreTask]) -> list[ScoreResult]:
        """One result per task, in order."""
        request = reward_pb2.ScoreBatchRequest(job=self.job, tasks=[t.to_pb() for t in tasks])
        for attempt in range(self._attempts):
            try:
                reply = await self.stub.ScoreBatch(request, timeout=self._timeout)
                return [ScoreResult.from_pb(r) for r in reply.results]
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RETRYABLE or attempt == self._attempts - 1:
                    raise
                await asyncio.sleep(self._retry_delay)
        raise AssertionError("unreachable")

    async def healthy(self) -> bool:
        return await is_serving(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> RewardClient:
        return self

    async def __aexit__(self, *_) -> None:
        await self.close()


def reward_scorer(address: str | None, job: str, reward) -> RewardClient | RewardScorer:
    """What scores a job's responses: the reward service at `address`, or, without one, the
    same scorer in this process (one math-verify worker, one sandbox slot, started on first
    use), so a job scores alike with or without the service. `reward` is the job's
    spec.reward. Both answer `score` and `close`."""
    if address:
        return RewardClient(address, job)
    from asyncrl.reward.scorer import RewardScorer

    return RewardScorer.from_spec(reward, workers=1)


class PromptScorer:
    """Scores the token responses to a prompt (the rollout workflow's Scorer, and the trainer's
    evaluator) with what `reward_scorer` gives. Dataset references become reward references
    here (an arithmetic answer -> math, a code task -> its unit tests)."""

    def __init__(self, client: RewardClient | RewardScorer, tokenizer):
        self._client = client
        self._tokenizer = tokenizer

    async def score(self, item, responses: list[list[int]]) -> list[float]:
        texts = [self._tokenizer.decode(r, skip_special_tokens=True) for r in responses]
        results = await self._client.score(
            ScoreTask.for_group(reward_reference(item.reference), texts, item.prompt_id))
        return [r.score for r in results]


def reward_reference(reference) -> MathReference | CodeReference:
    if isinstance(reference, (MathReference, CodeReference)):
        return reference
    if isinstance(reference, (int, float, str)):
        return MathReference(str(reference))
    test_code = getattr(reference, "test_code", None)
    if test_code is not None:
        return CodeReference(test_code=test_code)
    raise TypeError(f"no reward reference for {type(reference).__name__}")
