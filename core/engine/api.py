"""The one interface through which the rollout service drives an inference engine.

The workflow (generate), the weight watcher (update_weights_from_disk) and the metrics and
health endpoints (status, alive) see only `InferenceEngine`; two implementations stand behind
it:

- `TorchInferenceEngine`: the in-process torch engine (`asyncrl.engine.torch_engine.TorchEngine`),
  CPU or GPU, interrupted in place by weight updates (each unfinished request is re-prefilled
  under the new weights and keeps per-token versions);
- `SGLangEngine` (`asyncrl.rollout.sglang_engine`): a remote SGLang server driven over its HTTP
  API, interrupted the way SGLang is (abort, reload, resend prompt + tokens so far).

Every generated token carries its log-probability under the behaviour policy and the policy
version that produced it, whichever engine runs.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Protocol, runtime_checkable

from asyncrl.engine.types import EngineStatus, GenerationResult, SamplingParams, WeightUpdate
from asyncrl.weights.distributed import (
    JOIN_TIMEOUT_SECONDS,
    GroupAddress,
    TensorMeta,
    in_background,
    join,
)


@runtime_checkable
class InferenceEngine(Protocol):
    @property
    def version(self) -> int:
        """The policy version new tokens are generated with."""

    @property
    def alive(self) -> bool:
        """False once the engine can no longer serve (its worker died, its server is down)."""

    def status(self) -> EngineStatus:
        """Counters and occupancy, for metrics and `GetStatus`."""

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        """One response, with per-token log-probabilities and versions; weight updates that
        land meanwhile interrupt it but never end it early."""

    async def pause(self) -> None:
        """Stops generating at the next step; requests are kept."""

    async def resume(self) -> None: ...

    async def update_weights_from_disk(self, path: Path, version: int) -> WeightUpdate:
        """Loads the snapshot at `path` (a Hugging Face model directory or a safetensors file)
        as policy `version`, interrupting running requests."""

    async def join_weight_transfer(self, address: GroupAddress, rank_offset: int) -> None:
        """Joins the trainer's weight transfer group (asyncrl.weights.distributed) as rank
        `rank_offset` (and the ranks after it, one per GPU of an SGLang server); returns once
        every rank has joined."""

    async def update_weights_from_distributed(self, tensors: list[TensorMeta],
                                              version: int) -> WeightUpdate:
        """Receives the tensors the trainer broadcasts as policy `version`, interrupting
        running requests."""


class TorchInferenceEngine:
    """`InferenceEngine` over a started TorchEngine: its futures become awaitables, and calls
    that wait (pause, loading weights, abort) run in worker threads, off the event loop."""

    def __init__(self, engine):
        self.engine = engine
        self._group = None  # the weight transfer group, once joined

    @property
    def version(self) -> int:
        return self.engine.version

    @property
    def alive(self) -> bool:
        return self.engine.alive

    def status(self) -> EngineStatus:
        return self.engine.status()

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        return await asyncio.wrap_future(self.engine.submit(prompt_ids, params))

    async def pause(self) -> None:
        await asyncio.to_thread(self.engine.pause)

    async def resume(self) -> None:
        self.engine.resume()

    async def update_weights_from_disk(self, path: Path, version: int) -> WeightUpdate:
        return await asyncio.to_thread(self.engine.update_weights, path, version)

    async def join_weight_transfer(self, address: GroupAddress, rank_offset: int) -> None:
        self._group = await asyncio.wrap_future(
            in_background(join, address, rank_offset, JOIN_TIMEOUT_SECONDS))

    async def update_weights_from_distributed(self, tensors: list[TensorMeta],
                                              version: int) -> WeightUpdate:
        if self._group is None:
            raise RuntimeError("join_weight_transfer first")
        return await asyncio.to_thread(self.engine.update_weights_from_distributed,
                                       self._group, tensors, version)
