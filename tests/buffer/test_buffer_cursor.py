"""The prompt cursor the buffer hands out with each slot, over a real redis-server and real
gRPC: each cursor once, a lost slot's again before new ones, a used one never again, and
"exhausted" once every prompt of every epoch is used."""

import asyncio
import time

import grpc
import pytest
import redis as sync_redis

from asyncrl.clients.buffer import BufferClient
from asyncrl.buffer.store import JobConfig
from asyncrl.platform.redis_keys import key
from asyncrl.v1 import buffer_pb2
from support.buffer import BufferThread, buffer_stub, make_group  # noqa: F401 (stub fixture)

GROUP = 2
PROMPTS = 3  # N, as the workers tell it


@pytest.fixture
def buffer(redis_server):
    jobs = [
        JobConfig(name="open", max_staleness=100, batch_size=2, group_size=GROUP),
        JobConfig(name="two-epochs", max_staleness=100, batch_size=2, group_size=GROUP,
                  epochs=2),
        JobConfig(name="short-lease", max_staleness=100, batch_size=2, group_size=GROUP,
                  lease_seconds=0.5),
    ]
    server = BufferThread(redis_server.url, jobs).start()
    yield server
    server.stop()


def acquire(stub, job, prompts=PROMPTS):
    return stub.AcquireSlot(buffer_pb2.AcquireSlotRequest(job=job, worker="w", prompts=prompts),
                            timeout=10)


def cursor(stub, job) -> int:
    reply = acquire(stub, job)
    assert reply.granted, reply
    return reply.prompt_cursor


def put(stub, job, slot, group_id="g"):
    return stub.PutGroup(buffer_pb2.PutGroupRequest(
        job=job, slot_id=slot.slot_id, group=make_group(group_id, GROUP)), timeout=10)


def release(stub, job, slot, *, uniform=False, used=False):
    return stub.ReleaseSlot(buffer_pb2.ReleaseSlotRequest(
        job=job, slot_id=slot.slot_id, reason="test", uniform_rewards=uniform,
        prompt_used=used), timeout=10).released


def stats(stub, job):
    return stub.GetStats(buffer_pb2.GetStatsRequest(job=job), timeout=10)


def test_grants_hand_out_each_cursor_once_and_count_epochs(stub):
    assert [cursor(stub, "open") for _ in range(7)] == list(range(7))
    snapshot = stats(stub, "open")
    assert (snapshot.prompt_cursor, snapshot.prompts_per_epoch, snapshot.epoch) == (7, 3, 2)
    assert snapshot.epochs == 0 and not snapshot.dataset_used_up


def test_a_worker_that_counts_other_prompts_is_refused(stub):
    assert cursor(stub, "open") == 0
    with pytest.raises(grpc.RpcError) as error:
        acquire(stub, "open", prompts=PROMPTS + 1)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "same training prompts" in error.value.details()
    assert acquire(stub, "open", prompts=0).prompt_cursor == 1  # 0: not told, not checked


def test_a_released_slots_prompt_is_handed_out_again_before_new_ones(stub):
    first, second = acquire(stub, "open"), acquire(stub, "open")
    assert release(stub, "open", second) and release(stub, "open", first)
    assert stats(stub, "open").prompts_to_reissue == 2
    # In the order they were lost, then new ones.
    assert [cursor(stub, "open") for _ in range(3)] == [1, 0, 2]
    assert stats(stub, "open").prompts_to_reissue == 0


def test_skipped_and_dropped_prompts_are_used_up(stub):
    skipped, dropped = acquire(stub, "open"), acquire(stub, "open")
    assert release(stub, "open", skipped, uniform=True)
    assert release(stub, "open", dropped, used=True)
    assert not release(stub, "open", skipped)  # a retry: no longer held, changes nothing
    assert cursor(stub, "open") == 2
    assert stats(stub, "open").prompts_to_reissue == 0


def test_an_accepted_group_names_its_prompt_cursor_in_the_stream(stub, redis_server):
    slots = [acquire(stub, "open") for _ in range(2)]
    put(stub, "open", slots[1], "g1")
    put(stub, "open", slots[1], "g1")  # a retry uses nothing more
    client = sync_redis.Redis(port=redis_server.port)
    entries = client.xrange(key("open", "groups"))
    client.close()
    assert [(f[b"id"], f[b"c"]) for _, f in entries] == [(b"g1", b"1")]
    assert cursor(stub, "open") == 2


def redis_now_ms(redis_server) -> int:
    client = sync_redis.Redis(port=redis_server.port)
    seconds, micros = client.time()
    client.close()
    return seconds * 1000 + micros // 1000


