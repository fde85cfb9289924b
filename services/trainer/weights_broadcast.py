"""The trainer's end of the distributed weight transfer (asyncrl.weights.distributed): rank 0 of
the group, on the leader. A generation of the group forms in the background while the trainer
starts and trains; a version is broadcast only once every engine has joined it. When a
generation does not form in time, a broadcast fails (a member is gone) or an engine asks for
a rank it does not have (restarted, or added), the next generation is named, with the world
size as the job says now, and forms the same way; meanwhile versions go to disk."""

from __future__ import annotations

import logging
import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Callable

import torch

from asyncrl.weights.distributed import (
    JOIN_TIMEOUT_SECONDS,
    GroupAddress,
    TensorMeta,
    broadcast,
    host_store,
    in_background,
    join,
    new_generation,
    publish_generation,
    ranks_asked,
    wait_for_claims,
)

log = logging.getLogger(__name__)


class WeightBroadcaster:
    """`world_size`: the group's size, or a function that tells it as the job says now (read
    again for each generation)."""

    def __init__(self, port: int, world_size: int | Callable[[], int], backend: str,
                 tensors: list[TensorMeta], *, timeout: float = JOIN_TIMEOUT_SECONDS):
        self.tensors = tensors
        self.generations = 0
        self._world_size = world_size if callable(world_size) else lambda: world_size
        self._port, self._backend = port, backend
        self._timeout = timeout
        self._store = host_store(port, timeout)  # now, so engines can claim ranks at once
        self._form()

    def _form(self) -> None:
        """Names the next generation in the store and joins it as rank 0, in the background."""
        self.address = GroupAddress("0.0.0.0", self._port, self._world_size(),
                                    group_name=new_generation(), backend=self._backend)
        publish_generation(self._store, self.address.group_name, self.address.world_size)
        self.generations += 1
        self.broken = False
        self._forming = in_background(self._join, self.address)

    def _join(self, address: GroupAddress):
        """Rank 0 of generation `address`, once every engine rank is claimed."""
        wait_for_claims(self._store, address.group_name, address.world_size, self._timeout)
        return join(address, 0, self._timeout, self._store)

    def ready(self, wait: float = 0.0) -> bool:
        """True when every engine has joined the current generation (waiting up to `wait`
        seconds for that). A generation that failed to form, broke in a broadcast or left an
        engine outside is replaced by the next one here, and this version goes to disk."""
        if self.broken:
            self._form()
            return False
        try:
            self._forming.result(timeout=wait)
        except FutureTimeout:
            return False
        except Exception as exc:
            log.warning("weight transfer group %s did not form (%s): versions go to disk "
                        "while the next generation forms", self.address.group_name, exc)
            self._form()
            return False
        # Only a formed generation is left for an engine outside it: the members of one
        # still forming are waiting in it for the others.
        if ranks_asked(self._store, self.address.group_name) > self.address.world_size - 1:
            log.info("an engine asked for a rank %s does not have (restarted, or the rollout "
                     "was scaled): forming the next generation", self.address.group_name)
            self._form()
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
