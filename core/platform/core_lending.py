"""Cores lent between the two computing processes of a job on one machine.

`asyncrl run` splits a machine's cores between the trainer and its rollout worker, and each
waits for the other in turn: the trainer for a batch (early in a run, when most groups are
skipped and generation is slow), the rollout worker for the next policy version (once the
trainer is the slower one), and the rollout worker during the trainer's evaluations. While one
waits, its cores would idle. With lending, a process that waits lends its threads and the
other computes with its own and the lent ones, until the owner takes them back.

The state is one byte per process in a small file both map: the threads that process lends
now (0 while it computes). Each process reads the other's byte before each pass (a trainer
layer's forward or backward, an engine step) and sets its torch thread count to its own plus
the lent ones (never more than the machine's cores), so a core taken back is returned within
one pass.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import torch

#: The processes that lend to each other, by their byte in the file.
SLOTS = ("trainer", "rollout")
#: The most threads a byte holds.
MOST_THREADS = 255


def threads_adjustable() -> bool:
    """Whether this torch takes a new thread count once it has computed in parallel: with
    OpenMP (PyPI's Linux builds) it does; its native thread pool only warns."""
    return "parallel backend: OpenMP" in torch.__config__.parallel_info()


def create_lending_file(path: Path) -> Path:
    """A file for two processes to lend through, neither lending yet."""
    path.write_bytes(bytes(len(SLOTS)))
    return path


class CoreLending:
    """One process's side: `slot` is its name in SLOTS, `threads` the torch threads it owns.
    `fit` is called on the thread that computes (torch's thread count is that thread's)."""

    def __init__(self, path: Path, slot: str, threads: int):
        if slot not in SLOTS:
            raise ValueError(f"core lending slot must be one of {SLOTS}, got {slot!r}")
        if not 1 <= threads <= MOST_THREADS:
            raise ValueError(f"core lending: threads must be 1 to {MOST_THREADS}, got {threads}")
        self.threads = threads
        self._own = SLOTS.index(slot)
        self._other = 1 - self._own
        self._cores = _usable_cores()
        with open(path, "r+b") as file:
            self._shared = mmap.mmap(file.fileno(), len(SLOTS))
        self._shared[self._own] = 0  # computing until it says otherwise
        self._current = 0  # set by the first fit, on the compute thread

    @property
    def current(self) -> int:
        """The threads this process computes with now."""
        return self._current

    def lend(self) -> None:
        """This process waits: the other may compute with its threads."""
        self._shared[self._own] = self.threads

    def reclaim(self) -> None:
        """This process computes again: the other gives its threads back at its next fit
        (any thread may call this; the next fit here takes what the other lends now)."""
        self._shared[self._own] = 0

    def fit(self) -> None:
        """Computes from now on with this process's threads and those the other lends now."""
        wanted = max(self.threads, min(self.threads + self._shared[self._other], self._cores))
        if wanted != self._current:
            torch.set_num_threads(wanted)
            self._current = wanted

    def close(self) -> None:
        """Lends nothing any more (the process is done) and unmaps the file."""
        self._shared[self._own] = 0
        self._shared.close()


def _usable_cores() -> int:
    """The cores this process may run on (Linux: its affinity; elsewhere every core)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def lending_from(path: str | os.PathLike | None, slot: str, threads: int | None
                 ) -> CoreLending | None:
    """The process's side of the lending file its settings name, or None without one."""
    if path is None:
        return None
    if threads is None:
        raise ValueError("core lending needs the process's own thread count (--threads)")
    return CoreLending(Path(path), slot, threads)
