"""The buffer service over a real redis-server and real gRPC."""

import threading
import time

import grpc
import pytest

from asyncrl.buffer.store import JobConfig
from asyncrl.v1 import buffer_pb2, buffer_pb2_grpc
from support.buffer import BufferThread, buffer_stub, make_group  # noqa: F401 (stub fixture)
from support.gate_oracle import rollout_capacity

GROUP = 2
BATCH = 3


@pytest.fixture
def buffer(redis_server):
    jobs = [
        JobConfig(name=f"eta{eta}", max_staleness=eta, batch_size=BATCH, group_size=GROUP,
                  lease_seconds=30, ack_timeout_seconds=1.0)
        for eta in (0, 1, 4)
    ] + [JobConfig(name="short-lease", max_staleness=1, batch_size=1, group_size=GROUP,
                   lease_seconds=2.0), JobConfig(name="capped", max_staleness=4, batch_size=2,
                                                 group_size=GROUP, max_concurrent=3),
         JobConfig(name="tiny-records", max_staleness=1, batch_size=1, group_size=GROUP,
                   max_group_bytes=200),
         JobConfig(name="oversampled", max_staleness=0, batch_size=BATCH, group_size=GROUP,
                   oversample_groups=2)]
    server = BufferThread(redis_server.url, jobs).start()
    yield server
    server.stop()


def acquire(stub, job, worker="w"):
    return stub.AcquireSlot(buffer_pb2.AcquireSlotRequest(job=job, worker=worker), timeout=10)


def put(stub, job, slot_id, group_id, version=0):
    return stub.PutGroup(buffer_pb2.PutGroupRequest(
        job=job, slot_id=slot_id, group=make_group(group_id, GROUP, version)), timeout=10)


def get_batch(stub, job, consumer, wait_ms=0):
    """A whole batch of BATCH groups: GetBatch's parts merged, as BufferClient does."""
    batch = buffer_pb2.Batch()
    for part in stub.GetBatch(buffer_pb2.GetBatchRequest(
            job=job, consumer=consumer, num_groups=BATCH, wait_ms=wait_ms), timeout=10):
        batch.MergeFrom(part)
    return batch


def stats(stub, job):
    return stub.GetStats(buffer_pb2.GetStatsRequest(job=job), timeout=10)


def hammer(address, job, threads=12):
    """Threads race for slots until the gate says no; returns the granted slot ids."""
    granted, lock = [], threading.Lock()

    def worker(index):
        with grpc.insecure_channel(address) as channel:
            stub = buffer_pb2_grpc.BufferStub(channel)
            while True:
                reply = acquire(stub, job, f"w{index}")
                if not reply.granted:
                    return
                with lock:
                    granted.append(reply.slot_id)

    pool = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    return granted


@pytest.mark.parametrize("eta", [0, 1, 4])
def test_gate_grants_exactly_the_bound_under_concurrent_workers(buffer, stub, eta):
    job = f"eta{eta}"
    bound = (eta + 0 + 1) * BATCH
    granted = hammer(buffer.address, job)
    assert len(granted) == len(set(granted)) == bound
    assert rollout_capacity(max_staleness=eta, trainer_version=0, batch_size=BATCH,
                            accepted=0, running=len(granted)) == 0
    for index, slot in enumerate(granted):
        put(stub, job, slot, f"g{index}")
    snapshot = stats(stub, job)
    assert (snapshot.accepted_total, snapshot.running_slots) == (bound, 0)
    assert hammer(buffer.address, job) == []  # accepted groups still count against the bound
    stub.SetVersion(buffer_pb2.SetVersionRequest(job=job, version=1, weights_uri="/w/1"), timeout=10)
    assert len(hammer(buffer.address, job)) == BATCH  # one more step's worth


def test_concurrency_limit(stub):
    slots = [acquire(stub, "capped") for _ in range(5)]
    assert [s.granted for s in slots] == [True, True, True, False, False]
    assert slots[3].reason == "concurrency" and slots[3].retry_after_ms > 0
    stub.ReleaseSlot(buffer_pb2.ReleaseSlotRequest(job="capped", slot_id=slots[0].slot_id), timeout=10)
    assert acquire(stub, "capped").granted


