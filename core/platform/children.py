"""Child processes that do not outlive the process that started them.

On Linux a child can ask the kernel for a signal when its parent dies (prctl
PR_SET_PDEATHSIG), so even a parent killed with kill -9, which runs no clean-up of its own,
leaves no service or redis-server running on its own, holding its port. Elsewhere only an
orderly stop ends the children.

The request is made in the child between fork and exec (Popen's `preexec_fn`), which makes
Popen really fork: a parent that imported grpc must set GRPC_ENABLE_FORK_SUPPORT=false
first, or gRPC's fork handler can wait forever on one of the parent's threads
(grpc/grpc#37259); importing asyncrl sets it. The signal comes when the *thread* that
started the child ends, so start such children from the main thread.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from typing import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` for Popen: the child gets `sig` when this process dies. None where the
    OS has no such request (Popen then forks as it would without one)."""
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)  # loaded here: the child only calls it
    parent = os.getpid()

    def request() -> None:
        libc.prctl(PR_SET_PDEATHSIG, sig)
        # The parent died between fork and prctl: the signal will never come, so end now.
        if os.getppid() != parent:
            os._exit(1)

    return request
