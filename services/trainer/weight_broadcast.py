"""The trainer's end of the distributed weight transfer (asyncrl.weight_transfer): rank 0 of
the group, on the leader. The group forms in the background while the trainer starts and
trains; a version is broadcast only once every engine has joined, and never again after a
broadcast failed (a member is gone and cannot come back): those versions go to disk."""

from __future__ import annotations

import logging
import time
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from asyncrl.weight_transfer import (
    JOIN_TIMEOUT_SECONDS,
    GroupAddress,
    TensorMeta,
    broadcast,
    host_store,
    in_background,
    join,
)

log = logging.getLogger(__name__)


class WeightBroadcaster:
    def __init__(self, port: int, world_size: int, backend: str, tensors: list[TensorMeta],
                 *, timeout: float = JOIN_TIMEOUT_SECONDS):
        self.address = GroupAddress("0.0.0.0", port, world_size, backend=backend)
        self.tensors = tensors
        self.broken = False
        self._store = host_store(port, timeout)  # now, so engines can claim ranks at once
        self._forming = in_background(join, self.address, 0, timeout, self._store)

    def ready(self, wait: float = 0.0) -> bool:
        """True when every engine has joined (waiting up to `wait` seconds for that) and no
        broadcast has failed."""
        if self.broken:
            return False
        try:
            self._forming.result(timeout=wait)
        except FutureTimeout:
            return False
        except Exception as exc:
            log.warning("weight transfer group did not form (%s): versions go to disk", exc)
            self.broken = True
            return False
        return True

    def send(self, state: dict[str, torch.Tensor]) -> float:
        """Broadcasts every tensor of the manifest from `state` (the whole model, any dtype,
        cast to the manifest's); returns the seconds it took. Call only when `ready()`."""
        group = self._forming.result()
        device = "cuda" if self.address.backend == "nccl" else "cpu"
        started = time.perf_counter()
        # Cast everything first: casts between broadcasts would each wake torch's OpenMP
        # workers from sleep (three times slower in bf16 on a CPU, measured).
        outgoing = [state[meta.name].detach().to(device=device, dtype=meta.dtype).contiguous()
                    for meta in self.tensors]
        try:
            for tensor in outgoing:
                broadcast(group, tensor)
        except Exception:
            self.broken = True
            raise
        return time.perf_counter() - started