def test_skipped_groups_give_their_slot_back_and_are_counted_once(stub):
    """A release for a group dropped with every reward equal frees the slot like any release,
    and counts it as skipped; a repeated release (a retry) counts nothing more."""
    slots = [acquire(stub, "capped") for _ in range(3)]
    assert all(s.granted for s in slots) and not acquire(stub, "capped").granted

    def release(slot, uniform):
        return stub.ReleaseSlot(buffer_pb2.ReleaseSlotRequest(
            job="capped", slot_id=slot.slot_id, reason="every reward equal",
            uniform_rewards=uniform), timeout=10).released

    assert release(slots[0], True) and release(slots[1], False)
    assert not release(slots[0], True)  # no longer held
    snapshot = stats(stub, "capped")
    assert (snapshot.skipped_uniform_total, snapshot.running_slots) == (1, 1)
    assert snapshot.accepted_total == 0
    assert acquire(stub, "capped").granted and acquire(stub, "capped").granted


def test_batches_are_whole_groups_oldest_first_and_acknowledged(stub):
    job = "eta4"
    for index in range(7):
        put(stub, job, acquire(stub, job).slot_id, f"g{index}")
    batch = get_batch(stub, job, "t0")
    assert [g.group_id for g in batch.groups] == ["g0", "g1", "g2"]
    assert all(len(g.samples) == GROUP for g in batch.groups) and not batch.redelivered
    assert batch.groups[0].samples[0].behaviour_logprobs == [-0.5] * 4
    stub.AckBatch(buffer_pb2.AckBatchRequest(job=job, batch_id=batch.batch_id), timeout=10)
    # A retried ack is harmless; an unknown batch is NOT_FOUND.
    stub.AckBatch(buffer_pb2.AckBatchRequest(job=job, batch_id=batch.batch_id), timeout=10)
    with pytest.raises(grpc.RpcError) as error:
        stub.AckBatch(buffer_pb2.AckBatchRequest(job=job, batch_id="nope"), timeout=10)
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    second = get_batch(stub, job, "t0")
    assert [g.group_id for g in second.groups] == ["g3", "g4", "g5"]
    snapshot = stats(stub, job)
    assert (snapshot.consumed_total, snapshot.depth_groups) == (3, 1)
    assert list(snapshot.staleness_counts) == [6]


def test_a_batch_comes_in_parts_that_merge_into_it(buffer, stub, monkeypatch):
    """GetBatch streams a batch in parts of about BATCH_PART_BYTES of groups (one message of
    hundreds of MB moved at half the speed): the first part carries the batch's id, each
    group is whole in one part, and the parts merged are the batch, in order."""
    import asyncio

    from asyncrl.buffer import server
    from asyncrl.clients.buffer import BufferClient

    job = "eta4"
    for index in range(2 * BATCH):
        put(stub, job, acquire(stub, job).slot_id, f"g{index}")
    group_bytes = len(make_group("g0", GROUP).SerializeToString())
    monkeypatch.setattr(server, "BATCH_PART_BYTES", 2 * group_bytes)
    parts = list(stub.GetBatch(buffer_pb2.GetBatchRequest(job=job, consumer="t0",
                                                          num_groups=BATCH), timeout=10))
    assert [len(part.groups) for part in parts] == [2, 1]
    assert parts[0].batch_id and not parts[1].batch_id
    assert [g.group_id for part in parts for g in part.groups] == ["g0", "g1", "g2"]

    async def from_the_client():
        client = BufferClient(buffer.address, job, "trainer")
        try:
            return await client.get_batch("t1", BATCH)
        finally:
            await client.close()

    monkeypatch.setattr(server, "BATCH_PART_BYTES", 1)  # each group a part of its own
    batch = asyncio.run(from_the_client())
    assert [g.group_id for g in batch.groups] == ["g3", "g4", "g5"]
    assert batch.batch_id and batch.batch_id != parts[0].batch_id
    assert all(len(g.samples) == GROUP for g in batch.groups)
    assert batch.groups[2].samples[0].behaviour_logprobs == [-0.5] * 4


