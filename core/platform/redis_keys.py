"""The Redis key layout of a job, in one place: every name the buffer's Lua scripts, the buffer
store and the weight announcements use.

All keys of a job start with `asyncrl:{<job>}:`; the braces put them in one Redis Cluster hash
slot, so a Lua script may touch any of them atomically. The scripts (asyncrl.buffer.scripts)
get that prefix as an argument and append the suffixes below, and Python code builds keys with
`key`; tests/buffer/test_redis_keys.py checks that neither uses a suffix this table does not declare.
"""

from __future__ import annotations

#: suffix -> what it holds. `<slot>`, `<id>`: filled in per slot or batch.
LAYOUT: dict[str, str] = {
    "config": "hash: max_staleness, batch_size, max_concurrent (0 = unlimited), oversample (groups "
              "the gate may start beyond its bound), lease_ms, "
              "ack_timeout_ms, epochs (0 = unlimited), prompts (training prompts per epoch, as "
              "the first rollout worker told it)",
    "state": "hash: trainer_version, trainer_step, trainer_finished, accepted, consumed, "
             "dropped_stale, redelivered, expired, skipped_uniform, cursor (the next new "
             "prompt cursor, asyncrl.data.prompt_order)",
    "slots": "zset: granted slot id -> lease expiry (ms, Redis clock)",
    "cursors": "hash: granted slot id -> the prompt cursor it was granted with",
    "reissue": "list: prompt cursors of lost slots, handed out again before new ones",
    "put:<slot>": "string: stream id of the group put with that slot (PutGroup retries are "
                  "idempotent)",
    "group:<slot>": "string: the encoded Group put with that slot, from its put until its "
                    "batch is acknowledged (or it is dropped as stale)",
    "groups": "stream: accepted groups (slot = the slot it was put with, v = oldest token "
              "version, id = group id, c = the slot's prompt cursor)",
    "staged": "list: stream ids read from `groups`, not yet in a batch, oldest first",
    "batches": "zset: batch id -> delivery time (ms)",
    "batch:<id>": "list: stream ids of a delivered, unacknowledged batch",
    "owner": "hash: batch id -> consumer",
    "owned": "hash: consumer -> batch id",
    "acked:<id>": "string: marker of an acknowledged batch (AckBatch retries are idempotent)",
    "staleness": "hash: staleness at consumption -> number of groups",
    "weights": "hash: version, uri, updated_unix_ms of the newest weights (asyncrl.weights.announcements); "
               "also the pub/sub channel that announces each change",
}

#: The suffixes without their `<...>` part ("put:", "batch:", ...).
SUFFIXES = frozenset(name.split("<")[0] for name in LAYOUT)


def prefix(job: str) -> str:
    return f"asyncrl:{{{job}}}:"


def key(job: str, suffix: str) -> str:
    """The key `suffix` of `job`; `suffix` is one of LAYOUT's, with its `<...>` filled in."""
    base = suffix.split(":")[0] + ":" if ":" in suffix else suffix
    if base not in SUFFIXES:
        raise ValueError(f"{suffix!r} is not in the Redis key layout (asyncrl.platform.redis_keys)")
    return prefix(job) + suffix


def weights_key(job: str) -> str:
    return key(job, "weights")


def weights_channel(job: str) -> str:
    """Named as the hash it announces (a channel and a key never collide in Redis)."""
    return key(job, "weights")
