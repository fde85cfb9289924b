"""Weight versions announced in a real Redis reach a real engine, including ones whose
messages were missed."""

import asyncio
import time

import redis.asyncio as redis
from safetensors.torch import save_model

from asyncrl.models import TinyModelConfig, build_tiny_model
from asyncrl.rollout.engine import TorchEngine
from asyncrl.rollout.weight_sync import WeightWatcher, engine_applier
from asyncrl.weights import WeightVersion, weights_channel, weights_key

JOB = "sync-test"


async def announce(client, version, uri, publish=True):
    await client.hset(weights_key(JOB), mapping=WeightVersion(version, uri, 1).to_hash())
    if publish:
        await client.publish(weights_channel(JOB), str(version))


async def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def test_announced_versions_reach_the_engine(redis_server, tmp_path):
    snapshots = []
    for version in (1, 2, 3):
        path = tmp_path / f"v{version}.safetensors"
        save_model(build_tiny_model(TinyModelConfig(seed=version), vocab_size=64), str(path))
        snapshots.append(path)
    engine = TorchEngine(build_tiny_model(TinyModelConfig(), vocab_size=64),
                         max_running_requests=2, max_sequence_length=32).start()

    async def scenario():
        client = redis.from_url(redis_server.url)
        apply = engine_applier(engine, tmp_path / "cache")
        # Announced before the worker started: caught up from the hash at once.
        await announce(client, 1, str(snapshots[0]))
        watcher = WeightWatcher(client, JOB, apply, poll_seconds=0.3)
        task = asyncio.create_task(watcher.run())
        await wait_for(lambda: engine.version == 1)
        # Announced with a message.
        await announce(client, 2, f"file://{snapshots[1]}")
        await wait_for(lambda: engine.version == 2)
        # Message lost: the periodic re-read still finds it.
        await announce(client, 3, str(snapshots[2]), publish=False)
        await wait_for(lambda: engine.version == 3)
        # An old announcement never moves the engine back.
        await announce(client, 1, str(snapshots[0]))
        await asyncio.sleep(0.5)
        assert engine.version == 3 and watcher.updates == 3
        task.cancel()
        await client.aclose()

    try:
        asyncio.run(scenario())
    finally:
        engine.stop()


def test_watcher_survives_a_redis_restart(redis_server, tmp_path):
    path = tmp_path / "v1.safetensors"
    save_model(build_tiny_model(TinyModelConfig(seed=5), vocab_size=64), str(path))
    applied = []

    async def apply(version):
        applied.append(version.version)

    async def scenario():
        client = redis.from_url(redis_server.url)
        watcher = WeightWatcher(client, JOB, apply, poll_seconds=0.2)
        task = asyncio.create_task(watcher.run())
        await asyncio.sleep(0.3)
        redis_server.kill()
        await asyncio.sleep(0.5)
        redis_server.start()
        await announce(client, 1, str(path), publish=False)
        await wait_for(lambda: applied == [1])
        task.cancel()
        await client.aclose()

    asyncio.run(scenario())
