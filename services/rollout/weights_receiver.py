"""Keeps a rollout worker on the newest policy version announced in Redis.

The worker subscribes to the job's weights channel, then reads the weights hash: whatever was
announced before the subscription is caught up at once, and every later announcement arrives
as a message. Messages only say "look again"; the hash is the truth, re-read on every message,
every `poll_seconds` without one, and after reconnecting, so lost messages cost at most one
poll interval and never a version. While Redis is unreachable the watcher retries with backoff
(`redis`, an Outage: the worker's readiness) and gives up past the outage bound.

A version comes from a snapshot (a path or URL); with trainer.weightTransfer distributed,
by broadcast from the trainer to the group this worker joined (`TransferMember`); with ipc,
copied on the GPU from the trainer's buffer (`IpcReceiver`).
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Awaitable, Callable
from urllib.parse import urlparse

import httpx
import redis.asyncio as redis
import torch

from asyncrl.platform.outage import Outage, redis_down
from asyncrl.engine.api import InferenceEngine
from asyncrl.engine.types import WeightUpdate
from asyncrl.weights.distributed import (
    CHECK_TIMEOUT_SECONDS,
    JOIN_TIMEOUT_SECONDS,
    GroupAddress,
    TensorMeta,
    announced_group,
    claim_ranks,
    connect_store,
    current_generation,
    in_background,
    is_distributed_uri,
    wait_for_claims,
)
from asyncrl.weights.announcements import WeightVersion, weights_channel, weights_key
from asyncrl.weights.ipc import IpcReader, NotThisVersion, is_ipc_uri, manifest_path

log = logging.getLogger(__name__)

ApplyWeights = Callable[[WeightVersion], Awaitable[None]]


class VersionSkipped(Exception):
    """An announcement this worker cannot take (a broadcast it is not part of): the version
    stays as it is until a later announcement, such as the same version on disk."""


class WeightWatcher:
    def __init__(
        self,
        client: redis.Redis,
        job: str,
        apply: ApplyWeights,
        *,
        current_version: int = 0,
        poll_seconds: float = 5.0,
        outage: Outage | None = None,
    ):
        self._client = client
        self._job = job
        self._apply = apply
        self.version = current_version
        self._poll_seconds = poll_seconds
        self.redis = outage or Outage("Redis")
        self.updates = 0
        #: Set once the first read of the announced version is done (and that version, if
        #: newer, applied): a worker that starts mid-run generates from there, not from the
        #: weights it loaded at start.
        self.caught_up = asyncio.Event()

    async def run(self) -> None:
        """Runs until cancelled, reconnecting with backoff when Redis goes away; raises
        OutageTooLong once it has been away for longer than the bound."""
        while True:
            try:
                await self._watch()
            except Exception as exc:
                if not redis_down(exc):
                    raise
                await asyncio.sleep(self.redis.failed(exc))

    async def _watch(self) -> None:
        async with self._client.pubsub() as pubsub:
            await pubsub.subscribe(weights_channel(self._job))
            await self.catch_up()
            self.caught_up.set()
            self.redis.recovered()
            while True:
                await pubsub.get_message(ignore_subscribe_messages=True,
                                         timeout=self._poll_seconds)
                await self.catch_up()

    async def catch_up(self) -> None:
        """Applies the announced version if it is newer than the one being served."""
        announced = WeightVersion.from_hash(await self._client.hgetall(weights_key(self._job)))
        if announced is None or announced.version <= self.version:
            return
        try:
            await self._apply(announced)
        except VersionSkipped as skipped:
            log.info("version %d not applied: %s", announced.version, skipped)
            return
        self.version = announced.version
        self.updates += 1


async def fetch_snapshot(uri: str, cache_dir: Path) -> Path:
    """A local path for a snapshot URI: a path or file:// as is, http(s) downloaded once."""
    parsed = urlparse(uri)
    if parsed.scheme in ("", "file"):
        return Path(parsed.path if parsed.scheme else uri)
    if parsed.scheme not in ("http", "https"):
        raise ValueError(f"weights uri {uri!r}: use a path, file://, http:// or https://")
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / (Path(parsed.path).name or "model.safetensors")
    with tempfile.NamedTemporaryFile(dir=cache_dir, delete=False) as partial:
        async with httpx.AsyncClient(timeout=None) as http:
            async with http.stream("GET", uri) as response:
                response.raise_for_status()
                async for chunk in response.aiter_bytes(1 << 20):
                    partial.write(chunk)
    Path(partial.name).replace(target)
    return target


