"""The buffer's domain operations over Redis (async). The gRPC servicer only translates
protobuf to these calls; every state change is one atomic script (see scripts.py)."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

import redis.asyncio as redis

from asyncrl.buffer import scripts
from asyncrl.redis_keys import key, prefix, weights_channel, weights_key
from asyncrl.weights import WeightVersion

CONSUMER_GROUP = "trainer"


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
    lease_seconds: float = 30.0
    ack_timeout_seconds: float = 300.0
    max_group_bytes: int = 32 << 20

    @classmethod
    def from_job(cls, job) -> JobConfig:
        spec = job.spec
        return cls(
            name=job.metadata.name,
            max_staleness=spec.algorithm.max_staleness,
            batch_size=spec.algorithm.batch_size,
            group_size=spec.algorithm.group_size,
            max_concurrent=spec.rollout.max_concurrent_rollouts,
            lease_seconds=spec.buffer.lease_seconds,
            ack_timeout_seconds=spec.buffer.ack_timeout_seconds,
        )


@dataclass(frozen=True)
class SlotGrant:
    granted: bool
    slot_id: str = ""
    lease_expires_unix_ms: int = 0
    reason: str = ""


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


class BufferStore:
    def __init__(self, client: redis.Redis, jobs: list[JobConfig]):
        self._client = client
        self._jobs = {job.name: job for job in jobs}
        self._scripts = {
            name: client.register_script(getattr(scripts, name))
            for name in ("ACQUIRE", "HEARTBEAT", "RELEASE", "PUT", "GET_BATCH", "ACK", "SET_VERSION")
        }

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
                "lease_ms": int(job.lease_seconds * 1000),
                "ack_timeout_ms": int(job.ack_timeout_seconds * 1000),
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

    async def acquire_slot(self, job_name: str, worker: str) -> SlotGrant:
        job = self.job(job_name)
        if not worker:
            raise InvalidArgument("worker is empty; name the rollout worker (e.g. its pod name)")
        slot_id = f"{worker}:{uuid.uuid4().hex[:12]}"
        reply = await self._run("ACQUIRE", job, slot_id)
        if reply[0] == -1:
            raise NotFound(f"job {job_name!r} is not registered in Redis; restart the buffer")
        if reply[0] == 0:
            return SlotGrant(False, reason=_text(reply[1]))
        return SlotGrant(True, slot_id, int(reply[1]))

    async def heartbeat(self, job_name: str, slot_id: str) -> tuple[bool, int]:
        reply = await self._run("HEARTBEAT", self.job(job_name), _required(slot_id, "slot_id"))
        return (True, int(reply[1])) if reply[0] == 1 else (False, 0)

    async def release_slot(self, job_name: str, slot_id: str) -> bool:
        return bool(await self._run("RELEASE", self.job(job_name), _required(slot_id, "slot_id")))

    async def put_group(
        self, job_name: str, slot_id: str, group_id: str, oldest_version: int, group_bytes: bytes
    ) -> tuple[bool, int]:
        """Stores a validated group under its slot. Returns (newly accepted, accepted total);
        a retry of a put that already succeeded returns (False, 0) and changes nothing."""
        job = self.job(job_name)
        if len(group_bytes) > job.max_group_bytes:
            raise ResourceExhausted(
                f"group is {len(group_bytes)} bytes, over the {job.max_group_bytes}-byte limit; "
                "lower rollout.maxNewTokens or algorithm.groupSize"
            )
        reply = await self._run("PUT", job, _required(slot_id, "slot_id"), group_bytes,
                                oldest_version, group_id)
        if reply[0] == 0:
            raise FailedPrecondition(
                f"slot {slot_id!r} is {_text(reply[1])}: its lease expired or it was never "
                "granted; acquire a new slot (heartbeat more often than buffer.leaseSeconds)"
            )
        return (reply[0] == 1, int(reply[2]) if reply[0] == 1 else 0)

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
                return Batch(_text(reply[1]), _entries(reply[2]), dropped, redelivered=True)
            if kind == "new":
                return Batch(_text(reply[1]), _entries(reply[2]), dropped + int(reply[3]))
            dropped += int(reply[1])
            if time.monotonic() >= deadline:
                return Batch(dropped_stale=dropped)
            await asyncio.sleep(0.02)

    async def ack_batch(self, job_name: str, batch_id: str) -> bool:
        reply = await self._run("ACK", self.job(job_name), _required(batch_id, "batch_id"))
        if reply[0] == 0:
            raise NotFound(f"batch {batch_id!r} is not outstanding; ask GetBatch for a batch")
        return True

    async def set_version(self, job_name: str, version: int, uri: str,
                          step: int = 0) -> WeightVersion:
        job = self.job(job_name)
        if version < 0:
            raise InvalidArgument(f"version must be >= 0, got {version}")
        if step < 0:
            raise InvalidArgument(f"trainer_step must be >= 0, got {step}")
        reply = await self._run("SET_VERSION", job, version, uri, weights_channel(job.name), step)
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
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.hgetall(key(job.name, "state"))
            pipe.zcount(key(job.name, "slots"), now_ms, "+inf")
            pipe.llen(key(job.name, "staged"))
            pipe.hgetall(key(job.name, "staleness"))
            pipe.xinfo_groups(key(job.name, "groups"))
            state, running, staged, staleness, groups = await pipe.execute()
        state = {_text(k): int(v) for k, v in state.items()}
        lag = next((g.get("lag") or 0 for g in groups if _text(g["name"]) == CONSUMER_GROUP), 0)
        histogram = {int(k): int(v) for k, v in staleness.items()}
        counts = [histogram.get(i, 0) for i in range(max(histogram, default=-1) + 1)]
        return Stats(
            trainer_version=state.get("trainer_version", 0),
            trainer_step=state.get("trainer_step", 0),
            depth_groups=int(lag) + int(staged),
            running_slots=int(running),
            accepted_total=state.get("accepted", 0),
            consumed_total=state.get("consumed", 0),
            dropped_stale_total=state.get("dropped_stale", 0),
            redelivered_total=state.get("redelivered", 0),
            expired_slots_total=state.get("expired", 0),
            staleness_counts=counts,
        )


def _entries(raw) -> list[BatchEntry]:
    entries = []
    for stream_id, fields in raw:
        values = {_text(fields[i]): fields[i + 1] for i in range(0, len(fields), 2)}
        entries.append(BatchEntry(_text(stream_id), _text(values["id"]), int(values["v"]),
                                  bytes(values["g"])))
    return entries


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _required(value: str, name: str) -> str:
    if not value:
        raise InvalidArgument(f"{name} is empty")
    return value
