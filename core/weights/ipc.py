"""Weights shared in memory between a trainer and a rollout engine on the same device
(`trainer.weightTransfer: ipc`): on one GPU, or both on the CPU of one machine. No copy
through disk, no NCCL group (which refuses two ranks on one device); on the CPU a version
costs a copy into shared memory (about 0.1 s for SmolLM2-135M) where a snapshot on disk
costs a second or more and half a gigabyte written per step.

The trainer keeps one flat buffer on its device, in the engine's dtype, holding every tensor
of the snapshot layout (tied weights once, sorted by name: `asyncrl.weights.distributed`'s
manifest) as a view at its offset. On the CPU the buffer is a file in shared memory
(/dev/shm), mapped by both processes; a file of its own per trainer process, whose restarted
successor removes it. It writes the buffer once, at start, as a manifest file:

    <directory>/manifest.json   each tensor's name, shape, dtype and offset; the buffer's
                                handle (on a GPU torch's own sharing: `reduce_tensor`, i.e.
                                `storage._share_cuda_()`; on the CPU the file's path); the
                                device ("cpu" or the GPU's UUID)
    <directory>/lock            the buffer's lock; its text is the version the buffer holds

Per version the trainer copies the weights into the buffer and announces
`torch-ipc://<manifest path>` the way every version is announced. An engine opens the
handle once (cached per handle: a restarted trainer's new buffer has another) and copies
the tensors device to device into its own weights.

Who may touch the buffer when is an flock on `lock`: the trainer writes under the exclusive
lock, an engine copies under a shared one (until its copy has finished on the GPU). This is
the simplest correct choice here: a double buffer still needs to know that an engine has
finished with the older half, and an acknowledgement needs a channel back and a timeout for
an engine that died mid-copy; a lock the kernel drops when its holder dies needs neither. The
trainer waits at most for one device-to-device copy (milliseconds), and each engine copies
once per version. The lock also carries the version the buffer holds, which an engine
checks: if the trainer has already written the next version, the engine takes that one when
it is announced, a moment later, rather than label it with the older number.

Both processes must be on one machine, and an engine must compute on the buffer's device:
`asyncrl.weights.paths` says which path a job takes and why, and `IpcReader` refuses a
buffer on another device, naming it.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import io
import json
import os
import pickle
import shutil
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Callable, Iterator, TypeVar
from urllib.parse import urlparse

import torch
from torch import Tensor

from asyncrl.weights.distributed import TensorMeta

T = TypeVar("T")

#: The URI scheme of a version announced for the ipc transfer; its path is the manifest's.
SCHEME = "torch-ipc"
MANIFEST_FILE = "manifest.json"
LOCK_FILE = "lock"
#: Where a CPU buffer is a file (shared memory on Linux).
SHM_DIRECTORY = Path("/dev/shm")


class NotThisVersion(Exception):
    """The buffer does not hold the announced version (the trainer has written the next one,
    or a restarted trainer none yet): the next announcement brings it."""


class IpcUnavailable(RuntimeError):
    """A buffer this process cannot open (another device, another machine, a trainer gone):
    the message names why and the fix."""


# ------------------------------------------------------------------ announcements


def announcement_uri(manifest: Path) -> str:
    return f"{SCHEME}://{Path(manifest).resolve()}"


def is_ipc_uri(uri: str) -> bool:
    return urlparse(uri).scheme == SCHEME


def manifest_path(uri: str) -> Path:
    return Path(urlparse(uri).path)


# ------------------------------------------------------------------ the manifest


@dataclass(frozen=True)
class IpcTensor:
    name: str
    shape: tuple[int, ...]
    offset: int  # in elements of the buffer

    @property
    def numel(self) -> int:
        return torch.Size(self.shape).numel()


@dataclass(frozen=True)
class IpcManifest:
    """What an engine needs to read the buffer: the tensors' places in it, its dtype, the
    device it lives on and the pickled handle of its storage."""

    tensors: tuple[IpcTensor, ...]
    dtype: torch.dtype
    device: str        # "cpu", or the GPU's UUID: the same physical GPU whatever the numbering
    handle: bytes      # on a GPU ForkingPickler's bytes of the flat buffer (torch's
    #                    reduce_tensor); on the CPU the path of the file it is mapped from

    @classmethod
    def layout(cls, metas: list[TensorMeta]) -> tuple[tuple[IpcTensor, ...], int]:
        """Each tensor's place in a flat buffer, in manifest order, and the buffer's size."""
        places, offset = [], 0
        for meta in metas:
            places.append(IpcTensor(meta.name, tuple(meta.shape), offset))
            offset += torch.Size(meta.shape).numel()
        return tuple(places), offset

    def to_json(self) -> str:
        return json.dumps({
            "dtype": str(self.dtype).removeprefix("torch."), "device": self.device,
            "tensors": [{"name": t.name, "shape": list(t.shape), "offset": t.offset}
                        for t in self.tensors],
            "handle": base64.b64encode(self.handle).decode("ascii"),
        })

    @classmethod
    def from_json(cls, text: str) -> IpcManifest:
        data = json.loads(text)
        dtype = getattr(torch, data["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"ipc manifest: unknown dtype {data['dtype']!r}")
        return cls(tuple(IpcTensor(t["name"], tuple(t["shape"]), int(t["offset"]))
                         for t in data["tensors"]),
                   dtype, data["device"], base64.b64decode(data["handle"]))

    @property
    def numel(self) -> int:
        """The flat buffer's size in elements."""
        return max((t.offset + t.numel for t in self.tensors), default=0)

    def views(self, flat: Tensor) -> dict[str, Tensor]:
        """Each named tensor as a view of the flat buffer."""
        return {t.name: flat[t.offset:t.offset + t.numel].view(t.shape) for t in self.tensors}


