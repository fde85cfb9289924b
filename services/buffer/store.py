"""The buffer's domain operations over Redis (async). The gRPC servicer only translates
protobuf to these calls; every state change is one atomic script (see scripts.py), a put's
together with the SET of its group's bytes in one transaction (shared with the puts that
arrived meanwhile)."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

import redis.asyncio as redis
from redis.exceptions import NoScriptError

from asyncrl.buffer import scripts
from asyncrl.platform.coalesce import Coalescer
from asyncrl.data.prompt_order import epoch_of
from asyncrl.platform.redis_keys import key, prefix, weights_channel, weights_key
from asyncrl.weights.announcements import WeightVersion

CONSUMER_GROUP = "trainer"
#: Bytes of groups one replica has on their way into Redis at once, in at most WRITE_ROUNDS
#: transactions. With appendfsync always, Redis writes and syncs everything a turn of its event
#: loop took in before it answers anyone: a turn that took in a hundred groups of long samples
#: would keep the trainer and the gate waiting for hundreds of milliseconds. Puts past it wait
#: their turn here instead. Two transactions of at most 4 MB each: one is packed while the other
#: is in Redis (8k-token groups, 8 under way per worker: 15% of redis-benchmark against 11% for
#: one of 16 MB).
WRITE_BYTES = 8 << 20
WRITE_ROUNDS = 2
#: How long a group's bytes live when the PUT script never ran to keep or delete them (its
#: transaction failed): a put retried within it finds them again.
ORPHAN_SECONDS = 3600
#: Connections a batch's groups are read over at once: half of the pool's
#: (outage.MAX_CONNECTIONS), so that puts keep the other half meanwhile.
READ_CONNECTIONS = 32


class BufferError(Exception):
    """Base of the errors a request can cause; each maps to one gRPC status code."""


class InvalidArgument(BufferError):
    pass


class NotFound(BufferError):
    pass


class FailedPrecondition(BufferError):
    pass


class ResourceExhausted(BufferError):
    pass


@dataclass(frozen=True)
class JobConfig:
    """What the gate and batching need to know about a job (from its RLJob spec)."""

    name: str
    max_staleness: int
    batch_size: int
    group_size: int
    max_concurrent: int | None = None
    oversample_groups: int = 0
    lease_seconds: float = 30.0
    ack_timeout_seconds: float = 300.0
    max_group_bytes: int = 32 << 20
    # dataset.epochs: the prompt cursor ends at N x epochs (None: no end). N itself comes
    # from the rollout workers (scripts._GRANT says why).
    epochs: int | None = None

    @classmethod
    def from_job(cls, job) -> JobConfig:
        spec = job.spec
        return cls(
            name=job.metadata.name,
            max_staleness=spec.algorithm.max_staleness,
            batch_size=spec.algorithm.batch_size,
            group_size=spec.algorithm.group_size,
            max_concurrent=spec.rollout.max_concurrent_rollouts,
            oversample_groups=spec.algorithm.oversample_groups,
            lease_seconds=spec.buffer.lease_seconds,
            ack_timeout_seconds=spec.buffer.ack_timeout_seconds,
            epochs=spec.dataset.epochs,
        )


@dataclass(frozen=True)
class SlotGrant:
    granted: bool
    slot_id: str = ""
    lease_expires_unix_ms: int = 0
    reason: str = ""
    prompt_cursor: int = 0


@dataclass(frozen=True)
class Put:
    """A checked group to store under the slot it was generated in."""

    slot_id: str
    group_id: str
    oldest_version: int
    group_bytes: bytes
    next_worker: str | None = None   # also ask the gate for this worker's next slot
    prompts: int = 0                 # that worker's training prompts (AcquireSlotRequest)


@dataclass(frozen=True)
class PutResult:
    newly_accepted: bool      # False for a retry of a put that already succeeded
    accepted_total: int       # 0 for such a retry
    next_slot: SlotGrant | None = None


@dataclass(frozen=True)
class BatchEntry:
    stream_id: str
    group_id: str
    oldest_version: int
    group_bytes: bytes


@dataclass(frozen=True)
class Batch:
    batch_id: str = ""
    entries: list[BatchEntry] = field(default_factory=list)
    dropped_stale: int = 0
    redelivered: bool = False


@dataclass(frozen=True)
class Stats:
    trainer_version: int
    trainer_step: int
    depth_groups: int
    running_slots: int
    accepted_total: int
    consumed_total: int
    dropped_stale_total: int
    redelivered_total: int
    expired_slots_total: int
    staleness_counts: list[int]
    skipped_uniform_total: int = 0
    prompt_cursor: int = 0
    prompts_per_epoch: int = 0
    epochs: int = 0
    epoch: int = 0
    prompts_to_reissue: int = 0
    dataset_used_up: bool = False
    outstanding_batches: int = 0
    trainer_finished: bool = False


class BufferStore:
    def __init__(self, client: redis.Redis, jobs: list[JobConfig]):
        self._client = client
        self._jobs = {job.name: job for job in jobs}
        # Puts of all callers that arrive while WRITE_ROUNDS transactions are on their way go
        # together in the next: one round trip and one sync for many.
        self._puts = Coalescer(self._write_puts, rounds=WRITE_ROUNDS,
                               limit=WRITE_BYTES // WRITE_ROUNDS,
                               weight=lambda todo: len(todo[1].group_bytes))
        self._ahead: dict[str, asyncio.Task] = {}   # job -> the next batch's groups, by slot
        self._scripts = {
            name: client.register_script(getattr(scripts, name))
            for name in ("ACQUIRE", "HEARTBEAT", "RELEASE", "PUT", "GET_BATCH", "ACK", "SET_VERSION",
                         "PROGRESS")
        }

    def close(self) -> None:
        """Cancels the writes on their way; their puts' callers get CancelledError."""
        self._puts.close()

    async def registered(self) -> bool:
        """Whether Redis holds every job's gate settings (a Redis restarted without its files,
        `persistence: none`, comes back empty)."""
        return all([await self._client.exists(key(job.name, "config"))
                    for job in self._jobs.values()])

    async def register(self) -> None:
        """Writes each job's gate settings and creates its stream's consumer group."""
        for job in self._jobs.values():
            await self._client.hset(key(job.name, "config"), mapping={
                "max_staleness": job.max_staleness,
                "batch_size": job.batch_size,
                "max_concurrent": job.max_concurrent or 0,
                "oversample": job.oversample_groups,
                "lease_ms": int(job.lease_seconds * 1000),
                "ack_timeout_ms": int(job.ack_timeout_seconds * 1000),
                "epochs": job.epochs or 0,
            })
            try:
                await self._client.xgroup_create(key(job.name, "groups"), CONSUMER_GROUP, id="0",
                                                 mkstream=True)
            except redis.ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    def job(self, name: str) -> JobConfig:
        if not name:
            raise InvalidArgument("job is empty; name the RLJob (metadata.name)")
        try:
            return self._jobs[name]
        except KeyError:
            raise NotFound(
                f"unknown job {name!r}; this buffer serves {sorted(self._jobs)}"
            ) from None

    async def _run(self, script: str, job: JobConfig, *args):
        return await self._scripts[script](keys=[key(job.name, "state")],
                                           args=[prefix(job.name), *args])

    # ------------------------------------------------------------------ rollout side

    async def acquire_slot(self, job_name: str, worker: str, prompts: int = 0) -> SlotGrant:
        """A slot and its prompt cursor, if the gate allows; `prompts`: the worker's N."""
        job = self.job(job_name)
        slot_id = _new_slot_id(worker)
        return _grant(job, slot_id, await self._run("ACQUIRE", job, slot_id, _prompts(prompts)))

    async def heartbeat(self, job_name: str, slot_id: str) -> tuple[bool, int]:
        reply = await self._run("HEARTBEAT", self.job(job_name), _required(slot_id, "slot_id"))
        return (True, int(reply[1])) if reply[0] == 1 else (False, 0)

    async def release_slot(self, job_name: str, slot_id: str, *, uniform_rewards: bool = False,
                           prompt_used: bool = False) -> bool:
        """Gives a slot back without a group; `uniform_rewards`: its group was generated and
        dropped by the worker, every reward equal (counted once, by the release that frees the
        slot). Its prompt is handed out again unless it was skipped so or `prompt_used`."""
        return bool(await self._run("RELEASE", self.job(job_name), _required(slot_id, "slot_id"),
                                    "1" if uniform_rewards else "", "1" if prompt_used else ""))

    async def put_group(
        self, job_name: str, slot_id: str, group_id: str, oldest_version: int,
        group_bytes: bytes, next_worker: str | None = None, prompts: int = 0,
    ) -> PutResult:
        """One put of `put_groups`; its refusal raised."""
        (outcome,) = await self.put_groups(
            job_name, [Put(slot_id, group_id, oldest_version, group_bytes, next_worker, prompts)])
        if isinstance(outcome, BufferError):
            raise outcome
        return outcome

    async def put_groups(self, job_name: str, puts: list[Put]) -> list[PutResult | BufferError]:
        """Stores checked groups under their slots in one transaction, each accepted or refused
        on its own; a retry of a put that already succeeded changes nothing. A put with a
        `next_worker` also asks the gate for that worker's next slot, in the same round trip."""
        job = self.job(job_name)
        outcomes: list[PutResult | BufferError | None] = [None] * len(puts)
        todo = []
        for index, put in enumerate(puts):
            try:
                _required(put.slot_id, "slot_id")
                if len(put.group_bytes) > job.max_group_bytes:
                    raise ResourceExhausted(
                        f"group is {len(put.group_bytes)} bytes, over the "
                        f"{job.max_group_bytes}-byte limit; lower rollout.maxNewTokens or "
                        "algorithm.groupSize"
                    )
                next_slot = _new_slot_id(put.next_worker) if put.next_worker is not None else ""
                _prompts(put.prompts)
            except BufferError as exc:
                outcomes[index] = exc
                continue
            todo.append((index, put, next_slot))
        replies = await self._puts.submit_all([(job, put, next_slot)
                                               for _, put, next_slot in todo])
        for (index, put, next_slot), reply in zip(todo, replies):
            if reply[0] == 0:
                outcomes[index] = FailedPrecondition(
                    f"slot {put.slot_id!r} is {_text(reply[1])}: its lease expired or it was "
                    "never granted; acquire a new slot (heartbeat more often than "
                    "buffer.leaseSeconds)"
                )
            else:
                try:
                    outcomes[index] = PutResult(
                        reply[0] == 1, int(reply[2]),
                        _grant(job, next_slot, reply[3]) if next_slot else None)
                except BufferError as exc:  # the put was taken; its worker counts other prompts
                    outcomes[index] = exc
        return outcomes

    async def _write_puts(self, todo: list[tuple[JobConfig, Put, str]]) -> list:
        """For each put its group's bytes (SET, kept only if PUT accepts them), and one PUT
        script run per job for all its puts, all in one transaction: one round trip, and the
        bytes never pass through Lua (scripts.py). Each put's reply from the PUT script."""
        script = self._scripts["PUT"]
        by_job: dict[str, list[int]] = {}   # job -> its puts' places in `todo`
        for index, (job, _, _) in enumerate(todo):
            by_job.setdefault(job.name, []).append(index)
        for attempt in range(2):
            async with self._client.pipeline(transaction=True) as pipe:
                for job, put, _ in todo:
                    pipe.set(key(job.name, f"group:{put.slot_id}"), put.group_bytes, nx=True,
                             ex=ORPHAN_SECONDS)
                for name, places in by_job.items():
                    args = []
                    for place in places:
                        _, put, next_slot = todo[place]
                        args += (put.slot_id, put.oldest_version, put.group_id, next_slot,
                                 put.prompts)
                    pipe.evalsha(script.sha, 1, key(name, "state"), prefix(name), *args)
                try:
                    per_job = (await pipe.execute())[len(todo):]
                except NoScriptError:  # a Redis restarted without its scripts
                    if attempt:
                        raise
                    await self._client.script_load(script.script)
                    continue
            replies: list = [None] * len(todo)
            for places, job_replies in zip(by_job.values(), per_job):
                for place, reply in zip(places, job_replies):
                    replies[place] = reply
            return replies

    # ------------------------------------------------------------------ trainer side

    async def get_batch(self, job_name: str, consumer: str, num_groups: int, wait_ms: int) -> Batch:
        """A batch of `num_groups` whole groups, oldest first (or this consumer's unacknowledged
        one again); an empty Batch if not enough groups arrived within `wait_ms`."""
        job = self.job(job_name)
        _required(consumer, "consumer")
        if num_groups <= 0:
            num_groups = job.batch_size
        deadline = time.monotonic() + max(wait_ms, 0) / 1000
        dropped = 0
        while True:
            reply = await self._run("GET_BATCH", job, consumer, num_groups, uuid.uuid4().hex)
            kind = _text(reply[0])
            if kind == "redelivered":
                return Batch(_text(reply[1]), await self._entries(job, reply[2]), dropped,
                             redelivered=True)
            if kind == "new":
                batch = Batch(_text(reply[1]), await self._entries(job, reply[2]),
                              dropped + int(reply[3]))
                ahead = asyncio.create_task(self._read_ahead(job, num_groups))
                # A read ahead that fails (Redis going away) is just not used.
                ahead.add_done_callback(lambda task: task.cancelled() or task.exception())
                self._ahead[job.name] = ahead
                return batch
            dropped += int(reply[1])
            if time.monotonic() >= deadline:
                return Batch(dropped_stale=dropped)
            await asyncio.sleep(0.02)

    async def _entries(self, job: JobConfig, raw) -> list[BatchEntry]:
        """A batch's stream entries with their groups' bytes."""
        fields = [{_text(f[i]): f[i + 1] for i in range(0, len(f), 2)} for _, f in raw]
        ahead = self._ahead.pop(job.name, None)
        try:
            read = await ahead if ahead is not None else {}
        except Exception:  # noqa: BLE001 - only a guess: read them now
            read = {}
        slots = [_text(f["slot"]) if "slot" in f else None for f in fields]
        missing = [slot for slot in slots if slot is not None and slot not in read]
        read.update(zip(missing, await self._read_groups(job, missing)))
        groups = [f["g"] if slot is None else read.get(slot) for f, slot in zip(fields, slots)]
        if any(group is None for group in groups):
            # Only an acknowledgement deletes a delivered group's bytes: this batch was taken
            # over past its ack timeout and acknowledged meanwhile.
            raise FailedPrecondition("the batch was acknowledged while it was read; ask again")
        return [BatchEntry(_text(stream_id), _text(f["id"]), int(f["v"]), group)
                for (stream_id, _), f, group in zip(raw, fields, groups)]

    async def _read_groups(self, job: JobConfig, slots: list[str]) -> list[bytes | None]:
        """The bytes of the groups put with `slots` (None where deleted), in at most
        READ_CONNECTIONS MGETs side by side: Redis writes at most 64 KB of replies per
        connection and turn of its event loop, so a whole batch on one connection would take
        a turn (and, with appendfsync always, a sync) per 64 KB. One MGET each, not a GET per
        group: 20 us less of the buffer's CPU per 1k-token group."""
        if not slots:
            return []
        per = -(-len(slots) // READ_CONNECTIONS)

        async def read(part: list[str]) -> list[bytes | None]:
            return await self._client.mget([key(job.name, f"group:{slot}") for slot in part])

        parts = await asyncio.gather(*(read(slots[i:i + per]) for i in range(0, len(slots), per)))
        return [group for part in parts for group in part]

    async def _read_ahead(self, job: JobConfig, num_groups: int) -> dict[str, bytes]:
        """The bytes of the groups the trainer's next batch will most likely hold (the next
        `num_groups` the consumer group has not read), read while the trainer trains on this
        one, by slot. A group's bytes never change, so a guess read is right or unused."""
        stream = key(job.name, "groups")
        groups = await self._client.xinfo_groups(stream)
        last = next(_text(g["last-delivered-id"]) for g in groups
                    if _text(g["name"]) == CONSUMER_GROUP)
        entries = await self._client.xrange(stream, min=f"({last}", count=num_groups)
        slots = [_text(fields[b"slot"]) for _, fields in entries]
        read = await self._read_groups(job, slots)
        return {slot: data for slot, data in zip(slots, read) if data is not None}

    async def ack_batch(self, job_name: str, batch_id: str) -> bool:
        reply = await self._run("ACK", self.job(job_name), _required(batch_id, "batch_id"))
        if reply[0] == 0:
            raise NotFound(f"batch {batch_id!r} is not outstanding; ask GetBatch for a batch")
        return True

    async def set_version(self, job_name: str, version: int, uri: str, step: int = 0,
                          final: bool = False) -> WeightVersion:
        job = self.job(job_name)
        if version < 0:
            raise InvalidArgument(f"version must be >= 0, got {version}")
        if step < 0:
            raise InvalidArgument(f"trainer_step must be >= 0, got {step}")
        reply = await self._run("SET_VERSION", job, version, uri, weights_channel(job.name), step,
                                "1" if final else "")
        if reply[0] == 0:
            raise FailedPrecondition(
                f"version {version} is older than the trainer version {int(reply[1])}"
            )
        return WeightVersion(version, uri, int(reply[1]))

    async def get_version(self, job_name: str) -> WeightVersion:
        job = self.job(job_name)
        announced = WeightVersion.from_hash(await self._client.hgetall(weights_key(job.name)))
        return announced or WeightVersion(0, "", 0)

    async def stats(self, job_name: str) -> Stats:
        job = self.job(job_name)
        seconds, micros = await self._client.time()  # the clock the leases use
        now_ms = seconds * 1000 + micros // 1000
        # One transaction: the trainer decides from these figures together that the job is
        # done (no group can come any more, and too few wait for a batch).
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.hgetall(key(job.name, "state"))
            pipe.zcount(key(job.name, "slots"), now_ms, "+inf")
            pipe.hgetall(key(job.name, "staleness"))
            pipe.hget(key(job.name, "config"), "prompts")
            # Queued, not run (the pipeline loads the script first if Redis lacks it).
            await self._scripts["PROGRESS"](keys=[key(job.name, "state")],
                                            args=[prefix(job.name)], client=pipe)
            state, running, staleness, prompts, progress = await pipe.execute()
        state = {_text(k): int(v) for k, v in state.items()}
        depth, outstanding, cursor, _, reissue, _, used_up = map(int, progress)
        prompts = int(prompts or 0)
        histogram = {int(k): int(v) for k, v in staleness.items()}
        counts = [histogram.get(i, 0) for i in range(max(histogram, default=-1) + 1)]
        return Stats(
            trainer_version=state.get("trainer_version", 0),
            trainer_step=state.get("trainer_step", 0),
            depth_groups=depth,
            running_slots=int(running),
            accepted_total=state.get("accepted", 0),
            consumed_total=state.get("consumed", 0),
            dropped_stale_total=state.get("dropped_stale", 0),
            redelivered_total=state.get("redelivered", 0),
            expired_slots_total=state.get("expired", 0),
            staleness_counts=counts,
            skipped_uniform_total=state.get("skipped_uniform", 0),
            prompt_cursor=cursor,
            prompts_per_epoch=prompts,
            epochs=job.epochs or 0,
            epoch=epoch_of(cursor, prompts),
            prompts_to_reissue=reissue,
            dataset_used_up=bool(used_up),
            outstanding_batches=outstanding,
            trainer_finished=bool(state.get("trainer_finished", 0)),
        )


def _new_slot_id(worker: str) -> str:
    if not worker:
        raise InvalidArgument("worker is empty; name the rollout worker (e.g. its pod name)")
    return f"{worker}:{uuid.uuid4().hex[:12]}"


def _grant(job: JobConfig, slot_id: str, reply) -> SlotGrant:
    """A SlotGrant from the gate's answer (scripts._GRANT) for `slot_id`."""
    if reply[0] == -1:
        raise NotFound(f"job {job.name!r} is not registered in Redis; restart the buffer")
    if reply[0] == -2:
        raise FailedPrecondition(
            f"this worker has a different number of training prompts than job {job.name!r}'s "
            f"prompt cursor counts ({_text(reply[1])} per epoch): every rollout worker must "
            "build the same training prompts (same dataset spec, files and model tokenizer); "
            "a job whose dataset changed must start over (a new name, or its Redis state "
            "deleted)"
        )
    if reply[0] == 0:
        return SlotGrant(False, reason=_text(reply[1]))
    return SlotGrant(True, slot_id, int(reply[1]), prompt_cursor=int(reply[2]))


def _prompts(count: int) -> int:
    if count < 0:
        raise InvalidArgument(f"prompts must be >= 0, got {count}")
    return count


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _required(value: str, name: str) -> str:
    if not value:
        raise InvalidArgument(f"{name} is empty")
    return value
