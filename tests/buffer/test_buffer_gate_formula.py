"""The staleness gate has one authority, the buffer's ACQUIRE script in Redis; the tests'
oracle `rollout_capacity` (support.gate_oracle) is the same formula over the same inputs. Both
are asked at many random states of a real Redis (trainer versions, accepted and dropped
groups, live and expired slots, concurrency caps) and must grant alike."""

from __future__ import annotations

import random

import redis

from asyncrl.buffer import scripts
from asyncrl.platform.redis_keys import key, prefix
from support.gate_oracle import rollout_capacity

STATES = 400


def random_state(rng: random.Random) -> dict[str, int]:
    eta, version, batch = rng.randint(0, 4), rng.randint(0, 20), rng.randint(1, 8)
    accepted = rng.randint(0, (eta + version + 2) * batch)
    return {
        "max_staleness": eta, "trainer_version": version, "batch_size": batch,
        "accepted": accepted, "dropped_stale": rng.choice([0, rng.randint(0, accepted)]),
        "running": rng.randint(0, 12), "expired": rng.randint(0, 3),
        "max_concurrent": rng.choice([0, rng.randint(1, 12)]),
        "oversample": rng.choice([0, rng.randint(1, 6)]),
    }


def lua_grants(client: redis.Redis, acquire, job: str, state: dict[str, int]) -> tuple[bool, str]:
    client.hset(key(job, "config"), mapping={
        "max_staleness": state["max_staleness"], "batch_size": state["batch_size"],
        "max_concurrent": state["max_concurrent"], "oversample": state["oversample"],
        "lease_ms": 30_000, "ack_timeout_ms": 60_000})
    client.hset(key(job, "state"), mapping={
        "trainer_version": state["trainer_version"], "accepted": state["accepted"],
        "dropped_stale": state["dropped_stale"]})
    seconds, micros = client.time()
    now_ms = seconds * 1000 + micros // 1000
    slots = {f"live-{i}": now_ms + 60_000 for i in range(state["running"])}
    slots |= {f"expired-{i}": now_ms - 1_000 for i in range(state["expired"])}  # lease ran out
    if slots:
        client.zadd(key(job, "slots"), slots)
    reply = acquire(keys=[key(job, "state")], args=[prefix(job), "probe"])
    return reply[0] == 1, (reply[1].decode() if reply[0] == 0 else "")


def test_the_lua_gate_and_the_python_formula_grant_alike_at_random_states(redis_server):
    client = redis.Redis.from_url(redis_server.url)
    acquire = client.register_script(scripts.ACQUIRE)
    rng = random.Random(20261123)
    granted = refused = 0
    for index in range(STATES):
        state = random_state(rng)
        lua, reason = lua_grants(client, acquire, f"gate-{index}", state)
        inputs = {k: v for k, v in state.items() if k != "expired"}  # Redis drops those
        python = rollout_capacity(**inputs) > 0
        assert lua == python, state
        if not lua:  # the reason names the limit that binds, staleness first
            staleness_bound = rollout_capacity(**{**inputs, "max_concurrent": 0})
            assert reason == ("staleness" if staleness_bound == 0 else "concurrency"), state
        granted, refused = granted + lua, refused + (not lua)
    # The random states reach both answers often, so the agreement means something.
    assert granted > STATES // 5 and refused > STATES // 5