def test_short_buffer_waits_and_returns_an_empty_batch(stub):
    put(stub, "eta4", acquire(stub, "eta4").slot_id, "only")
    started = time.monotonic()
    batch = get_batch(stub, "eta4", "t0", wait_ms=300)
    assert batch.batch_id == "" and not batch.groups and time.monotonic() - started >= 0.3
    assert stats(stub, "eta4").depth_groups == 1  # still there for the next call


def test_unacknowledged_batch_is_redelivered(stub):
    job = "eta4"
    for index in range(BATCH):
        put(stub, job, acquire(stub, job).slot_id, f"g{index}")
    first = get_batch(stub, job, "t0")
    # The same trainer restarted: it gets its batch back at once.
    redelivered_at = time.monotonic()  # at or before Redis stamps the redelivery
    again = get_batch(stub, job, "t0")
    assert again.redelivered and again.batch_id == first.batch_id
    assert [g.group_id for g in again.groups] == [g.group_id for g in first.groups]
    # Another trainer takes it over once the ack timeout (1 s) passed, and not before: until
    # then it gets nothing (every group is in that batch). The limit only catches a hang.
    deadline = redelivered_at + 60
    while True:
        other = get_batch(stub, job, "t1")
        if other.batch_id:
            break
        assert not other.groups and time.monotonic() < deadline, other
        time.sleep(0.1)
    assert time.monotonic() - redelivered_at >= 1.0  # a lower bound: a slow machine only adds
    assert other.redelivered and other.batch_id == first.batch_id
    stub.AckBatch(buffer_pb2.AckBatchRequest(job=job, batch_id=other.batch_id), timeout=10)
    assert stats(stub, job).redelivered_total == 2


def test_stale_groups_are_dropped_and_counted(stub):
    job = "eta1"
    for index in range(BATCH):
        put(stub, job, acquire(stub, job).slot_id, f"old{index}", version=0)
    stub.SetVersion(buffer_pb2.SetVersionRequest(job=job, version=2, weights_uri="/w/2"), timeout=10)
    for index in range(BATCH):
        put(stub, job, acquire(stub, job).slot_id, f"new{index}", version=2)
    batch = get_batch(stub, job, "t")
    assert [g.group_id for g in batch.groups] == ["new0", "new1", "new2"]
    assert batch.dropped_stale == 3 and stats(stub, job).dropped_stale_total == 3


def test_dropped_groups_give_their_budget_back(stub):
    """With η = 0 a worker can still start a group on weights one version old (the gate opens
    when the trainer publishes, before the worker loads the new weights); such a group is
    dropped, and its place must be generated again, not lost: otherwise the job waits forever."""
    job = "eta0"
    for index in range(BATCH):
        put(stub, job, acquire(stub, job).slot_id, f"a{index}", version=0)
    batch = get_batch(stub, job, "t")
    stub.AckBatch(buffer_pb2.AckBatchRequest(job=job, batch_id=batch.batch_id), timeout=10)
    stub.SetVersion(buffer_pb2.SetVersionRequest(job=job, version=1, weights_uri="/w/1"), timeout=10)
    for index in range(BATCH):  # generated before the worker had version 1
        put(stub, job, acquire(stub, job).slot_id, f"late{index}", version=0)
    assert not acquire(stub, job).granted  # the step's budget is in use
    wait = get_batch(stub, job, "t", wait_ms=100)
    assert not wait.groups and wait.dropped_stale == BATCH
    regenerated = [acquire(stub, job) for _ in range(BATCH + 1)]
    assert [slot.granted for slot in regenerated] == [True] * BATCH + [False]


