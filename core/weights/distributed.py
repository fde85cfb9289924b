"""Weights sent from the trainer to the rollout engines over torch.distributed
(`trainer.weightTransfer: distributed`), the way SGLang takes them: `/init_weights_update_group`
once, then `/update_weights_from_distributed` per version.

One group per job. The trainer's leader is rank 0: it hosts the rendezvous store (a TCPStore
on its `weights` port) and broadcasts; each rollout engine claims the next free rank(s) from a
counter in that store (an SGLang server with tensor parallelism takes one rank per GPU) and
joins. The world size is fixed by the job (`world_size`), so the group forms once every engine
has joined.

Per version the trainer announces the version with a `torch-distributed://` URI (instead of a
snapshot path) and broadcasts every tensor of the manifest, one broadcast each, in manifest
order; each engine receives them straight into its weights. The manifest is the snapshot's
layout (tied weights once, under their first name) in the job's dtype, sorted by name, so the
trainer, the torch engine (from its model) and an SGLang worker (from the model directory's
safetensors header) derive the same list without exchanging it.

A group can neither lose nor gain a member, so it has generations. The trainer names each
one (`asyncrl-weights-<id>`) and its world size in its store, with a rank counter of its
own; every engine checks the store's generation every few seconds and joins a new one
(`TransferMember`). The trainer forms the next generation when a broadcast fails (an engine
is gone), when one does not form in time, and when an engine asked for a rank the current
one does not have (a restarted worker, or one added by scaling the rollout up: the world
size is read again from the job). A restarted trainer hosts a new store, whose generation
the engines find. Until a generation has formed, versions go to disk.
"""

from __future__ import annotations

import datetime
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, TypeVar
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from asyncrl.model.lora import adapter_shapes
from asyncrl.model.policy import tied_aliases
from asyncrl.launch.sglang import tensor_parallel_size

T = TypeVar("T")

#: The URI scheme of a version announced for the distributed transfer.
SCHEME = "torch-distributed"
#: The store key naming the group's current generation, and the prefix of each
#: generation's rank counter.
GENERATION_KEY = "asyncrl/weight-transfer/generation"
_RANK_COUNTER = "asyncrl/weight-transfer/ranks/"
#: The group name's stem; each generation's name adds its id.
GROUP_STEM = "asyncrl-weights"
#: How long a member waits for the others to join the group.
JOIN_TIMEOUT_SECONDS = 600.0
#: How long one broadcast waits for a member: a member gone without closing its connections
#: (a pod deleted with --force) fails the broadcast after this, not after the join timeout.
BROADCAST_TIMEOUT_SECONDS = 120.0
#: How long an engine's check of the trainer's store may take before the trainer counts as
#: gone (its connection is then opened again, to whichever trainer answers).
CHECK_TIMEOUT_SECONDS = 10.0
#: Bytes of weights per /update_weights_from_distributed request to an SGLang server.
DEFAULT_BUCKET_BYTES = 512 << 20


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def bytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


@dataclass(frozen=True)
class GroupAddress:
    """What `/init_weights_update_group` takes, less the rank."""

    master_address: str
    master_port: int
    world_size: int
    group_name: str = GROUP_STEM
    backend: str = "gloo"


def announcement_uri(group_name: str) -> str:
    return f"{SCHEME}://{group_name}"


def is_distributed_uri(uri: str) -> bool:
    return urlparse(uri).scheme == SCHEME


def announced_group(uri: str) -> str:
    """The group (generation) a `torch-distributed://` announcement was broadcast to."""
    return urlparse(uri).netloc


def new_generation() -> str:
    """A group name no earlier generation had, of this trainer or of one before it."""
    return f"{GROUP_STEM}-{uuid.uuid4().hex[:12]}"


def publish_generation(store: dist.Store, group_name: str, world_size: int) -> None:
    store.set(GENERATION_KEY, f"{group_name} {world_size}")


def current_generation(store: dist.Store) -> tuple[str, int]:
    """The generation the trainer is forming or has formed, and its world size (waits for
    the trainer to name one, within the store's timeout)."""
    name, world = store.get(GENERATION_KEY).decode().split()
    return name, int(world)


def ranks_asked(store: dist.Store, group_name: str) -> int:
    """Engine ranks claimed in generation `group_name`, those refused included."""
    return store.add(_RANK_COUNTER + group_name, 0)


def wait_for_claims(store: dist.Store, group_name: str, world: int, timeout: float,
                    still_wanted: Callable[[], bool] = lambda: True) -> None:
    """Blocks until every engine rank of generation `group_name` is claimed: then every
    member is there, and the group forms within the broadcast timeout. Raises RuntimeError
    after `timeout` seconds, or once `still_wanted()` says no (the trainer moved on to
    another generation); not TimeoutError, which a caller waiting on the future this runs
    in would read as its own wait running out."""
    deadline = time.monotonic() + timeout
    while (asked := ranks_asked(store, group_name)) < world - 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{group_name}: {asked} of {world - 1} engine ranks claimed "
                               f"within {timeout:.0f} s")
        if not still_wanted():
            raise RuntimeError(f"{group_name} is over: the trainer formed another generation")
        time.sleep(0.2)


def engine_ranks(engine: str, gpus: int) -> int:
    """Ranks one rollout replica takes: SGLang one per tensor-parallel GPU, the torch engine one."""
    return tensor_parallel_size(gpus) if engine == "sglang" else 1