class TransferMember:
    """A rollout worker's end of the distributed weight transfer (asyncrl.weights.distributed).
    `run` keeps this engine in the trainer's current generation of the group: it joins it
    (claiming this engine's ranks in it), then checks the trainer's store every
    `check_seconds` and joins the next generation whenever the store names another one (the
    trainer formed it after a broadcast failed, or restarted with a new store). `receive`
    takes each version broadcast to the generation this engine is in."""

    def __init__(self, engine: InferenceEngine, store_address: str, ranks: int, backend: str,
                 tensors: list[TensorMeta], *, check_seconds: float = 2.0):
        host, _, port = store_address.rpartition(":")
        self.engine = engine
        # The world size is each generation's, as the trainer's store names it.
        self.address = GroupAddress(host, int(port), 0, backend=backend)
        self.ranks = ranks
        self.tensors = tensors
        self.check_seconds = check_seconds
        self.group_name: str | None = None   # the generation this engine is in
        self.joins = 0
        self._joining: tuple[str, asyncio.Event] | None = None  # a generation being joined
        self._store = None
        self._trouble = ""   # the last reason this worker is outside the group, logged once

    @property
    def joined(self) -> bool:
        return self.group_name is not None

    async def run(self) -> None:
        """Joins the current generation, then follows the trainer's store; until cancelled."""
        while True:
            await self.join()
            await asyncio.sleep(self.check_seconds)

    async def join(self) -> None:
        """Joins the generation the trainer's store names, unless this engine is in it; logs
        why not when it cannot (meanwhile versions come from disk)."""
        address = self.address
        try:
            generation, world = await self._generation()
        except Exception as exc:  # the trainer is away, its store (and group) with it
            self._store, self.group_name = None, None
            return self._outside(exc)
        if generation == self.group_name:
            return
        self.group_name = None  # a new generation: the one this engine was in is over
        self._joining = (generation, asyncio.Event())
        try:
            rank = claim_ranks(self._store, self.ranks, world, generation)
            await asyncio.wrap_future(in_background(
                wait_for_claims, self._store, generation, world, JOIN_TIMEOUT_SECONDS,
                lambda: current_generation(self._store)[0] == generation))
            await self.engine.join_weight_transfer(
                replace(address, group_name=generation, world_size=world), rank)
        except Exception as exc:  # no rank left in it, or it did not form in time
            self._outside(exc)
        else:
            self.group_name, self._trouble = generation, ""
            self.joins += 1
            log.info("joined the weight transfer group %s at %s:%d as rank %d", generation,
                     address.master_address, address.master_port, rank)
        finally:
            self._joining[1].set()
            self._joining = None

    async def _generation(self) -> tuple[str, int]:
        """The generation the trainer's store names and its world size (connecting to the
        store first, waiting for a trainer to host it)."""
        if self._store is None:
            address = self.address
            self._store = await asyncio.wrap_future(in_background(
                connect_store, address.master_address, address.master_port,
                CHECK_TIMEOUT_SECONDS))
        return await asyncio.wrap_future(in_background(current_generation, self._store))

    def _outside(self, exc: Exception) -> None:
        if str(exc) != self._trouble:  # once per reason, not every check
            log.warning("not in the weight transfer group (%s): this worker loads versions "
                        "from disk until it joins", exc)
            self._trouble = str(exc)

    async def join_returned(self, group_name: str) -> None:
        """Returns once a join of generation `group_name` under way has returned (at once when
        none is): the trainer sees the group formed before this engine's join has returned."""
        if self._joining is not None and self._joining[0] == group_name:
            await self._joining[1].wait()

    async def receive(self, version: int, group_name: str) -> WeightUpdate:
        """Version `version`, broadcast to generation `group_name`."""
        # The group may form and its first version come before our join has returned.
        await self.join_returned(group_name)
        if group_name != self.group_name:
            where = f"is in {self.group_name}" if self.group_name else "is in none"
            raise VersionSkipped(f"broadcast to {group_name}; this worker {where}: waiting for "
                                 "the trainer to write it to disk")
        try:
            return await self.engine.update_weights_from_distributed(self.tensors, version)
        except Exception as exc:
            # The trainer (or a peer) went away mid-broadcast: this generation is over. The
            # engine generates nothing until whole weights land, which the trainer's fallback
            # to disk brings; the worker carries on and joins the next generation.
            self.group_name = None
            raise VersionSkipped(f"the broadcast failed ({exc}); waiting for the trainer "
                                 "to write this version to disk") from exc


class IpcReceiver:
    """A torch engine's end of the ipc transfer (asyncrl.weights.ipc): each version copied
    device to device from the trainer's buffer into the engine's weights (`engine`: a
    TorchEngine computing on `device`)."""

    def __init__(self, engine, device: torch.device):
        self.engine = engine
        self.reader = IpcReader(device)

    async def receive(self, announced: WeightVersion) -> WeightUpdate:
        version = announced.version

        def copy_in(tensors) -> WeightUpdate:
            return self.engine.update_weights_from_state_dict(tensors, version)

        try:
            return await asyncio.to_thread(self.reader.read, manifest_path(announced.uri),
                                           version, copy_in)
        except NotThisVersion as exc:
            raise VersionSkipped(f"{exc}; the next announcement brings it") from exc


def engine_applier(engine: InferenceEngine, cache_dir: Path, metrics=None,
                   transfer: TransferMember | None = None,
                   ipc: IpcReceiver | None = None) -> ApplyWeights:
    """Applies announced versions to an InferenceEngine (torch or SGLang): a snapshot from
    disk or HTTP, a broadcast through `transfer`, or a copy from the trainer's GPU buffer
    through `ipc`. Counts each update and its latency in `metrics` (a RolloutMetrics) when
    given."""

    async def apply(announced: WeightVersion) -> None:
        try:
            if is_ipc_uri(announced.uri):
                if ipc is None:
                    raise VersionSkipped("shared by the trainer (ipc), but this worker reads "
                                         "no ipc weights (trainer.weightTransfer is not ipc "
                                         "in its job)")
                update = await ipc.receive(announced)
            elif is_distributed_uri(announced.uri):
                if transfer is None:
                    raise VersionSkipped("broadcast, but this worker has no weights address")
                update = await transfer.receive(announced.version,
                                                announced_group(announced.uri))
            else:
                path = await fetch_snapshot(announced.uri, cache_dir)
                update = await engine.update_weights_from_disk(path, announced.version)
        except VersionSkipped:
            raise
        except Exception:
            if metrics is not None:
                metrics.observe_weight_update_failure()
            raise
        if metrics is not None:
            metrics.observe_weight_update(update)
        # One line a version: what a user (and bench/lora_job.py) reads a sync's cost from.
        log.info("version %d applied in %.1f ms (%s)", update.version, update.seconds * 1e3,
                 "ipc" if is_ipc_uri(announced.uri)
                 else "distributed" if is_distributed_uri(announced.uri) else "disk")

    return apply
