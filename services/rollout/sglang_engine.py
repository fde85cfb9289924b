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

With LoRA (`lora=True`: model.lora), step 3 loads the version's peft adapter directory with
/load_lora_adapter under a name of its own (`adapter_name`), beside the base, and each send
names the adapter served when it was pinned: its tokens are that adapter's version whatever
SGLang reports (its weight version is the base's). The adapter a version replaced is unloaded
once no send of this engine that named it is in flight (SGLang would keep serving it until
then). Until the first adapter, sends name none: the base is version 0, since peft starts an
adapter at B = 0. SGLang 0.5.23 receives no adapter by broadcast, so LoRA versions come from
disk only (the spec refuses trainer.weightTransfer distributed with them).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
import uuid
from pathlib import Path

from asyncrl.rollout.sglang_client import SGLangClient, adapter_name
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
        lora: bool = False,
    ):
        """`lora`: versions are LoRA adapters (the job has model.lora), loaded beside the
        base through SGLang's adapter API."""
        self._client = client
        self._lora = lora
        self._adapter: str | None = None  # the adapter sends name (None: the base)
        self._senders: collections.Counter[str | None] = collections.Counter()
        self._replaced: set[str] = set()  # adapters to unload once no send names them
        self._unloads: set[asyncio.Task] = set()
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
            pinned, adapter, updates = self._version, self._adapter, self._updates_started
            budget = params.max_new_tokens - len(result.output_ids)
            self._in_flight += 1
            self._senders[adapter] += 1
            try:
                part = await self._client.generate(
                    list(prompt_ids) + result.output_ids,
                    dataclasses.replace(params, max_new_tokens=budget),
                    rid=f"{result.request_id}-{attempt}",
                    version=pinned, adapter=adapter,
                )
            finally:
                self._in_flight -= 1
                self._senders[adapter] -= 1
                if not self._senders[adapter]:
                    del self._senders[adapter]
                    if adapter in self._replaced:
                        self._unload_later(adapter)
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
        if not self._lora:
            return await self._update(
                version, lambda: self._client.update_weights_from_disk(str(path), version))
        name = adapter_name(version)

        async def load() -> WeightUpdate:
            started = time.perf_counter()
            await self._client.load_lora_adapter(name, str(path))
            return WeightUpdate(version, 0, time.perf_counter() - started)

        update = await self._update(version, load, adapter=name)
        log.info("version %d serves LoRA adapter %s (%s)", version, name, path)
        for replaced in [a for a in self._replaced if not self._senders[a]]:
            await self._unload(replaced)
        return update

    def _unload_later(self, name: str) -> None:
        task = asyncio.create_task(self._unload(name))
        self._unloads.add(task)
        task.add_done_callback(self._unloads.discard)

    async def _unload(self, name: str) -> None:
        """Unloads a replaced adapter, once: an adapter left loaded costs the server memory,
        never a wrong token, so a failure is logged, not raised."""
        if name not in self._replaced:
            return
        self._replaced.discard(name)
        try:
            await self._client.unload_lora_adapter(name)
        except Exception as exc:  # noqa: BLE001 - see the docstring
            log.warning("could not unload LoRA adapter %s: %s", name, exc)

    async def join_weight_transfer(self, address: GroupAddress, rank_offset: int) -> None:
        """Joins a generation of the group; the server leaves the one it was in first (that
        generation is over), so its communicators do not pile up."""
        if self._lora:
            raise RuntimeError("SGLang receives no LoRA adapter by broadcast: with model.lora "
                               "its versions come from disk (trainer.weightTransfer: disk)")
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

    async def _update(self, version: int, load, adapter: str | None = None) -> WeightUpdate:
        """Runs `load()` (which puts policy `version` in place on the server) between pausing
        the server in mode abort and continuing it; sends then name `adapter` when given."""
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
                    if adapter is not None:
                        if self._adapter is not None:
                            self._replaced.add(self._adapter)
                        self._adapter = adapter
                finally:
                    await self._client.resume()
            finally:
                self._may_send.set()
            seconds = time.perf_counter() - started
            self._swap_seconds += update.seconds
            return WeightUpdate(version, interrupted, seconds)
