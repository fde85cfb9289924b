"""Requests that arrive while earlier ones are on their way go together in the next round trip
(group commit). Used where a round trip costs far more than what it carries: a rollout
worker's puts to the buffer (one PutGroups message) and the buffer's writes to Redis (one
transaction and, with appendfsync always, one sync)."""

from __future__ import annotations

import asyncio
import math
from collections import deque
from typing import Awaitable, Callable, Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


class Coalescer(Generic[Item, Result]):
    """Sends submitted items with `send(items)`, which returns one result per item in order (a
    result that is an exception is raised to that item's submitter; an exception `send` raises,
    to all of them). At most `rounds` sends are on their way at once; items submitted meanwhile
    wait, and the next send takes all that wait, up to `limit` by `weight` (one item at least,
    however heavy). A lone item at a quiet moment goes at once."""

    def __init__(self, send: Callable[[list[Item]], Awaitable[list[Result]]], *,
                 rounds: int = 1, limit: float = math.inf,
                 weight: Callable[[Item], float] = lambda item: 1):
        self._send, self._rounds, self._limit, self._weight = send, rounds, limit, weight
        self._waiting: deque[tuple[Item, asyncio.Future]] = deque()
        # The drains running. A drain leaves the set in the same step as it finds nothing
        # waiting (not in a done callback, a step later), so no item is left waiting unseen.
        self._sending: set[asyncio.Task] = set()

    async def submit(self, item: Item) -> Result:
        (result,) = await self.submit_all([item])
        return result

    async def submit_all(self, items: list[Item]) -> list[Result]:
        """The results of `items`, which may go in one send or, past `limit`, in several."""
        if not items:
            return []
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in items]
        self._waiting.extend(zip(items, futures))
        if len(self._sending) < self._rounds:
            self._sending.add(asyncio.create_task(self._drain()))
        try:
            return [await future for future in futures]
        except BaseException:
            for future in futures:  # nobody will read the others' outcomes
                future.cancel()
            raise

    async def _drain(self) -> None:
        try:
            await self._send_waiting()
        finally:
            self._sending.discard(asyncio.current_task())

    async def _send_waiting(self) -> None:
        while self._waiting:
            taken = self._take()
            try:
                results = await self._send([item for item, _ in taken])
                if len(results) != len(taken):  # else some submitters would wait forever
                    raise RuntimeError(f"{len(results)} results came back for {len(taken)} items")
            except asyncio.CancelledError:  # close()
                for _, future in [*taken, *self._waiting]:
                    future.cancel()
                raise
            except Exception as exc:  # noqa: BLE001 - each submitter raises it
                results = [exc] * len(taken)
            for (_, future), result in zip(taken, results):
                if future.done():  # its submitter was cancelled
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)

    def _take(self) -> list[tuple[Item, asyncio.Future]]:
        taken = [self._waiting.popleft()]
        weight = self._weight(taken[0][0])
        while self._waiting and weight + self._weight(self._waiting[0][0]) <= self._limit:
            item = self._waiting.popleft()
            taken.append(item)
            weight += self._weight(item[0])
        return taken

    def close(self) -> None:
        """Cancels the sends on their way and every submitter's wait."""
        for task in self._sending:
            task.cancel()
        for _, future in self._waiting:
            future.cancel()
