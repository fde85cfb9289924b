"""`InferenceEngine` over a remote SGLang server (or anything speaking its native HTTP API).

Interruption works the way SGLang does it. A weight update

1. stops new requests from being sent (they wait, then go out under the new version),
2. pauses the server in mode "abort": every running request returns at once with
   finish_reason "abort" and the tokens it had,
3. loads the snapshot with /update_weights_from_disk, or receives the trainer's broadcast
   with /update_weights_from_distributed in buckets (KV cache flushed either way), and
4. continues the server.

`generate` then resends each request it lost to the update as prompt + tokens so far with the
remaining token budget, so one response can span versions. The version is pinned before each
send: tokens of an aborted send carry that version (they were generated before the pause), the
server's own per-token or request version is used otherwise (see `SGLangClient.generate`), so
an update landing between pinning and sending cannot mislabel a token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from pathlib import Path

from asyncrl.rollout.sglang_client import SGLangClient
from asyncrl.engine.types import EngineStatus, GenerationResult, SamplingParams, WeightUpdate
from asyncrl.weights.distributed import DEFAULT_BUCKET_BYTES, GroupAddress, TensorMeta, buckets

log = logging.getLogger(__name__)


class SGLangEngine:
    def __init__(
        self,
        client: SGLangClient,
        *,
        max_running_requests: int,
        max_sequence_length: int,
        version: int = 0,
        transfer_bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ):
        self._client = client
        self._bucket_bytes = transfer_bucket_bytes
        self._version = version
        client.version = version
        self._max_running_requests = max_running_requests
        self._max_sequence_length = max_sequence_length
        self._may_send = asyncio.Event()
        self._may_send.set()
        self._update_lock = asyncio.Lock()
        self._updates_started = 0  # an abort seen after one started is an interruption
        self._paused = False
        self._alive = True
        self._in_flight = 0
        self._waiting = 0
        self._generated_total = 0
        self._interrupted_total = 0
        self._swap_seconds = 0.0
        self._group_name: str | None = None  # the weight transfer group, once joined

    # ------------------------------------------------------------------ InferenceEngine

    @property
    def version(self) -> int:
        return self._version

    @property
    def alive(self) -> bool:
        return self._alive

    def set_healthy(self, healthy: bool) -> None:
        """Set by whoever watches the server (its /health, its process)."""
        self._alive = healthy

    def status(self) -> EngineStatus:
        return EngineStatus(
            version=self._version,
            paused=self._paused,
            running_requests=self._in_flight,
            waiting_requests=self._waiting,
            generated_tokens_total=self._generated_total,
            interrupted_requests_total=self._interrupted_total,
            max_running_requests=self._max_running_requests,
            max_sequence_length=self._max_sequence_length,
            weight_swap_seconds_total=self._swap_seconds,
        )

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        result = GenerationResult(uuid.uuid4().hex, list(prompt_ids))
        attempt = 0
        while True:
            self._waiting += 1
            try:
                await self._may_send.wait()
            finally:
                self._waiting -= 1
            pinned, updates = self._version, self._updates_started
            budget = params.max_new_tokens - len(result.output_ids)
            self._in_flight += 1
            try:
                part = await self._client.generate(
                    list(prompt_ids) + result.output_ids,
                    dataclasses.replace(params, max_new_tokens=budget),
                    rid=f"{result.request_id}-{attempt}",
                    version=pinned,
                )
            finally:
                self._in_flight -= 1
            attempt += 1
            result.output_ids += part.output_ids
            result.output_logprobs += part.output_logprobs
            result.output_versions += part.output_versions
            result.interruptions += part.interruptions
            self._generated_total += len(part.output_ids)
            interrupted = part.finish_reason == "abort" and self._updates_started != updates
            if not interrupted:
                result.finish_reason, result.matched_stop = part.finish_reason, part.matched_stop
                return result
            result.interruptions += 1
            self._interrupted_total += 1
            if len(result.output_ids) >= params.max_new_tokens:
                result.finish_reason = "length"
                return result

    async def pause(self) -> None:
        await self._client.pause("retract")
        self._paused = True

    async def resume(self) -> None:
        await self._client.resume()
        self._paused = False

    async def update_weights_from_disk(self, path: Path, version: int) -> WeightUpdate:
        return await self._update(
            version, lambda: self._client.update_weights_from_disk(str(path), version))

    async def join_weight_transfer(self, address: GroupAddress, rank_offset: int) -> None:
        """Joins a generation of the group; the server leaves the one it was in first (that
        generation is over), so its communicators do not pile up."""
        if self._group_name is not None and self._group_name != address.group_name:
            left, self._group_name = self._group_name, None
            try:
                await self._client.destroy_weights_update_group(left)
            except Exception as exc:  # noqa: BLE001 - leaving is tidying up, not required
                log.warning("could not leave weight transfer group %s: %s", left, exc)
        await self._client.init_weights_update_group(address, rank_offset)
        self._group_name = address.group_name

    async def update_weights_from_distributed(self, tensors: list[TensorMeta],
                                              version: int) -> WeightUpdate:
        if self._group_name is None:
            raise RuntimeError("join_weight_transfer first")

        async def receive() -> WeightUpdate:
            started = time.perf_counter()
            parts = buckets(tensors, self._bucket_bytes)
            for i, part in enumerate(parts):
                last = i == len(parts) - 1
                await self._client.update_weights_from_distributed(
                    part, self._group_name, version if last else None)
            return WeightUpdate(version, 0, time.perf_counter() - started)

        return await self._update(version, receive)

    async def _update(self, version: int, load) -> WeightUpdate:
        """Runs `load()` (which puts policy `version` in place on the server) between pausing
        the server in mode abort and continuing it."""
        async with self._update_lock:
            started = time.perf_counter()
            self._updates_started += 1
            self._may_send.clear()
            interrupted = self._in_flight
            try:
                await self._client.pause("abort")
                try:
                    update = await load()
                    self._version = version
                finally:
                    await self._client.resume()
            finally:
                self._may_send.set()
            seconds = time.perf_counter() - started
            self._swap_seconds += update.seconds
            return WeightUpdate(version, interrupted, seconds)
