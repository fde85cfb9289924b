"""How a policy version reaches the rollout engines (the three paths: asyncrl.weights), on the
trainer's leader: copied into the shared buffer (ipc: on the GPU, or in the CPU's shared
memory), else broadcast to the transfer group once it has formed (distributed), else written
as a snapshot on disk; then announced with the buffer's SetVersion.

The announced step is what the job's completion is judged by, so a version is announced with
its step only once every engine can have it (see `Publisher.publish`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Awaitable, Callable

import torch

from asyncrl.clients.buffer import BufferClient
from asyncrl.platform.settings import TrainerSettings
from asyncrl.spec import load_manifest
from asyncrl.trainer.checkpoints import publish_weights
from asyncrl.trainer.metrics import TrainerMetrics
from asyncrl.trainer.weights_broadcast import WeightBroadcaster
from asyncrl.weights.distributed import TensorMeta, announcement_uri
from asyncrl.weights.distributed import backend as transfer_backend
from asyncrl.weights.distributed import world_size as transfer_world_size
from asyncrl.weights.ipc import SharedWeights, shared_memory_shortfall
from asyncrl.weights.ipc import announcement_uri as ipc_announcement_uri

if TYPE_CHECKING:
    from asyncrl.trainer.service import Status

log = logging.getLogger(__name__)

#: How long the first version waits for the rollout engines to form the weight transfer group.
FIRST_VERSION_WAIT_SECONDS = 30.0


class Publisher:
    """Makes each policy version the rollout engines', by the path the job takes
    (spec.trainer.weightTransfer, resolved at start). `on_compute` runs work on the trainer's
    compute thread; `status.version` follows each version announced."""

    def __init__(self, settings: TrainerSettings, spec, hf_model: torch.nn.Module,
                 device: torch.device, version_tensors: list[TensorMeta],
                 on_compute: Callable[..., Awaitable], metrics: TrainerMetrics, status: Status):
        """`hf_model`: the Hugging Face model whose config and names snapshots are written
        with; `version_tensors`: what each version moves to every engine."""
        self.settings, self.spec = settings, spec
        self.hf_model, self.device = hf_model, device
        self.version_tensors = version_tensors
        self._on_compute = on_compute
        self.metrics, self.status = metrics, status
        self.published_uri = ""  # where the newest version was published
        self._waited_for_group = False
        self.broadcaster = None
        if spec.trainer.weight_transfer == "distributed":
            self.broadcaster = WeightBroadcaster(
                settings.weights_port, self._transfer_world_size,
                transfer_backend(spec), version_tensors)
        self.shared_weights = self._shared_weights()

    def _shared_weights(self) -> SharedWeights | None:
        """The buffer an engine on this device copies each version from, when the job's path
        is ipc (resolved at start: the runner has put trainer and rollout on one GPU, or both
        on the CPU), in GPU memory or the CPU's shared memory; else None, and versions go to
        disk, as they do where the shared memory is too small for one."""
        if self.spec.trainer.weight_transfer != "ipc":
            return None
        if self.device.type == "cpu":
            shortfall = shared_memory_shortfall(sum(t.bytes for t in self.version_tensors))
            if shortfall:
                log.warning("weights go to disk, not by ipc: %s (give the machine or the "
                            "container more shared memory, e.g. docker run --shm-size, or "
                            "set trainer.weightTransfer: disk)", shortfall)
                return None
        return SharedWeights(self.settings.run_dir / "weights" / "ipc", self.version_tensors,
                             self.version_tensors[0].dtype, self.device)

    def close(self) -> None:
        """Lets the shared buffer's memory go (a CPU buffer's file)."""
        if self.shared_weights is not None:
            self.shared_weights.close()

    def _transfer_world_size(self) -> int:
        """The weight transfer group's size as the job says now: scaling the rollout changes
        the job file (the operator's ConfigMap) without restarting the trainer."""
        try:
            spec = load_manifest(self.settings.job_file).spec
        except Exception as exc:  # noqa: BLE001 - mid-update, say: the spec it started with
            log.warning("could not read %s again (%s): the weight transfer group keeps the "
                        "started job's size", self.settings.job_file, exc)
            spec = self.spec
        return transfer_world_size(spec)

    async def publish(self, client: BufferClient, version: int, step: int,
                      state: dict, announce_step: bool = True) -> tuple[str, float]:
        """Makes policy `version` (the whole model's `state`) the rollout engines': broadcast
        when the transfer group is up, else as a snapshot on disk; then announced, with
        `step` (else the step before it: the caller announces `step` later). Returns how
        (ipc, distributed or disk) and the seconds it took."""
        announced = step if announce_step else max(step - 1, 0)
        if self.shared_weights is not None:
            # Written into the buffer (once no engine copies from it), then announced: an
            # engine reads the manifest the announcement names and copies on its GPU.
            started = time.perf_counter()
            await self._on_compute(self.shared_weights.write, state, version)
            uri = self.published_uri = ipc_announcement_uri(self.shared_weights.manifest_path)
            await client.set_version(version, uri, announced)
            self.status.version = version
            seconds = time.perf_counter() - started
            self.metrics.observe_publish(seconds, "ipc")
            return "ipc", seconds
        # The engines join while the trainer loads and takes its first step: its first
        # version waits a little for them rather than go to disk seconds before they are in.
        wait = 0.0 if self._waited_for_group else FIRST_VERSION_WAIT_SECONDS
        self._waited_for_group = True
        if self.broadcaster is not None and await asyncio.to_thread(self.broadcaster.ready,
                                                                    wait):
            # Announced first, each engine starts receiving when it reads the announcement;
            # the step is announced only once the broadcast is done (the job's completion is
            # judged by it), as a snapshot's step is once the snapshot is written.
            uri = self.published_uri = announcement_uri(self.broadcaster.address.group_name)
            await client.set_version(version, uri, max(step - 1, 0))
            try:
                seconds = await self._on_compute(self.broadcaster.send, state)
            except Exception as exc:
                log.warning("broadcasting version %d failed (%s): it goes to disk, and so do "
                            "later versions until the next generation of the group has formed",
                            version, exc)
            else:
                await client.set_version(version, uri, announced)
                self.status.version = version
                self.metrics.observe_publish(seconds, "distributed")
                return "distributed", seconds
        started = time.perf_counter()
        dtype = getattr(torch, self.spec.model.dtype)
        path = await self._on_compute(publish_weights, self.hf_model, state, self.settings.run_dir,
                                      version, dtype, lora=self.spec.model.lora)
        self.published_uri = str(path.resolve())
        await client.set_version(version, self.published_uri, announced)
        self.status.version = version
        seconds = time.perf_counter() - started
        self.metrics.observe_publish(seconds, "disk")
        return "disk", seconds