def test_oversampled_groups_run_beside_the_batch_and_extras_are_dropped_stale(stub):
    """algorithm.oversampleGroups widens admission, never the bound: at η = 0 the extras start
    with the batch, and one accepted after its version's batch was taken is dropped as stale,
    giving its place back."""
    job = "oversampled"  # bound (0 + 0 + 1) * 3 = 3 groups, plus 2 extra
    slots = [acquire(stub, job) for _ in range(BATCH + 3)]
    assert [s.granted for s in slots] == [True] * (BATCH + 2) + [False]
    assert slots[-1].reason == "staleness"
    for index, slot in enumerate(slots[:BATCH + 1]):
        put(stub, job, slot.slot_id, f"g{index}", version=0)
    batch = get_batch(stub, job, "t")
    assert [g.group_id for g in batch.groups] == ["g0", "g1", "g2"]
    stub.AckBatch(buffer_pb2.AckBatchRequest(job=job, batch_id=batch.batch_id), timeout=10)
    stub.SetVersion(buffer_pb2.SetVersionRequest(job=job, version=1, weights_uri="/w/1"), timeout=10)
    put(stub, job, slots[BATCH + 1].slot_id, "g4", version=0)  # was running at the change
    # kept 5 against (0 + 1 + 1) * 3 + 2: three start on version 1
    fresh = [acquire(stub, job) for _ in range(BATCH + 1)]
    assert [s.granted for s in fresh] == [True] * BATCH + [False]
    put(stub, job, fresh[0].slot_id, "n0", version=1)
    wait = get_batch(stub, job, "t", wait_ms=100)
    assert not wait.groups and wait.dropped_stale == 2  # g3 and g4, never trained
    # their places come back: kept 4, running 2 against 8
    assert [acquire(stub, job).granted for _ in range(3)] == [True, True, False]


def test_lease_expiry_frees_a_dead_workers_slot(stub):
    job = "short-lease"  # bound (1 + 0 + 1) * 1 = 2 slots
    dead, alive = acquire(stub, job, "dead"), acquire(stub, job, "alive")
    assert dead.granted and alive.granted and not acquire(stub, job).granted
    # The live worker heart-beats (20 times a lease); the dead one does not. Its slot is
    # granted again once its lease ran out; the limit only catches a hang.
    deadline = time.monotonic() + 60
    while True:
        assert stub.Heartbeat(buffer_pb2.HeartbeatRequest(job=job, slot_id=alive.slot_id), timeout=10).alive
        if acquire(stub, job).granted:
            break
        assert time.monotonic() < deadline, "the dead worker's slot was never freed"
        time.sleep(0.1)
    assert stats(stub, job).expired_slots_total == 1  # the dead one's; the live one kept its
    with pytest.raises(grpc.RpcError) as error:
        put(stub, job, dead.slot_id, "too-late")
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "lease expired" in error.value.details()


def test_put_retry_is_idempotent(stub):
    slot = acquire(stub, "eta4").slot_id
    put(stub, "eta4", slot, "g0")
    put(stub, "eta4", slot, "g0")  # the reply of the first was lost; the client retries
    assert stats(stub, "eta4").accepted_total == 1


def test_set_version_announces_where_rollout_workers_look(stub, redis_server):
    """Rollout workers read versions from Redis (asyncrl.weights.announcements), not through the buffer:
    SetVersion writes the hash and publishes on the channel."""
    import redis

    from asyncrl.weights.announcements import WeightVersion, weights_channel, weights_key

    client = redis.Redis.from_url(redis_server.url)
    pubsub = client.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(weights_channel("eta4"))
    try:
        info = stub.SetVersion(buffer_pb2.SetVersionRequest(job="eta4", version=3,
                                                            weights_uri="/w/3"), timeout=10)
        assert (info.version, info.weights_uri) == (3, "/w/3") and info.updated_unix_ms > 0
        assert WeightVersion.from_hash(client.hgetall(weights_key("eta4"))) == \
            WeightVersion(3, "/w/3", info.updated_unix_ms)
        deadline = time.monotonic() + 30
        message = None
        while message is None and time.monotonic() < deadline:
            message = pubsub.get_message(timeout=1.0)
        assert message is not None and message["type"] == "message"
    finally:
        pubsub.close()
        client.close()


