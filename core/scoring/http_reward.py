"""HTTP rewards (reward.kind: http): each response is POSTed as JSON
{"prompt", "response", "row"} to an endpoint served elsewhere (a reward model, a judge), and
its score read from the answer at reward.http.scoreField.

- An answer with status 5xx, or no answer within reward.http.timeoutSeconds, is retried
  reward.http.retries times with exponential backoff, then scores 0 (HTTP_ERROR, TIMEOUT).
- A 4xx answer, or one without a number at scoreField, scores 0 at once (HTTP_ERROR,
  INVALID_SCORE): asking again would get the same answer.
- An endpoint that cannot be reached at all (connection refused, no such host, no connection
  within the time limit) says nothing about the response: the call holds, trying again with
  backoff until the endpoint answers, and meanwhile `ready()` is False, so the service's
  health is NOT_SERVING. No response is scored 0 for an outage.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

from asyncrl.scoring.score_values import InvalidScore, as_number
from asyncrl.scoring.types import Failure, RowReference, ScoreResult

log = logging.getLogger(__name__)

# Errors of an endpoint that could not be reached: hold, never score.
_UNREACHABLE = (httpx.ConnectError, httpx.ConnectTimeout)
# A health check asks an unreachable endpoint again, briefly: probes have short deadlines.
PROBE_SECONDS = 1.0


class HttpScorer:
    def __init__(self, url: str, score_field: str = "score", *, timeout_seconds: float = 30.0,
                 retries: int = 3, max_concurrency: int = 16, retry_delay: float = 0.5,
                 max_hold_delay: float = 10.0):
        self.url = url
        self.score_field = score_field
        self._path = score_field.split(".")
        self._timeout = timeout_seconds
        self._retries = retries
        self._max_concurrency = max_concurrency
        self._retry_delay = retry_delay
        self._max_hold_delay = max_hold_delay
        self._client: httpx.AsyncClient | None = None
        self._slots: asyncio.Semaphore | None = None
        # Why the endpoint was last found unreachable; None while it answers.
        self._unreachable: str | None = None

    @classmethod
    def from_spec(cls, http, **options) -> HttpScorer:
        """From spec.reward.http (asyncrl.spec.HttpReward); `options` set the delays."""
        return cls(http.url, http.score_field, timeout_seconds=http.timeout_seconds,
                   retries=http.retries, max_concurrency=http.max_concurrency, **options)

    async def start(self) -> None:
        self._http()

    def _http(self) -> httpx.AsyncClient:
        # Made on first use, inside the event loop that uses it.
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self._timeout), follow_redirects=True,
                limits=httpx.Limits(max_connections=self._max_concurrency))
            self._slots = asyncio.Semaphore(self._max_concurrency)
        return self._client

    async def score(self, task_id: str, response: str, reference: RowReference) -> ScoreResult:
        start = time.perf_counter()
        body = {"prompt": reference.prompt, "response": response, "row": reference.row}
        attempts = self._retries + 1
        for attempt in range(attempts):
            if attempt:
                await asyncio.sleep(self._retry_delay * 2 ** (attempt - 1))
            try:
                answer = await self._post_until_reached(body)
            except httpx.TimeoutException:
                failure = Failure.TIMEOUT, (f"no answer within {self._timeout:g}s "
                                            "(reward.http.timeoutSeconds)")
                continue
            except httpx.TransportError as exc:  # the connection broke mid-request
                failure = Failure.HTTP_ERROR, f"{type(exc).__name__}: {exc}"
                continue
            if answer.status_code >= 500:
                failure = Failure.HTTP_ERROR, f"HTTP {answer.status_code}: {_snippet(answer)}"
                continue
            return self._read(task_id, answer, time.perf_counter() - start)
        reason, detail = failure
        return ScoreResult.failed(task_id, reason, f"{detail} (after {attempts} attempts)",
                                  wall_seconds=time.perf_counter() - start)

    async def _post_until_reached(self, body: dict) -> httpx.Response:
        delay = self._retry_delay
        while True:
            client = self._http()
            try:
                async with self._slots:
                    answer = await client.post(self.url, json=body)
            except _UNREACHABLE as exc:
                self._lost(exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self._max_hold_delay)
                continue
            except httpx.TransportError:
                self._reached()  # connected, then timed out or broke: it is there
                raise
            self._reached()
            return answer

    def _read(self, task_id: str, answer: httpx.Response, seconds: float) -> ScoreResult:
        def failed(failure: Failure, detail: str) -> ScoreResult:
            return ScoreResult.failed(task_id, failure, detail, wall_seconds=seconds)

        if not answer.is_success:
            return failed(Failure.HTTP_ERROR, f"HTTP {answer.status_code}: {_snippet(answer)}")
        try:
            score = as_number(field_at(answer.json(), self._path), repr(self.score_field))
        except ValueError as exc:  # not JSON (json's own error), or InvalidScore
            detail = str(exc) if isinstance(exc, InvalidScore) else f"the answer is not JSON: {exc}"
            return failed(Failure.INVALID_SCORE, f"{detail}: {_snippet(answer)}")
        except LookupError:
            return failed(Failure.INVALID_SCORE, f"the answer has no {self.score_field!r} "
                                                 f"(reward.http.scoreField): {_snippet(answer)}")
        return ScoreResult(task_id, score, 1, 1, seconds)

    def _lost(self, exc: Exception) -> None:
        if self._unreachable is None:
            log.warning("reward endpoint %s is unreachable (%s: %s); holding responses until "
                        "it answers", self.url, type(exc).__name__, exc)
        self._unreachable = (f"reward endpoint {self.url} is unreachable: "
                             f"{type(exc).__name__}: {exc}")

    def _reached(self) -> None:
        if self._unreachable is not None:
            log.warning("reward endpoint %s answers again", self.url)
            self._unreachable = None

    def health(self) -> tuple[bool, str]:
        return self._unreachable is None, self._unreachable or ""

    async def ready(self) -> bool:
        """False while the endpoint is unreachable; asks it once more first (any answer, an
        error status included, shows it is back), so that health recovers without traffic."""
        if self._unreachable is not None:
            try:
                await self._http().head(self.url, timeout=min(PROBE_SECONDS, self._timeout))
            except httpx.TransportError:
                pass
            else:
                self._reached()
        return self._unreachable is None

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def field_at(answer: Any, path: list[str]) -> Any:
    """answer["a"]["b"] for path ["a", "b"]; a number indexes a list. LookupError if absent."""
    value = answer
    for key in path:
        if isinstance(value, list) and key.lstrip("-").isdigit():
            value = value[int(key)]
        elif isinstance(value, dict):
            value = value[key]
        else:
            raise KeyError(key)
    return value


def _snippet(answer: httpx.Response) -> str:
    text = answer.text.strip().replace("\n", " ")
    return text[:200] + ("..." if len(text) > 200 else "")
