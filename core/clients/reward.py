"""The reward service's client: `await RewardClient(address).score(tasks)`."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import TYPE_CHECKING, Any, Sequence

import grpc

from asyncrl.platform.grpc_health import is_serving
from asyncrl.platform.grpc_service import channel
from asyncrl.scoring.types import (
    CodeReference,
    Failure,
    IoCase,
    MathReference,
    Reference,
    RowReference,
    ScoreResult,
    ScoreTask,
)
from asyncrl.v1 import reward_pb2, reward_pb2_grpc

if TYPE_CHECKING:
    from asyncrl.scoring.scorer import RewardScorer

# Scoring is idempotent, so a call may be repeated while the service restarts.
_RETRYABLE = {grpc.StatusCode.UNAVAILABLE}


class RewardClient:
    """`kind` is the job's reward kind (spec.reward.kind), if known: PromptScorer reads it,
    and an http job's call that runs out of time is sent again, never given up, as the service
    holds responses while the endpoint is unreachable."""

    def __init__(self, address: str, job: str = "", *, kind: str | None = None,
                 timeout: float = 600.0, attempts: int = 20, retry_delay: float = 0.25):
        self._channel = channel(address)
        self.stub = reward_pb2_grpc.RewardStub(self._channel)
        self.job = job
        self.kind = kind
        self._timeout = timeout
        self._attempts = attempts
        self._retry_delay = retry_delay

    async def score(self, tasks: Sequence[ScoreTask]) -> list[ScoreResult]:
        """One result per task, in order."""
        request = reward_pb2.ScoreBatchRequest(job=self.job, tasks=[t.to_pb() for t in tasks])
        attempt = 0
        while True:
            try:
                reply = await self.stub.ScoreBatch(request, timeout=self._timeout)
                return [ScoreResult.from_pb(r) for r in reply.results]
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED and self.kind == "http":
                    continue  # held for an unreachable endpoint: keep waiting
                attempt += 1
                if exc.code() not in _RETRYABLE or attempt == self._attempts:
                    raise
                await asyncio.sleep(self._retry_delay)

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
        return RewardClient(address, job, kind=reward.kind)
    from asyncrl.scoring.scorer import RewardScorer

    return RewardScorer.from_spec(reward, workers=1)


class PromptScorer:
    """Scores the token responses to a prompt (the rollout workflow's Scorer, and the trainer's
    evaluator) with what `reward_scorer` gives. Prompt items become reward references here
    (`reward_reference`), by the job's reward kind: `kind`, else the client's own.
    `truncated_reward` (reward.truncatedReward), where set, is the reward of every response
    cut at maxNewTokens, whatever it scored. `format_score` (reward.math.formatScore, in
    training) is the reward of a response whose stated answer is wrong."""

    def __init__(self, client: RewardClient | RewardScorer, tokenizer, kind: str | None = None,
                 truncated_reward: float | None = None, format_score: float = 0.0):
        self._client = client
        self._tokenizer = tokenizer
        self._kind = kind or getattr(client, "kind", None)
        self._truncated_reward = truncated_reward
        self._format_score = format_score

    async def score(self, item, responses: list[list[int]],
                    cut: Sequence[bool] | None = None) -> list[float]:
        """One reward per response; `cut[i]` says response i ended at maxNewTokens."""
        texts = [self._tokenizer.decode(r, skip_special_tokens=True) for r in responses]
        results = await self._client.score(
            ScoreTask.for_group(reward_reference(item, self._kind), texts, item.prompt_id))
        scores = [r.score for r in results]
        if self._format_score:
            scores = [self._format_score if r.failure is Failure.WRONG_ANSWER else score
                      for r, score in zip(results, scores, strict=True)]
        if self._truncated_reward is None or cut is None:
            return scores
        return [self._truncated_reward if was_cut else score
                for score, was_cut in zip(scores, cut, strict=True)]


def reward_reference(item, kind: str | None = None) -> Reference:
    """What the reward service scores a prompt's responses against (`item` is an
    asyncrl.data.prompts.PromptItem): for a python or http reward, the prompt's text and its row
    (`reward_row`); otherwise the item's reference, an answer (math) or unit tests (code)."""
    if kind in ("python", "http"):
        return RowReference.of(item.text, reward_row(item))
    reference = item.reference
    if isinstance(reference, (MathReference, CodeReference)):
        return reference
    if isinstance(reference, (int, float, str)):
        return MathReference(str(reference))
    test_code = getattr(reference, "test_code", None)
    if test_code is not None:  # a generated code task, or a file row's CodeTests
        return CodeReference(
            test_code=test_code, prelude=getattr(reference, "prelude", ""),
            io_cases=tuple(IoCase(stdin, stdout)
                           for stdin, stdout in getattr(reference, "io_cases", ())))
    raise TypeError(f"prompt {item.prompt_id}: no {kind or 'math or code'} reward reference "
                    f"for {type(reference).__name__}")


def reward_row(item) -> dict[str, Any]:
    """The row a python or http reward reads: a file dataset's row, all its fields; for a
    generated dataset (no row) its prompt_id and prompt text and what it is checked against:
    `answer` (arith), or the task's fields (code: question, test_code)."""
    if item.row:
        return dict(item.row)
    row: dict[str, Any] = {"prompt_id": item.prompt_id, "prompt": item.text}
    reference = item.reference
    if dataclasses.is_dataclass(reference) and not isinstance(reference, type):
        row.update(dataclasses.asdict(reference))
    elif reference is not None:
        row["answer"] = reference
    return row