@pytest.mark.parametrize(
    ("call", "code", "message"),
    [
        (lambda s: acquire(s, "no-such-job"), grpc.StatusCode.NOT_FOUND, "unknown job"),
        (lambda s: acquire(s, "eta4", worker=""), grpc.StatusCode.INVALID_ARGUMENT, "worker"),
        (lambda s: s.PutGroup(buffer_pb2.PutGroupRequest(
            job="eta4", slot_id=acquire(s, "eta4").slot_id, group=make_group("g", GROUP + 1)), timeout=10),
         grpc.StatusCode.INVALID_ARGUMENT, "groupSize"),
        (lambda s: s.PutGroup(buffer_pb2.PutGroupRequest(
            job="eta4", slot_id=acquire(s, "eta4").slot_id, group=_mismatched()), timeout=10),
         grpc.StatusCode.INVALID_ARGUMENT, "one entry per response token"),
        (lambda s: s.PutGroup(buffer_pb2.PutGroupRequest(
            job="tiny-records", slot_id=acquire(s, "tiny-records").slot_id,
            group=make_group("g", GROUP, tokens=50)), timeout=10),
         grpc.StatusCode.RESOURCE_EXHAUSTED, "byte limit"),
        (lambda s: s.SetVersion(buffer_pb2.SetVersionRequest(job="eta4", version=-1), timeout=10),
         grpc.StatusCode.INVALID_ARGUMENT, "version must be >= 0"),
        (lambda s: s.SetVersion(buffer_pb2.SetVersionRequest(job="eta4", version=1,
                                                             trainer_step=-1), timeout=10),
         grpc.StatusCode.INVALID_ARGUMENT, "trainer_step must be >= 0"),
        (lambda s: s.PutGroup(buffer_pb2.PutGroupRequest(
            job="eta4", slot_id="never-granted", group=make_group("g", GROUP)), timeout=10),
         grpc.StatusCode.FAILED_PRECONDITION, "never granted"),
        (lambda s: get_batch(s, "eta4", consumer=""), grpc.StatusCode.INVALID_ARGUMENT,
         "consumer is empty"),
        (lambda s: get_batch(s, "no-such-job", "t"), grpc.StatusCode.NOT_FOUND, "unknown job"),
    ],
)
def test_bad_requests_get_clear_errors_and_change_nothing(stub, call, code, message):
    before = stats(stub, "eta4")
    with pytest.raises(grpc.RpcError) as error:
        call(stub)
    assert error.value.code() == code and message in error.value.details()
    after = stats(stub, "eta4")
    assert (after.accepted_total, after.depth_groups, after.trainer_version) == (
        before.accepted_total, before.depth_groups, before.trainer_version)


def _mismatched():
    group = make_group("g", GROUP)
    group.samples[1].token_versions.append(0)
    return group


def test_a_put_can_grant_the_next_slot_in_the_same_round_trip(stub):
    """A worker that starts another group after each put asks for that slot with the put: the
    gate grants it by the same rule as AcquireSlot, and refuses it when shut."""
    job = "capped"  # 3 slots at once; staleness bound (4 + 0 + 1) * 2 = 10 groups

    def put_next(slot_id, group_id):
        return stub.PutGroup(buffer_pb2.PutGroupRequest(
            job=job, slot_id=slot_id, group=make_group(group_id, GROUP), acquire_next=True,
            worker="w"), timeout=10)

    held = [acquire(stub, job).slot_id for _ in range(3)]
    assert not acquire(stub, job).granted  # the concurrency limit binds
    reply = put_next(held.pop(0), "g0")  # frees one slot, and takes it at once
    assert reply.accepted and reply.next_slot.granted and reply.next_slot.slot_id.startswith("w:")
    assert stats(stub, job).running_slots == 3
    held.append(reply.next_slot.slot_id)
    plain = stub.PutGroup(buffer_pb2.PutGroupRequest(
        job=job, slot_id=held.pop(0), group=make_group("g1", GROUP)), timeout=10)
    assert not plain.HasField("next_slot") and stats(stub, job).running_slots == 2
    for index, slot_id in enumerate(held, start=2):
        put(stub, job, slot_id, f"g{index}")
    for index in range(4, 9):
        put(stub, job, acquire(stub, job).slot_id, f"g{index}")
    reply = put_next(acquire(stub, job).slot_id, "g9")  # the tenth group: the bound is reached
    assert reply.accepted and not reply.next_slot.granted
    assert reply.next_slot.reason == "staleness" and stats(stub, job).accepted_total == 10


