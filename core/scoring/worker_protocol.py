"""The worker side of `asyncrl.scoring.worker_pool`: JSON lines in, JSON lines out, one request
at a time. Standard library only (a worker imports as little as it can before it is ready).

A worker's first line says whether it can work: {"ready": true}, or {"error": "..."} before it
exits. The channel takes the process' stdin and stdout for itself and points descriptors 0 and 1
at /dev/null and stderr, so code the worker runs (a verifier library, a user's reward function)
can neither read the requests nor corrupt the replies by reading or printing.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Callable, Iterator


class Channel:
    def __init__(self):
        self._requests = os.fdopen(os.dup(0), "r", encoding="utf-8")
        self._replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        os.dup2(2, 1)  # sys.stdin and sys.stdout wrap these descriptors: they follow

    def send(self, reply: dict) -> None:
        self._replies.write(json.dumps(reply) + "\n")
        self._replies.flush()

    def requests(self) -> Iterator[dict]:
        for line in self._requests:
            yield json.loads(line)

    def refuse(self, error: str) -> None:
        """Tells the parent this worker cannot start, and why; then exits."""
        self.send({"error": error})
        sys.exit(1)

    def serve(self, answer: Callable[[dict], dict]) -> None:
        """Says ready, then answers every request until stdin closes."""
        self.send({"ready": True})
        for request in self.requests():
            self.send(answer(request))
