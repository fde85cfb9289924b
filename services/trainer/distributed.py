"""The trainer's process group under torchrun: who talks to the buffer, how the others are
told what to do, and how a sharded model's state is gathered and restored.

Rank 0 (the leader) alone talks to the buffer, publishes weights, writes checkpoints and
metrics, and evaluates. Every other rank (a follower) runs a loop of commands the leader
sends: `restore` (load this checkpoint), `step` (update on this share of the batch), `state`
and `checkpoint` (take part in gathering the full model, and optimizer, state), `wait` (a
heartbeat while the leader waits for a batch or works alone) and `stop` (exit). Commands go
through a gloo group, also when the tensors use NCCL, so they never touch a GPU.

Timeout: every collective gives up after `collective_timeout` seconds (TrainerSettings,
`--collective-timeout`, default 600) instead of hanging forever, and the process exits
non-zero; torchrun then stops the other ranks. Since the leader sends a heartbeat at least
every `heartbeat_seconds(timeout)` while it waits for a batch, evaluates or writes, only a
rank that is truly stuck (a peer hung, not dead: a dead peer breaks its connections and the
collective fails at once) hits the timeout.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Literal, Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from asyncrl.algorithms.packing import balance_shares
from asyncrl.platform.devices import distributed_backend
from asyncrl.trainer.step import TrainSample

log = logging.getLogger(__name__)


def heartbeat_seconds(collective_timeout: float) -> float:
    """How often the leader tells waiting followers it is alive."""
    return max(0.5, min(10.0, collective_timeout / 4))


def under_torchrun() -> bool:
    """Whether this process is one of torchrun's (its environment names a process group)."""
    return "WORLD_SIZE" in os.environ


@dataclass(frozen=True)
class Command:
    """What every rank does next, in the same order on every rank."""

    kind: Literal["restore", "step", "state", "checkpoint", "wait", "stop"]
    samples: Sequence[TrainSample] = ()  # step: this rank's share
    version: int | None = None  # step: the policy version of the weights held now
    step: int | None = None  # step: its index in the job (0 first), for the learning rate
    path: str | None = None  # restore: the checkpoint every rank loads (None: start fresh)


@dataclass
class TrainerGroup:
    """This process's place among the trainer's processes; a group of one outside torchrun."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    _control: object = field(default=None, repr=False)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_environment(cls, device: torch.device, collective_timeout: float) -> TrainerGroup:
        """Joins torchrun's process group (env://: RANK, WORLD_SIZE, MASTER_ADDR/PORT) when
        this process runs under torchrun; otherwise a group of one. Collectives, and joining
        itself, give up after `collective_timeout` seconds."""
        if not under_torchrun():
            return cls()
        backend = distributed_backend(device)
        timeout = timedelta(seconds=collective_timeout)
        store, rank, world_size = next(dist.rendezvous("env://", timeout=timeout))
        # torchrun keeps one store across the restarts of its workers: without a prefix per
        # attempt, a restarted rank can read its peers' addresses from the attempt before
        # (gloo then fails "connection refused", or the start-up barrier hangs).
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        dist.init_process_group(backend, store=dist.PrefixStore(f"asyncrl/attempt-{attempt}",
                                                                store),
                                rank=rank, world_size=world_size, timeout=timeout)
        # Commands are pickled Python objects: a gloo group of their own keeps them off the
        # GPU (and apart from the tensors' collectives) whatever the backend.
        control = dist.new_group(backend="gloo", timeout=timeout)
        group = cls(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)),
                    control)
        log.info("trainer rank %d of %d (local rank %d), %s, collective timeout %.0fs",
                 group.rank, group.world_size, group.local_rank, backend, collective_timeout)
        return group

    def send(self, commands: Command | Sequence[Command]) -> Command:
        """Leader: gives rank i commands[i] (or the one command to all); returns its own."""
        if not self.leader:
            raise RuntimeError("only rank 0 sends commands")
        if isinstance(commands, Command):
            commands = [commands] * self.world_size
        if len(commands) != self.world_size:
            raise ValueError(f"{len(commands)} commands for {self.world_size} ranks")
        if self.distributed:
            mine = [None]
            dist.scatter_object_list(mine, list(commands), src=0, group=self._control)
        return commands[0]

    def receive(self) -> Command:
        """Follower: the leader's next command for this rank."""
        mine = [None]
        dist.scatter_object_list(mine, None, src=0, group=self._control)
        return mine[0]

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def split_by_tokens(samples: Sequence[TrainSample], ranks: int) -> list[list[TrainSample]]:
    """The batch's samples in `ranks` shares with token counts as even as the longest-first
    greedy of the micro-batch packer makes them; a share may be empty."""
    shares = balance_shares([s.input_ids.numel() for s in samples], ranks)
    return [[samples[i] for i in share] for share in shares]