def test_group_bytes_live_from_put_until_ack_or_drop(stub, redis_server):
    """A group's bytes sit beside its stream entry; an acknowledgement or a stale drop
    deletes them, and a refused put leaves none behind."""
    import redis

    from asyncrl.platform.redis_keys import key

    client = redis.Redis.from_url(redis_server.url)

    def stored(job):
        return sorted(k.decode() for k in client.scan_iter(key(job, "group:") + "*"))

    job = "eta1"
    with pytest.raises(grpc.RpcError):
        put(stub, job, "never-granted", "refused")
    assert stored(job) == []
    for index in range(BATCH):
        put(stub, job, acquire(stub, job).slot_id, f"old{index}", version=0)
    assert len(stored(job)) == BATCH
    batch = get_batch(stub, job, "t")
    assert [g.group_id for g in batch.groups] == ["old0", "old1", "old2"]
    stub.AckBatch(buffer_pb2.AckBatchRequest(job=job, batch_id=batch.batch_id), timeout=10)
    assert stored(job) == []
    for index in range(BATCH):
        put(stub, job, acquire(stub, job).slot_id, f"stale{index}", version=0)
    stub.SetVersion(buffer_pb2.SetVersionRequest(job=job, version=3, weights_uri="/w/3"),
                    timeout=10)
    wait = get_batch(stub, job, "t", wait_ms=100)
    assert wait.dropped_stale == BATCH and stored(job) == []
    client.close()


def test_put_groups_answers_each_put_on_its_own(stub):
    """Each message on the PutGroups stream is answered in turn, each put on its own; one the
    buffer cannot take at all ends the call with its status."""
    job = "eta4"
    good = acquire(stub, job).slot_id
    first = buffer_pb2.PutGroupsRequest(puts=[
        buffer_pb2.PutGroupRequest(job=job, slot_id=good, group=make_group("ok", GROUP),
                                   acquire_next=True, worker="w"),
        buffer_pb2.PutGroupRequest(job=job, slot_id="never-granted",
                                   group=make_group("lost", GROUP)),
        buffer_pb2.PutGroupRequest(job=job, slot_id=acquire(stub, job).slot_id,
                                   group=make_group("short", GROUP - 1)),
    ])
    retry = buffer_pb2.PutGroupsRequest(puts=[
        buffer_pb2.PutGroupRequest(job=job, slot_id=good, group=make_group("ok", GROUP))])
    replies = list(stub.PutGroups(iter([first, buffer_pb2.PutGroupsRequest(), retry]),
                                  timeout=10))
    assert len(replies) == 3 and not replies[1].results  # an empty message, answered empty
    codes = [grpc.StatusCode.OK.value[0], grpc.StatusCode.FAILED_PRECONDITION.value[0],
             grpc.StatusCode.INVALID_ARGUMENT.value[0]]
    assert [r.code for r in replies[0].results] == codes
    assert replies[0].results[0].response.next_slot.granted and "never granted" in \
        replies[0].results[1].message and "groupSize" in replies[0].results[2].message
    (retried,) = replies[2].results
    assert retried.code == 0 and retried.response.accepted_total == 0  # accepted once only
    assert stats(stub, "eta4").accepted_total == 1
    two_jobs = buffer_pb2.PutGroupsRequest(puts=[
        buffer_pb2.PutGroupRequest(job=job), buffer_pb2.PutGroupRequest(job="eta0")])
    for ending in (two_jobs, buffer_pb2.PutGroupsRequest(puts=[
            buffer_pb2.PutGroupRequest(job="no-such-job")])):
        with pytest.raises(grpc.RpcError) as error:
            list(stub.PutGroups(iter([retry, ending, retry]), timeout=10))
        assert error.value.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                      grpc.StatusCode.NOT_FOUND)
        assert "different jobs" in error.value.details() or "no-such-job" in \
            error.value.details()


