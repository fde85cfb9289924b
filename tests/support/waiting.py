"""Waiting in tests: poll a predicate until it holds, with a deadline that only catches a hang.

Callers whose wait needs more build on `wait_for`: `wait_for_status` waits for a service
process to answer over HTTP and fails at once if it exits; support.operator_cluster's wait also
fails when the operator process exits, and shows its log; support.real_pods' polls a real
cluster once a second."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float = 10.0, what: str = "condition",
             describe: Callable[[], str] | None = None, *, every: float = 0.005) -> T:
    """Poll `predicate` every `every` seconds until it returns something truthy, and return that.

    `predicate` runs at least once. After `timeout` (a generous deadline, for hangs only) fail
    with an AssertionError naming `what` and the last value seen, followed by `describe()` if
    given (state that tells the reader why). The default pace suits in-process state, which
    is cheap to look at and may pass quickly (a few tokens into a generation)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            detail = describe() if describe is not None else ""
            raise AssertionError(f"timed out after {timeout}s waiting for {what} "
                                 f"(last: {value!r})" + (f"\n{detail}" if detail else ""))
        time.sleep(every)


def wait_for_status(process: subprocess.Popen, log: Path, url: str, status: int,
                    timeout: float = 120) -> None:
    """Until GET `url` answers `status`, the process running all along: if it exits, fail at
    once with the tail of its `log`."""

    def answers() -> bool:
        assert process.poll() is None, log.read_text()[-3000:]
        try:
            return httpx.get(url, timeout=2).status_code == status
        except httpx.TransportError:
            return False

    wait_for(answers, timeout, f"{url} to answer {status}", every=0.2)