def world_size(spec) -> int:
    """The trainer's leader plus every rollout engine's ranks (an RLJobSpec)."""
    rollout = spec.rollout
    return 1 + rollout.replicas * engine_ranks(rollout.engine, rollout.placement.gpus)


def backend(spec) -> str:
    """NCCL when both the trainer's and the rollout engines' pods have GPUs, else gloo."""
    both_gpus = spec.trainer.placement.gpus and spec.rollout.placement.gpus
    return "nccl" if both_gpus else "gloo"


def manifest(shapes: Mapping[str, Iterable[int]], dtype: torch.dtype) -> list[TensorMeta]:
    """The tensors of one transfer, in the order they are sent: sorted by name."""
    return [TensorMeta(name, dtype, tuple(shapes[name])) for name in sorted(shapes)]


def model_manifest(model: torch.nn.Module, dtype: torch.dtype) -> list[TensorMeta]:
    """The manifest of a model's snapshot: every tensor of its state dict, tied weights once."""
    aliases = tied_aliases(model)
    return manifest({name: tensor.shape for name, tensor in model.state_dict().items()
                     if name not in aliases}, dtype)


#: The dtype of a LoRA version's tensors on every path: the adapter is small, and its float32
#: values are what the trainer holds (the engine merges in float32 too).
ADAPTER_DTYPE = torch.float32


def version_manifest(model: torch.nn.Module, model_spec) -> list[TensorMeta]:
    """What one policy version carries for the job's `spec.model`: the adapter's tensors with
    model.lora (asyncrl.model.lora), else the whole model's in model.dtype. `model` is the
    base model (its config and names), on either side."""
    if model_spec.lora is not None:
        return manifest(adapter_shapes(model.config, model_spec.lora), ADAPTER_DTYPE)
    return model_manifest(model, getattr(torch, model_spec.dtype))


def directory_manifest(directory: Path, dtype: torch.dtype) -> list[TensorMeta]:
    """The manifest of a Hugging Face model directory, read from its safetensors headers."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for file in sorted(Path(directory).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                shapes[name] = handle.get_slice(name).get_shape()
    if not shapes:
        raise FileNotFoundError(f"{directory}: no *.safetensors to read the weight layout from")
    return manifest(shapes, dtype)


def buckets(tensors: list[TensorMeta], bucket_bytes: int = DEFAULT_BUCKET_BYTES,
            ) -> list[list[TensorMeta]]:
    """Consecutive runs of the manifest of at most `bucket_bytes` each (a larger tensor alone)."""
    out: list[list[TensorMeta]] = []
    size = 0
    for meta in tensors:
        if not out or size + meta.bytes > bucket_bytes:
            out.append([])
            size = 0
        out[-1].append(meta)
        size += meta.bytes
    return out


def host_store(port: int, timeout: float) -> dist.TCPStore:
    """The rendezvous store, on the trainer's leader (listening on every interface)."""
    return dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout))


def connect_store(address: str, port: int, timeout: float) -> dist.TCPStore:
    return dist.TCPStore(address, port, is_master=False,
                         timeout=datetime.timedelta(seconds=timeout))


def claim_ranks(store: dist.Store, count: int, world: int, group_name: str) -> int:
    """The first of `count` consecutive ranks of generation `group_name` no one else holds
    (rank 0 is the trainer's)."""
    last = store.add(_RANK_COUNTER + group_name, count)
    if last > world - 1:
        raise RuntimeError(
            f"weight transfer: ranks {last - count + 1}..{last} of {group_name} claimed but "
            f"it has {world - 1} engine ranks, all taken (this worker restarted, or the "
            "rollout was scaled up): it joins the next generation, which the trainer forms "
            "for it")
    return last - count + 1


def join(address: GroupAddress, rank: int, timeout: float,
         store: dist.Store | None = None) -> dist.ProcessGroup:
    """This process's member of the transfer group, apart from any default process group
    (a trainer under torchrun keeps its own). Blocks until every rank has joined."""
    if store is None:  # its timeout bounds the wait for the other members
        store = connect_store(address.master_address, address.master_port, timeout)
    # The key layout an SGLang server's ranks use (its init_custom_process_group prefixes the
    # group name, then torch's _new_process_group_helper "<group>/" and "<device>/"), so
    # that they and ours meet in one store.
    device = "cuda" if address.backend == "nccl" else "cpu"
    for prefix in (address.group_name, f"{address.group_name}/", f"{device}/"):
        store = dist.PrefixStore(prefix, store)
    delta = datetime.timedelta(seconds=min(timeout, BROADCAST_TIMEOUT_SECONDS))
    if address.backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, address.world_size, delta)
    if address.backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = delta
        return dist.ProcessGroupNCCL(store, rank, address.world_size, options)
    raise ValueError(f"weight transfer backend {address.backend!r}: use gloo or nccl")


def in_background(work: Callable[..., T], *args) -> Future[T]:
    """`work(*args)` in a daemon thread: joining blocks until every member is there (up to
    JOIN_TIMEOUT_SECONDS), and a process that stops meanwhile must not wait for it."""
    future: Future[T] = Future()

    def run() -> None:
        try:
            future.set_result(work(*args))
        except BaseException as exc:  # handed to whoever waits on the future
            future.set_exception(exc)

    threading.Thread(target=run, name="weight-transfer-join", daemon=True).start()
    return future


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Rank 0's `tensor` into every member's `tensor` (same shape and dtype), in place."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()