def test_a_clients_puts_that_meet_go_in_one_round_trip(buffer):
    """A client's puts go as messages on one PutGroups call; puts made while a message is on
    its way (or at once) go together in the next; each caller gets its own answer, as its own
    PutGroup would have given it."""
    import asyncio

    from asyncrl.clients.buffer import BufferClient

    async def scenario():
        client = BufferClient(buffer.address, "eta4", "w")
        sent, calls = [], set()
        original = client._put_stream.send

        async def counting(request, **kwargs):
            sent.append(len(request.puts))
            reply = await original(request, **kwargs)
            calls.add(id(client._put_stream._call))
            return reply

        client._put_stream.send = counting
        slots = [await client.acquire() for _ in range(5)]
        outcomes = await asyncio.gather(
            *(client.put(slot, make_group(f"g{i}", GROUP), acquire_next=True)
              for i, slot in enumerate(slots[:4])),
            client.put(slots[0], make_group("g0", GROUP)),   # a retry: accepted once
            return_exceptions=True)
        bad = await asyncio.gather(client.put(slots[4], make_group("bad", GROUP + 1)),
                                   return_exceptions=True)
        stats_reply = await client.stats()
        await client.close()
        return sent, calls, outcomes, bad[0], stats_reply

    sent, calls, outcomes, bad, snapshot = asyncio.run(scenario())
    assert sent == [5, 1]  # the five made at once went together, then the lone one
    assert len(calls) == 1  # both on one call: a refused put does not end it
    assert all(slot is not None for slot in outcomes[:4]) and outcomes[4] is None
    assert isinstance(bad, grpc.aio.AioRpcError)
    assert bad.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert snapshot.accepted_total == 4


def test_a_clients_puts_past_the_message_bound_go_in_several_messages(buffer, monkeypatch):
    """Puts that meet go together only up to PUT_MESSAGE_BYTES of groups per message (a
    worker with many long groups under way once built one past gRPC's limit, and every put
    failed): the rest follow in the next messages, each put accepted once."""
    import asyncio

    from asyncrl.clients import buffer as client_module
    from asyncrl.clients.buffer import BufferClient
    from asyncrl.platform.grpc_service import DEFAULT_MESSAGE_BYTES

    assert client_module.PUT_MESSAGE_BYTES <= DEFAULT_MESSAGE_BYTES // 2
    group_bytes = len(make_group("g0", GROUP).SerializeToString())
    monkeypatch.setattr(client_module, "PUT_MESSAGE_BYTES", 2 * group_bytes + 1)

    async def scenario():
        client = BufferClient(buffer.address, "eta4", "w")
        sent = []
        original = client._put_stream.send

        async def counting(request, **kwargs):
            sent.append(len(request.puts))
            return await original(request, **kwargs)

        client._put_stream.send = counting
        slots = [await client.acquire() for _ in range(5)]
        await asyncio.gather(*(client.put(slot, make_group(f"g{i}", GROUP))
                               for i, slot in enumerate(slots)))
        stats_reply = await client.stats()
        await client.close()
        return sent, stats_reply

    sent, snapshot = asyncio.run(scenario())
    assert sent == [2, 2, 1]
    assert snapshot.accepted_total == 5


def test_puts_of_many_callers_at_once_go_in_one_transaction(redis_server):
    """Puts that meet in the buffer, from different workers' requests, go to Redis together:
    one MULTI/EXEC for all of them, each answered on its own and each group stored."""
    import asyncio

    import redis as sync_redis
    import redis.asyncio as aredis

    from asyncrl.buffer.store import BufferStore, FailedPrecondition
    from asyncrl.platform.redis_keys import key

    job = JobConfig(name="meet", max_staleness=4, batch_size=BATCH, group_size=GROUP)
    inspect = sync_redis.Redis.from_url(redis_server.url)

    def encoded(group_id):
        return make_group(group_id, GROUP).SerializeToString()

    def calls(command):
        return inspect.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)

    async def scenario():
        client = aredis.from_url(redis_server.url)
        store = BufferStore(client, [job])
        await store.register()
        slots = [(await store.acquire_slot(job.name, f"w{i}")).slot_id for i in range(11)]
        await store.put_group(job.name, slots.pop(), "first", 0, encoded("first"))  # loads PUT
        before = calls("exec"), calls("evalsha")
        outcomes = await asyncio.gather(
            *(store.put_group(job.name, slot, f"g{i}", 0, encoded(f"g{i}"))
              for i, slot in enumerate(slots)),
            store.put_group(job.name, slots[0], "g0", 0, encoded("g0")),  # a retry
            store.put_group(job.name, "never-granted", "x", 0, encoded("x")),
            return_exceptions=True)
        after = calls("exec"), calls("evalsha")
        stored = [await client.get(key(job.name, f"group:{slot}")) for slot in slots]
        stats = await store.stats(job.name)
        await client.aclose()
        return outcomes, [b - a for a, b in zip(before, after)], stored, stats

    outcomes, (sent, scripts_run), stored, stats = asyncio.run(scenario())
    assert sent == 1
    assert scripts_run == 1  # one PUT script run for all the puts of a transaction
    assert all(o.newly_accepted for o in outcomes[:10])
    assert sorted(o.accepted_total for o in outcomes[:10]) == list(range(2, 12))
    assert not outcomes[10].newly_accepted
    assert isinstance(outcomes[11], FailedPrecondition)
    assert stored == [encoded(f"g{i}") for i in range(10)]
    assert stats.accepted_total == 11 and stats.depth_groups == 11


