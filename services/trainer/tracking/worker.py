"""One tracker on its own thread, so that training never waits for it: calls are queued
(bounded: when the tracker cannot keep up, the newest entries are dropped and counted), each
is tried `attempts` times with a growing pause, and a run that failed to open is opened again
before the next entry. Every failed call is logged and counted through `on_error`. Once the
trainer stops, a tracker that never opened gets no more tries, so a dead one cannot hold up
the trainer's exit."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

log = logging.getLogger(__name__)

_STOP = object()


class TrackerThread:
    def __init__(self, tracker, on_error: Callable[[str], None], *, attempts: int = 3,
                 pause: float = 1.0, capacity: int = 10_000):
        self.tracker, self.on_error = tracker, on_error
        self.attempts, self.pause = attempts, pause
        self.opened = False
        self._queue: queue.Queue = queue.Queue(capacity)
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"tracking-{tracker.name}")
        self._stopping = threading.Event()
        self._config: dict = {}
        self._resumed_step = 0

    def start(self, config: dict, resumed_step: int) -> None:
        self._config, self._resumed_step = config, resumed_step
        self._thread.start()

    def log(self, step: int, values: dict[str, float]) -> None:
        try:
            self._queue.put_nowait((step, values))
        except queue.Full:
            self._failed("log", f"queue full ({self._queue.maxsize} entries): step {step} dropped")

    def stop(self) -> None:
        self._stopping.set()
        try:
            self._queue.put_nowait(_STOP)
        except queue.Full:  # the thread is stuck on a tracker: it is a daemon, let it be
            pass

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("tracking: %s did not finish within %.0f s; what is left is not sent",
                        self.tracker.name, timeout)

    def _run(self) -> None:
        while True:
            entry = self._queue.get()
            if entry is _STOP:
                break
            if self._stopping.is_set() and not self.opened:
                continue  # it had its tries; the trainer is leaving
            if self._open():
                step, values = entry
                self._try("log", self.tracker.log, step, values)
        if self.opened:
            self._try("close", self.tracker.close)

    def _open(self) -> bool:
        if not self.opened:
            self.opened = self._try("open", self.tracker.open, self._config,
                                    self._resumed_step)
        return self.opened

    def _try(self, what: str, call, *args) -> bool:
        for attempt in range(self.attempts):
            try:
                call(*args)
                return True
            except Exception as exc:  # noqa: BLE001 - any failure of a tracker is its own
                self._failed(what, f"{type(exc).__name__}: {exc}"[:500])
                if attempt + 1 < self.attempts and not self._stopping.is_set():
                    self._stopping.wait(self.pause * 2 ** attempt)
        return False

    def _failed(self, what: str, why: str) -> None:
        log.warning("tracking: %s %s failed (training goes on): %s", self.tracker.name, what,
                    why)
        self.on_error(self.tracker.name)
