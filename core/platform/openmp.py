"""Keeping one OpenMP thread team per process on a CPU.

torch's CPU kernels run their parallel regions on GNU OpenMP (libgomp), which keeps a pool of
worker threads for every thread that has started a parallel region. Once the pools hold more
threads than there are CPUs, libgomp stops letting idle workers spin and puts them to sleep
after each region, so every small kernel pays a wake-up: measured on 2 cores, a 16 x 576 x
1536 linear layer took 290 us in a thread after the main thread had run one parallel
operation, against 185 us in a process where only that thread ever had. A decode step is
hundreds of such kernels.

libgomp lets a thread release only its own pool. So the thread that loaded a model calls
`release_idle_thread_pools()` when it hands the model to the thread that will do the hot
tensor work (the rollout engine's `start()` does), and leaves tensor work to that thread.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1  # omp_pause_soft: threads go, the runtime stays initialised


@cache
def _libgomp() -> ctypes.CDLL | None:
    """The libgomp that torch's wheel ships and loaded, if this torch uses one."""
    library = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    if not library.is_file():
        return None
    try:
        return ctypes.CDLL(str(library))
    except OSError:
        return None


def release_idle_thread_pools() -> bool:
    """Ends the calling thread's idle OpenMP worker threads (OpenMP 5.0's
    `omp_pause_resource_all(omp_pause_soft)`; its next parallel region would start a fresh
    pool). Returns whether they were released (False where torch does not use libgomp,
    e.g. macOS)."""
    library = _libgomp()
    if library is None or not hasattr(library, "omp_pause_resource_all"):
        return False
    released = library.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0
    if not released:
        log.debug("omp_pause_resource_all refused; OpenMP pools stay as they are")
    return released