def test_puts_of_two_jobs_that_meet_each_land_in_their_own_job(redis_server):
    """One transaction carries puts of two jobs (one PUT script run per job); each put is
    answered for its own slot, even when Redis lost its scripts (SCRIPT FLUSH: a restart
    without them), which the buffer loads again without storing any group twice."""
    import asyncio

    import redis.asyncio as aredis

    from asyncrl.buffer.store import BufferStore, FailedPrecondition
    from asyncrl.platform.redis_keys import key

    jobs = [JobConfig(name=name, max_staleness=4, batch_size=BATCH, group_size=GROUP)
            for name in ("left", "right")]

    async def scenario():
        client = aredis.from_url(redis_server.url)
        store = BufferStore(client, jobs)
        await store.register()
        slots = {job.name: [(await store.acquire_slot(job.name, "w")).slot_id for _ in range(3)]
                 for job in jobs}
        await client.script_flush()
        puts = [(name, slot, f"{name}{i}") for i in range(3) for name, names_slots in
                slots.items() for slot in names_slots[i:i + 1]]
        outcomes = await asyncio.gather(
            *(store.put_group(name, slot, group_id, 0,
                              make_group(group_id, GROUP).SerializeToString())
              for name, slot, group_id in puts),
            store.put_group("right", slots["left"][0], "wrong-job", 0,
                            make_group("wrong-job", GROUP).SerializeToString()),
            return_exceptions=True)
        streams = {job.name: [fields[b"id"].decode() for _, fields in
                              await client.xrange(key(job.name, "groups"))] for job in jobs}
        totals = {job.name: (await store.stats(job.name)).accepted_total for job in jobs}
        await client.aclose()
        return puts, outcomes, streams, totals

    puts, outcomes, streams, totals = asyncio.run(scenario())
    for (name, _, _), outcome in zip(puts, outcomes):
        assert outcome.newly_accepted, (name, outcome)
    assert isinstance(outcomes[-1], FailedPrecondition)  # a left slot is unknown to right
    assert streams == {"left": ["left0", "left1", "left2"],
                       "right": ["right0", "right1", "right2"]}
    assert totals == {"left": 3, "right": 3}


def test_a_batch_read_partly_ahead_holds_each_groups_own_bytes(redis_server):
    """The next batch's groups are read while the trainer holds this one; groups put after
    that read are read with the batch. Every entry carries the bytes put for its group."""
    import asyncio

    import redis.asyncio as aredis

    from asyncrl.buffer.store import BufferStore

    job = JobConfig(name="ahead", max_staleness=4, batch_size=BATCH, group_size=GROUP)

    async def scenario():
        client = aredis.from_url(redis_server.url)
        store = BufferStore(client, [job])
        await store.register()

        async def put(name):
            slot = (await store.acquire_slot(job.name, "w")).slot_id
            group = make_group(name, GROUP, tokens=len(name)).SerializeToString()
            await store.put_group(job.name, slot, name, 0, group)
            return name, group

        sent = dict([await put(f"g{i}") for i in range(BATCH + 1)])
        first = await store.get_batch(job.name, "t", BATCH, 1000)  # reads g3 ahead
        await store._ahead[job.name]  # that read done, however slow: the late puts come after it
        sent.update([await put(f"late{i}") for i in range(BATCH - 1)])
        await store.ack_batch(job.name, first.batch_id)
        second = await store.get_batch(job.name, "t", BATCH, 1000)
        await client.aclose()
        return sent, first, second

    sent, first, second = asyncio.run(scenario())
    assert [e.group_id for e in second.entries] == ["g3", "late0", "late1"]
    for entry in first.entries + second.entries:
        assert entry.group_bytes == sent[entry.group_id]