def device_identity(device: torch.device) -> str:
    """"cpu", or the UUID of a GPU: what two processes compare to know they share it (their
    cuda:<n> may name different GPUs, each under its own CUDA_VISIBLE_DEVICES)."""
    if device.type != "cuda":
        return "cpu"
    return f"GPU-{torch.cuda.get_device_properties(device).uuid}"


class _HandleUnpickler(pickle.Unpickler):
    """Only what torch's tensor sharing pickles: its rebuild functions, tensor and storage
    classes, dtypes, sizes and devices."""

    def find_class(self, module: str, name: str):
        found = super().find_class(module, name)
        allowed = (
            (module == "torch.multiprocessing.reductions" and name.startswith("rebuild_"))
            or (module in ("torch", "torch.storage") and (
                name in ("Tensor", "Size", "device", "UntypedStorage", "TypedStorage")
                or isinstance(found, torch.dtype)))
        )
        if not allowed:
            raise pickle.UnpicklingError(f"ipc manifest: {module}.{name} is not part of a "
                                         "shared tensor's handle")
        return found


def share(flat: Tensor) -> bytes:
    """The handle of `flat`'s storage on a GPU, as torch.multiprocessing sends a tensor (a
    CUDA IPC handle)."""
    return bytes(ForkingPickler.dumps(flat))


def memory_file_stem(directory: Path) -> str:
    """What the name of every CPU buffer file of the buffer directory `directory` starts
    with: one stem per run, so a trainer can find its predecessors' files."""
    digest = hashlib.sha256(str(Path(directory).resolve()).encode()).hexdigest()[:16]
    return f"asyncrl-weights-{digest}"


def remove_memory_files(directory: Path, memory: Path | None = None) -> None:
    """Removes the CPU buffer files of the buffer directory `directory` from `memory` (default
    SHM_DIRECTORY); an engine that still maps one keeps its memory until it lets it go."""
    memory = SHM_DIRECTORY if memory is None else memory
    for path in memory.glob(f"{memory_file_stem(directory)}-*"):
        path.unlink(missing_ok=True)


def release_buffer(directory: Path, memory: Path | None = None) -> None:
    """What a trainer's buffer in `directory` leaves once the trainer has stopped (by itself,
    or told by `asyncrl run` when it was killed): a lock that holds no version, so an engine
    waits for the next announcement rather than open a buffer that is gone, and no CPU file."""
    lock = Path(directory) / LOCK_FILE
    if lock.exists():
        with _locked(lock, fcntl.LOCK_EX) as held:
            held.truncate(0)
    remove_memory_files(directory, memory)


def mapped_buffer(path: Path, numel: int, dtype: torch.dtype, create: bool = False) -> Tensor:
    """A flat tensor of `numel` elements mapped from the file `path`, shared with every
    process that maps it (`create`: the file is made first, at that size)."""
    if create:
        with open(path, "xb") as file:
            file.truncate(numel * dtype.itemsize)
    return torch.from_file(str(path), shared=True, size=numel, dtype=dtype)


def shared_memory_shortfall(nbytes: int, directory: Path | None = None) -> str | None:
    """Why a buffer of `nbytes` on the CPU does not fit this machine's shared memory
    (`directory`, default SHM_DIRECTORY, as SharedWeights takes it; a container's /dev/shm is
    64 MiB unless it is given more), or None where it fits or where there is no such directory
    to ask: writing past it would kill the trainer (SIGBUS)."""
    directory = SHM_DIRECTORY if directory is None else directory
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return None
    if free >= nbytes:
        return None
    return (f"{directory} has {free / 2**20:,.0f} MiB free and a version needs "
            f"{nbytes / 2**20:,.0f} MiB")


def open_handle(handle: bytes) -> Tensor:
    return _HandleUnpickler(io.BytesIO(handle)).load()


# ------------------------------------------------------------------ the lock


