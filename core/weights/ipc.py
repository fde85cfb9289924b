"""Weights shared in GPU memory between a trainer and a rollout engine on the same GPU
(`trainer.weightTransfer: ipc`): no copy through disk, no NCCL group (which refuses two
ranks on one device).

The trainer keeps one flat buffer on its GPU, in the engine's dtype, holding every tensor of
the snapshot layout (tied weights once, sorted by name: `asyncrl.weights.distributed`'s
manifest) as a view at its offset. It writes the buffer once, at start, as a manifest file:

    <directory>/manifest.json   each tensor's name, shape, dtype and offset; the buffer's
                                storage handle (torch's own sharing: `reduce_tensor`, i.e.
                                `storage._share_cuda_()` on a GPU); the device (its UUID)
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

Both processes must be on one machine, and an engine must compute on the buffer's GPU:
`asyncrl.weights.paths` says which path a job takes and why, and `IpcReader` refuses a
buffer on another device, naming it.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import io
import json
import pickle
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
    handle: bytes      # ForkingPickler's bytes of the flat buffer (torch's reduce_tensor)

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
    """The handle of `flat`'s storage, as torch.multiprocessing sends a tensor: a CUDA IPC
    handle on a GPU, a shared-memory file name on the CPU (the file_system strategy, the one
    an unrelated process can open; set for this process here)."""
    if flat.device.type == "cpu":
        torch.multiprocessing.set_sharing_strategy("file_system")
        flat.share_memory_()
    return bytes(ForkingPickler.dumps(flat))


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
                 device: torch.device):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        places, size = IpcManifest.layout(metas)
        self.flat = torch.empty(size, dtype=dtype, device=device)
        self.manifest = IpcManifest(places, dtype, device_identity(self.flat.device),
                                    share(self.flat))
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
                f"this engine computes on {mine} ({self.device}); ipc needs both on one GPU: "
                "run them on the same GPU (asyncrl run --devices) or set "
                "trainer.weightTransfer: disk")
        if self._opened is None or self._opened[0] != manifest.handle:
            self._opened = None  # the old trainer's buffer goes before the new one opens
            try:
                flat = open_handle(manifest.handle)
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