def wait_past(redis_server, expires_ms: int) -> None:
    """Until Redis' clock (the one leases use) is past `expires_ms`."""
    deadline = time.monotonic() + 30
    while redis_now_ms(redis_server) <= expires_ms:
        assert time.monotonic() < deadline, "Redis' clock never passed the lease"
        time.sleep(0.05)


def test_an_expired_slots_prompt_is_handed_out_again(stub, redis_server):
    """A slot whose lease ran out (a dead worker) gives its prompt back, whichever call finds
    it expired first: a grant, its own heartbeat, or its put (which is refused)."""
    job = "short-lease"
    found_by_grant = acquire(stub, job)
    wait_past(redis_server, found_by_grant.lease_expires_unix_ms)
    again = acquire(stub, job)
    assert again.prompt_cursor == 0  # taken back and handed out in the same grant
    assert release(stub, job, again, used=True)

    by_heartbeat, by_put = acquire(stub, job), acquire(stub, job)
    assert (by_heartbeat.prompt_cursor, by_put.prompt_cursor) == (1, 2)
    wait_past(redis_server, max(by_heartbeat.lease_expires_unix_ms,
                                by_put.lease_expires_unix_ms))
    assert not stub.Heartbeat(buffer_pb2.HeartbeatRequest(
        job=job, slot_id=by_heartbeat.slot_id), timeout=10).alive
    with pytest.raises(grpc.RpcError) as error:
        put(stub, job, by_put)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert stats(stub, job).prompts_to_reissue == 2
    assert [acquire(stub, job).prompt_cursor for _ in range(3)] == [1, 2, 3]
    assert stats(stub, job).expired_slots_total == 3


def test_the_dataset_is_used_up_after_its_epochs(stub):
    """Two epochs of three prompts: six cursors. Once all are handed out, a grant waits
    ("draining") while a slot still holds a prompt, which a lost slot gives back; once every
    one is used the answer is "exhausted", for good."""
    job = "two-epochs"
    slots = [acquire(stub, job) for _ in range(6)]
    assert [s.prompt_cursor for s in slots] == list(range(6))
    for index, slot in enumerate(slots[:4]):
        put(stub, job, slot, f"g{index}")
    release(stub, job, slots[4], uniform=True)
    refused = acquire(stub, job)
    assert (refused.granted, refused.reason) == (False, "draining")
    assert refused.retry_after_ms > 0
    snapshot = stats(stub, job)
    assert (snapshot.prompt_cursor, snapshot.epoch, snapshot.epochs) == (6, 2, 2)
    assert not snapshot.dataset_used_up

    release(stub, job, slots[5])  # generation failed: cursor 5 comes back
    again = acquire(stub, job)
    assert again.granted and again.prompt_cursor == 5
    put(stub, job, again, "g5")
    for _ in range(2):
        refused = acquire(stub, job)
        assert (refused.granted, refused.reason) == (False, "exhausted")
    snapshot = stats(stub, job)
    assert snapshot.dataset_used_up and snapshot.accepted_total == 5
    assert snapshot.depth_groups == 5 and snapshot.outstanding_batches == 0


def test_a_put_that_asks_for_the_next_slot_gets_the_next_cursor(buffer):
    async def scenario():
        client = BufferClient(buffer.address, "two-epochs", "w", prompts=PROMPTS)
        try:
            slot = await client.acquire()
            cursors = [slot.prompt_cursor]
            while slot is not None:
                slot = await client.put(slot, make_group(f"g{cursors[-1]}", GROUP),
                                        acquire_next=True)
                if slot is not None:
                    cursors.append(slot.prompt_cursor)
            return cursors, await client.acquire()
        finally:
            await client.close()

    cursors, last = asyncio.run(scenario())
    assert cursors == list(range(6)) and last is None


def test_the_cursor_survives_a_redis_restart(buffer, redis_server):
    """Redis killed -9 and started on its files (AOF): the cursor, the reissue list and the
    slots' prompts are where they were."""

    async def scenario():
        client = BufferClient(buffer.address, "open", "w", prompts=PROMPTS)
        try:
            slots = [await client.acquire() for _ in range(4)]
            await client.release(slots[1], "generation failed")
            redis_server.kill()
            redis_server.start()
            await client.release(slots[2], "generation failed")  # held across the restart
            after = [(await client.acquire()).prompt_cursor for _ in range(3)]
            return after, await client.stats()
        finally:
            await client.close()

    after, snapshot = asyncio.run(scenario())
    assert after == [1, 2, 4]
    assert snapshot.prompt_cursor == 5 and snapshot.running_slots == 5