@contextlib.contextmanager
def _locked(path: Path, mode: int) -> Iterator[object]:
    with open(path, "a+") as lock:
        fcntl.flock(lock, mode)
        try:
            yield lock
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _finish_copies(device: torch.device) -> None:
    """Waits for this process's copies on `device` (CUDA copies are asynchronous)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------ the trainer's end


class SharedWeights:
    """The trainer's buffer in `directory` (created with its manifest): `write` puts a
    version in it."""

    def __init__(self, directory: Path, metas: list[TensorMeta], dtype: torch.dtype,
                 device: torch.device, memory: Path | None = None):
        """`memory`: where a buffer on the CPU is a file (default SHM_DIRECTORY, shared
        memory; the buffer directory itself where there is no such directory)."""
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        places, size = IpcManifest.layout(metas)
        self.file: Path | None = None
        if device.type == "cpu":
            # A file of its own per trainer, never one an engine may still map: a restarted
            # trainer removes its predecessors' and makes a new one.
            memory = SHM_DIRECTORY if memory is None else memory
            self._memory = memory if memory.is_dir() else self.directory
            remove_memory_files(self.directory, self._memory)
            self.file = self._memory / f"{memory_file_stem(self.directory)}-{os.getpid()}"
            self.flat = mapped_buffer(self.file, size, dtype, create=True)
            handle = str(self.file).encode()
        else:
            self.flat = torch.empty(size, dtype=dtype, device=device)
            handle = share(self.flat)
        self.manifest = IpcManifest(places, dtype, device_identity(self.flat.device), handle)
        self.views = self.manifest.views(self.flat)
        self.lock = self.directory / LOCK_FILE
        # Under the lock, as an engine reads them: a restarted trainer's new manifest and its
        # empty version go together.
        with _locked(self.lock, fcntl.LOCK_EX) as lock:
            lock.truncate(0)  # holds no version yet
            partial = self.directory / f".{MANIFEST_FILE}.partial"
            partial.write_text(self.manifest.to_json())
            partial.replace(self.directory / MANIFEST_FILE)

    @property
    def manifest_path(self) -> Path:
        return self.directory / MANIFEST_FILE

    def close(self) -> None:
        """The buffer holds no version any more, and a CPU buffer's file is removed
        (`asyncrl run` does the same once the trainer is gone, for one that was killed)."""
        release_buffer(self.directory, self._memory if self.file is not None else None)

    def write(self, state: dict[str, Tensor], version: int) -> None:
        """Copies `state` (the whole model's, any dtype and device) into the buffer as
        `version`, once no engine is copying from it; returns when the copy is done."""
        missing = sorted(set(self.views) - set(state))
        if missing:
            raise KeyError(f"ipc weights: the state lacks {missing[:3]}")
        with _locked(self.lock, fcntl.LOCK_EX) as lock:
            with torch.no_grad():
                for name, view in self.views.items():
                    view.copy_(state[name].detach())
            _finish_copies(self.flat.device)
            lock.truncate(0)
            lock.write(str(version))
            lock.flush()


# ------------------------------------------------------------------ an engine's end


class IpcReader:
    """An engine's end: opens a trainer's buffer once per handle, and hands a version's
    tensors to `apply` under the shared lock."""

    def __init__(self, device: torch.device):
        self.device = device
        self._opened: tuple[bytes, dict[str, Tensor]] | None = None

    def tensors(self, manifest: IpcManifest) -> dict[str, Tensor]:
        """The buffer's tensors, opened the first time this handle is seen."""
        mine = device_identity(self.device)
        if manifest.device != mine:
            raise IpcUnavailable(
                f"trainer.weightTransfer ipc: the trainer's weights are on {manifest.device}, "
                f"this engine computes on {mine} ({self.device}); ipc needs both on one device: "
                "run them on the same GPU or both on the CPU (asyncrl run --devices) or set "
                "trainer.weightTransfer: disk")
        if self._opened is None or self._opened[0] != manifest.handle:
            self._opened = None  # the old trainer's buffer goes before the new one opens
            try:
                flat = (mapped_buffer(Path(manifest.handle.decode()), manifest.numel,
                                      manifest.dtype)
                        if manifest.device == "cpu" else open_handle(manifest.handle))
            except (RuntimeError, OSError) as exc:
                raise IpcUnavailable(f"trainer.weightTransfer ipc: cannot open the trainer's "
                                     f"buffer ({exc}); is the trainer on this machine and "
                                     "running?") from exc
            self._opened = (manifest.handle, manifest.views(flat))
        return self._opened[1]

    def read(self, manifest_file: Path, version: int,
             apply: Callable[[dict[str, Tensor]], T]) -> T:
        """`apply(tensors)` of version `version` while the trainer cannot write the buffer,
        until the copies it made on this engine's device are done. Raises NotThisVersion
        when the buffer holds another version."""
        manifest_file = Path(manifest_file)
        with _locked(manifest_file.parent / LOCK_FILE, fcntl.LOCK_SH) as lock:
            lock.seek(0)
            held = lock.read().strip()
            if held != str(version):
                raise NotThisVersion(f"the trainer's buffer holds version {held or 'none'}, "
                                     f"not the announced {version}")
            manifest = IpcManifest.from_json(manifest_file.read_text())
            result = apply(self.tensors(manifest))
            _finish_copies(self.device)
            return result