def shares_per_rank(samples: Sequence[TrainSample], world_size: int,
                    tensor_parallel: int = 1) -> list[list[TrainSample]]:
    """Each rank's share of a batch: split by tokens over the data-parallel ranks, each share
    given to all the tensor-parallel peers of one (consecutive ranks, as Megatron-Core orders
    them), which compute on the same samples."""
    shares = split_by_tokens(samples, world_size // tensor_parallel)
    return [shares[rank // tensor_parallel] for rank in range(world_size)]


# --------------------------------------------------------------------------- sharding


def shard_model(model: torch.nn.Module, device: torch.device, world_size: int) -> None:
    """FSDP2 over all ranks: each transformer block (the model's `_no_split_modules`) is one
    unit, the rest is the root's. FSDP averages gradients across ranks; PolicyUpdater scales
    its loss by the world size to make that the sum it needs (a divide factor of 1 would be
    NCCL's PreMulSum, which gloo lacks)."""
    mesh = init_device_mesh(device.type, (world_size,))
    blocks = set(getattr(model, "_no_split_modules", None) or ())
    for module in list(model.modules()):
        if type(module).__name__ in blocks:
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)


_FULL_ON_RANK_0 = StateDictOptions(full_state_dict=True, cpu_offload=True)


def full_model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's Hugging Face state dict, on the CPU, on rank 0 (an empty dict
    elsewhere under FSDP). A collective when the model is split: every rank calls it. A model
    of another backend (the Megatron-Core one) gives it through its `hf_state_dict`."""
    if hasattr(model, "hf_state_dict"):
        return model.hf_state_dict()
    return get_model_state_dict(model, options=_FULL_ON_RANK_0)


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer state keyed by the HF parameter name, whole, on rank 0 (see
    full_model_state; the Megatron-Core model gives the same form)."""
    if hasattr(model, "hf_optimizer_state"):
        return model.hf_optimizer_state(optimizer)
    return get_optimizer_state_dict(model, optimizer, options=_FULL_ON_RANK_0)


def load_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    model_state: dict | None, optimizer_state: dict) -> None:
    """Loads whole state dicts (as full_model_state/full_optimizer_state give them, or
    read from a checkpoint) into a model that may be sharded; every rank calls it.
    `model_state` None: the weights are loaded already (a LoRA adapter, by peft)."""
    if hasattr(model, "load_hf_state_dict"):  # the Megatron-Core model
        model.load_hf_state_dict(model_state)
        model.load_hf_optimizer_state(optimizer, optimizer_state)
        return
    if model_state is not None:
        set_model_state_dict(model, model_state, options=StateDictOptions(full_state_dict=True))
    if optimizer_state["state"] and isinstance(next(iter(optimizer_state["state"])), int):
        # Written by optimizer.state_dict() (parameter indices), before checkpoints used names.
        optimizer.load_state_dict(optimizer_state)
        return
    set_optimizer_state_dict(model, optimizer, optimizer_state,
                             options=StateDictOptions(full_state_dict=True))
