"""Coalescer: what arrives while a send is on its way goes together in the next one."""

import asyncio

import pytest

from asyncrl.platform.coalesce import Coalescer


class Recorder:
    """A send that records what each call carried and holds it for a moment (`hold` seconds,
    or until `hold`, an asyncio.Event, is set)."""

    def __init__(self, hold=0.02, answer=lambda item: item * 10):
        self.sends, self.hold, self.answer, self.at_once, self._now = [], hold, answer, 0, 0

    async def __call__(self, items):
        self.sends.append(list(items))
        self._now += 1
        self.at_once = max(self.at_once, self._now)
        if isinstance(self.hold, asyncio.Event):
            await self.hold.wait()
        else:
            await asyncio.sleep(self.hold)
        self._now -= 1
        return [self.answer(item) for item in items]


def test_a_lone_item_goes_at_once_and_those_that_wait_go_together():
    async def scenario():
        send = Recorder()
        coalescer = Coalescer(send)
        first = asyncio.create_task(coalescer.submit(1))
        await asyncio.sleep(0.001)                  # 1 is on its way
        rest = [asyncio.create_task(coalescer.submit(i)) for i in (2, 3, 4)]
        return send.sends, await first, await asyncio.gather(*rest)

    sends, first, rest = asyncio.run(scenario())
    assert sends == [[1], [2, 3, 4]]
    assert first == 10 and rest == [20, 30, 40]


def test_one_submit_after_another_each_gets_sent():
    async def scenario():
        send = Recorder(hold=0)
        coalescer = Coalescer(send)
        results = []
        async with asyncio.timeout(5):  # in this task: a task of its own would hide a lost wake-up
            for i in range(5):
                results.append(await coalescer.submit(i))
        return results, send.sends

    results, sends = asyncio.run(scenario())
    assert results == [0, 10, 20, 30, 40] and sends == [[0], [1], [2], [3], [4]]


def test_the_limit_splits_sends_and_a_heavy_item_goes_alone():
    async def scenario():
        send = Recorder(hold=0.01)
        coalescer = Coalescer(send, limit=10, weight=lambda item: item)
        blocker = asyncio.create_task(coalescer.submit(1))
        await asyncio.sleep(0.001)
        results = await coalescer.submit_all([4, 5, 3, 50, 2])
        await blocker
        return send.sends, results

    sends, results = asyncio.run(scenario())
    assert sends == [[1], [4, 5], [3], [50], [2]]   # in order, each send at most 10 but 50
    assert results == [40, 50, 30, 500, 20]


def test_rounds_bound_the_sends_on_their_way():
    async def scenario(rounds):
        # Held until every item is submitted, not for a fixed time: on a busy machine the
        # submits could otherwise come further apart than a send takes and never overlap.
        released = asyncio.Event()
        send = Recorder(hold=released)
        coalescer = Coalescer(send, rounds=rounds)
        submitted = []
        for i in range(8):  # one every 2 ms, every send still on its way
            submitted.append(asyncio.create_task(coalescer.submit(i)))
            await asyncio.sleep(0.002)
        released.set()
        assert await asyncio.gather(*submitted) == [i * 10 for i in range(8)]
        return send.at_once

    assert asyncio.run(scenario(1)) == 1
    assert asyncio.run(scenario(3)) == 3


def test_an_error_result_is_raised_to_its_submitter_only_and_a_failed_send_to_all_of_it():
    async def scenario():
        def answer(item):
            return ValueError(f"refused {item}") if item == 2 else item

        coalescer = Coalescer(Recorder(answer=answer))
        one = await asyncio.gather(*(coalescer.submit(i) for i in (1, 2, 3)),
                                   return_exceptions=True)

        async def broken(items):
            raise ConnectionError("down")

        failing = Coalescer(broken)
        two = await asyncio.gather(*(failing.submit(i) for i in (1, 2)), return_exceptions=True)
        return one, two

    one, two = asyncio.run(scenario())
    assert one[0] == 1 and one[2] == 3 and str(one[1]) == "refused 2"
    assert [type(e) for e in two] == [ConnectionError, ConnectionError]


def test_a_send_that_answers_too_few_fails_its_submitters_rather_than_leaving_them_waiting():
    async def scenario():
        async def short(items):
            return items[:-1]

        coalescer = Coalescer(short)
        async with asyncio.timeout(5):
            return await asyncio.gather(*(coalescer.submit(i) for i in range(3)),
                                        return_exceptions=True)

    outcomes = asyncio.run(scenario())
    assert all(isinstance(o, RuntimeError) and "2 results" in str(o) for o in outcomes)


def test_a_cancelled_submitter_leaves_the_others_their_results():
    async def scenario():
        send = Recorder()
        coalescer = Coalescer(send)
        blocker = asyncio.create_task(coalescer.submit(0))
        await asyncio.sleep(0.001)
        gone = asyncio.create_task(coalescer.submit(1))
        kept = asyncio.create_task(coalescer.submit(2))
        await asyncio.sleep(0.001)
        gone.cancel()
        return send.sends, await blocker, await kept, await asyncio.gather(gone, return_exceptions=True)

    sends, blocker, kept, gone = asyncio.run(scenario())
    assert blocker == 0 and kept == 20 and isinstance(gone[0], asyncio.CancelledError)
    assert sends == [[0], [1, 2]]   # what was submitted is still sent


def test_close_cancels_the_waiting_submitters():
    async def scenario():
        coalescer = Coalescer(Recorder(hold=10))
        waiting = [asyncio.create_task(coalescer.submit(i)) for i in range(3)]
        await asyncio.sleep(0.01)
        coalescer.close()
        return await asyncio.gather(*waiting, return_exceptions=True)

    assert all(isinstance(r, asyncio.CancelledError) for r in asyncio.run(scenario()))
