"""How a service rides through an outage of Redis (or of the buffer in front of it): one
retry policy that every service uses.

- Within one Redis command, redis-py reconnects and retries a few times at once (`connect`):
  a Redis that restarts in a moment costs a caller nothing.
- Past that, whoever waits (the buffer's Redis watch, the rollout worker's weight watcher,
  every BufferClient call of the trainer and the rollout workflow) retries with exponential
  backoff (`Outage`, `retry`), reports itself not ready meanwhile, and gives up only once the
  dependency has been unreachable for `outage_seconds` (ServiceSettings; environment
  ASYNCRL_OUTAGE_SECONDS, default DEFAULT_OUTAGE_SECONDS): then it raises OutageTooLong,
  naming the address, and the service exits non-zero.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, TypeVar
from urllib.parse import urlparse

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

log = logging.getLogger(__name__)

#: How long a service waits for Redis (or the buffer) to come back before it exits: a Redis
#: pod rescheduled on another node, its volume re-attached and its AOF reloaded, fits.
DEFAULT_OUTAGE_SECONDS = 300.0
OUTAGE_ENV = "ASYNCRL_OUTAGE_SECONDS"

#: Backoff between attempts while something is down: fast at first (a local restart takes a
#: second), then at most every MAX_DELAY so a recovery is noticed soon.
FIRST_DELAY, MAX_DELAY = 0.1, 2.0

#: Errors that mean Redis cannot be reached now. A reply that is not Redis' protocol counts:
#: while a Redis pod is away, its Service's address may be answered by whatever the network
#: puts there (seen: an HTTP proxy's "400 Bad Request").
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.InvalidResponse)

#: Seconds a Redis command or connection attempt may take before it counts as an outage.
SOCKET_TIMEOUT = 10.0

T = TypeVar("T")


class OutageTooLong(RuntimeError):
    """A dependency stayed unreachable for longer than the bound; the service should exit."""


def redis_address(url: str) -> str:
    """host:port (or the socket path) of a Redis URL, without its credentials: for messages."""
    parsed = urlparse(url)
    if parsed.scheme == "unix":
        return parsed.path
    return f"{parsed.hostname}:{parsed.port or 6379}"


#: Connections one client opens at most. redis-py's pool refuses a command past its limit
#: ("Too many connections", 100 by default): a buffer serving more concurrent requests than
#: that would fail them. The pool here makes them wait for a connection instead; more than a
#: few dozen at once would only queue inside the single-threaded Redis anyway.
MAX_CONNECTIONS = 64


def connect(url: str, password: str | None = None) -> redis.Redis:
    """An asyncio Redis client that reconnects and retries each command a few times within a
    second (a dropped connection, a restarted Redis); longer outages are the caller's."""
    return redis.Redis.from_pool(redis.BlockingConnectionPool.from_url(
        url, password=password, max_connections=MAX_CONNECTIONS, timeout=SOCKET_TIMEOUT,
        retry=Retry(ExponentialBackoff(cap=0.4, base=0.05), retries=3),
        retry_on_error=list(REDIS_DOWN),
        # A Redis pod that vanished answers nothing, not even a reset: without timeouts a
        # command on its old connection would wait for TCP to give up (many minutes). No
        # command blocks on the server, so a reply is due at once.
        socket_timeout=SOCKET_TIMEOUT, socket_connect_timeout=SOCKET_TIMEOUT,
        socket_keepalive=True,
    ))


def describe(exc: BaseException) -> str:
    """One line about an error: a gRPC error's details (its repr spans several lines)."""
    details = getattr(exc, "details", None)
    return details() if callable(details) else str(exc)


def redis_down(exc: BaseException) -> bool:
    """Whether `exc` means Redis cannot be reached now (loading its AOF counts)."""
    return isinstance(exc, REDIS_DOWN)


class Outage:
    """One dependency as a service sees it: reachable or not, since when, the next backoff
    delay, and the bound past which waiting turns into OutageTooLong."""

    def __init__(self, what: str, bound: float = DEFAULT_OUTAGE_SECONDS):
        self.what = what
        self.bound = bound
        self.down_since: float | None = None
        self._failures = 0
        self._backoff = ExponentialBackoff(cap=MAX_DELAY, base=FIRST_DELAY / 2)

    @property
    def available(self) -> bool:
        return self.down_since is None

    def failed(self, exc: BaseException) -> float:
        """Records a failed attempt; returns the seconds to wait before the next one, or
        raises OutageTooLong once `what` has been unreachable for longer than the bound."""
        now = time.monotonic()
        if self.down_since is None:
            self.down_since = now
            log.warning("%s is unreachable (%s); retrying with backoff for up to %.0f s",
                        self.what, describe(exc), self.bound)
        elif now - self.down_since > self.bound:
            raise OutageTooLong(
                f"{self.what} has been unreachable for {now - self.down_since:.0f} s, longer "
                f"than the {self.bound:.0f} s allowed ({OUTAGE_ENV}); last error: {describe(exc)}"
            ) from exc
        self._failures += 1
        return self._backoff.compute(self._failures)

    def recovered(self) -> None:
        if self.down_since is not None:
            log.info("%s is reachable again after %.1f s", self.what,
                     time.monotonic() - self.down_since)
        self.down_since = None
        self._failures = 0


async def retry(call: Callable[[], Awaitable[T]], outage: Outage,
                transient: Callable[[BaseException], bool] = redis_down) -> T:
    """`await call()`, retried with backoff while it fails with a transient error, until
    `outage`'s bound; any other error is raised at once."""
    while True:
        try:
            result = await call()
        except Exception as exc:
            if not transient(exc):
                raise
            await asyncio.sleep(outage.failed(exc))
            continue
        outage.recovered()
        return result
