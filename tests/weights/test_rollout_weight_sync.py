"""Weight versions announced in a real Redis reach a real engine, including ones whose
messages were missed."""

import asyncio
import time

import pytest
import redis.asyncio as redis
import torch

from asyncrl.buffer.store import BufferStore, JobConfig
from asyncrl.platform.outage import Outage, OutageTooLong, connect, redis_address
from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.engine.api import TorchInferenceEngine
from asyncrl.engine.types import SamplingParams
from asyncrl.rollout.weights_receiver import WeightWatcher, engine_applier
from asyncrl.weights.announcements import WeightVersion, weights_channel, weights_key
from support.rollout import recomputed_logprobs
from support.tiny_model import VOCAB, tiny_model, write_snapshot

JOB = "sync-test"


async def announce(client, version, uri, publish=True):
    await client.hset(weights_key(JOB), mapping=WeightVersion(version, uri, 1).to_hash())
    if publish:
        await client.publish(weights_channel(JOB), str(version))


class CountingWatcher(WeightWatcher):
    """Counts its completed reads of the weights hash."""

    reads = 0

    async def catch_up(self) -> None:
        await super().catch_up()
        self.reads += 1


async def wait_for(predicate, timeout=60.0):
    """Polls `predicate`; the limit only catches a hang."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def test_announced_versions_reach_the_engine(redis_server, tmp_path):
    snapshots = []
    for version in (1, 2, 3):
        path = tmp_path / f"v{version}.safetensors"
        write_snapshot(path, version, vocab_size=64)
        snapshots.append(path)
    engine = TorchEngine(tiny_model(vocab_size=64),
                         max_running_requests=2, max_sequence_length=32).start()

    async def scenario():
        client = redis.from_url(redis_server.url)
        apply = engine_applier(TorchInferenceEngine(engine), tmp_path / "cache")
        # Announced before the worker started: caught up from the hash at once.
        await announce(client, 1, str(snapshots[0]))
        watcher = CountingWatcher(client, JOB, apply, poll_seconds=0.3)
        task = asyncio.create_task(watcher.run())
        await wait_for(lambda: engine.version == 1)
        # Announced with a message.
        await announce(client, 2, f"file://{snapshots[1]}")
        await wait_for(lambda: engine.version == 2)
        # Message lost: the periodic re-read still finds it.
        await announce(client, 3, str(snapshots[2]), publish=False)
        await wait_for(lambda: engine.version == 3)
        # An old announcement never moves the engine back. At most one read of the hash was
        # under way when it was announced, so the second to complete after it began after it.
        await announce(client, 1, str(snapshots[0]))
        reads = watcher.reads
        await wait_for(lambda: watcher.reads >= reads + 2)
        assert engine.version == 3 and watcher.updates == 3
        task.cancel()
        await client.aclose()

    try:
        asyncio.run(scenario())
    finally:
        engine.stop()


def test_a_worker_started_mid_run_is_caught_up_before_it_may_generate(redis_server, tmp_path):
    """`caught_up` (what the rollout workflow waits for) is set only once the version announced
    before the worker started is in its engine; with nothing announced, at once."""
    path = tmp_path / "v5.safetensors"
    write_snapshot(path, 5, vocab_size=64)
    engine = TorchEngine(tiny_model(vocab_size=64),
                         max_running_requests=2, max_sequence_length=32).start()

    async def scenario():
        client = redis.from_url(redis_server.url)
        empty = WeightWatcher(client, "nothing-announced", engine_applier(
            TorchInferenceEngine(engine), tmp_path / "cache"))
        first = asyncio.create_task(empty.run())
        await asyncio.wait_for(empty.caught_up.wait(), 30)
        assert engine.version == 0

        release = asyncio.Event()
        apply = engine_applier(TorchInferenceEngine(engine), tmp_path / "cache")

        async def slow_apply(announced):
            await release.wait()  # a large snapshot still loading
            await apply(announced)

        job = "announced-before-start"
        await client.hset(weights_key(job), mapping=WeightVersion(5, str(path), 1).to_hash())
        watcher = WeightWatcher(client, job, slow_apply)
        second = asyncio.create_task(watcher.run())
        await asyncio.sleep(0.5)
        assert not watcher.caught_up.is_set() and engine.version == 0
        release.set()
        await asyncio.wait_for(watcher.caught_up.wait(), 30)
        assert engine.version == 5
        first.cancel()
        second.cancel()
        await client.aclose()

    try:
        asyncio.run(scenario())
    finally:
        engine.stop()


def test_watcher_survives_a_redis_restart(redis_server, tmp_path, caplog):
    path = tmp_path / "v1.safetensors"
    write_snapshot(path, 5, vocab_size=64)
    applied = []

    async def apply(version):
        applied.append(version.version)

    async def scenario():
        client = connect(redis_server.url)
        outage = Outage(f"Redis at {redis_address(redis_server.url)}")
        watcher = CountingWatcher(client, JOB, apply, poll_seconds=0.2, outage=outage)
        task = asyncio.create_task(watcher.run())
        await wait_for(lambda: watcher.reads >= 1)  # subscribed and watching
        assert outage.available
        redis_server.kill()
        await wait_for(lambda: not outage.available)  # the worker's /ready says 503
        assert f"Redis at 127.0.0.1:{redis_server.port} is unreachable" in caplog.text
        redis_server.start()
        await announce(client, 1, str(path), publish=False)
        await wait_for(lambda: applied == [1])
        assert outage.available and not task.done()
        task.cancel()
        await client.aclose()

    asyncio.run(scenario())


def test_watcher_gives_up_past_the_outage_bound_naming_redis(redis_server):
    async def apply(version):
        raise AssertionError("nothing is announced")

    async def scenario():
        client = connect(redis_server.url)
        outage = Outage(f"Redis at {redis_address(redis_server.url)}", bound=1.0)
        watcher = CountingWatcher(client, JOB, apply, poll_seconds=0.2, outage=outage)
        task = asyncio.create_task(watcher.run())
        await wait_for(lambda: watcher.reads >= 1)
        redis_server.stop()
        with pytest.raises(OutageTooLong, match=f"Redis at 127.0.0.1:{redis_server.port} has "
                                                "been unreachable"):
            await asyncio.wait_for(task, timeout=120)
        await client.aclose()

    asyncio.run(scenario())


def test_versions_announced_by_the_trainer_reach_requests_in_flight(redis_server, tmp_path):
    """The production path, with requests generating: the trainer's SetVersion (the buffer's
    script: weights hash + channel) -> WeightWatcher -> engine_applier -> the engine swaps
    weights between two decode steps, without a pause. Each response keeps its whole budget,
    its per-token versions step up once per announced version, and every token's log-prob is
    that of the weights of its version (prompt and earlier tokens re-read under them)."""
    models = {v: tiny_model(seed, VOCAB)
              for v, seed in {0: 1, 1: 9, 2: 17}.items()}
    snapshots = {v: write_snapshot(tmp_path / f"v{v}" / "model.safetensors", seed)
                 for v, seed in {1: 9, 2: 17}.items()}
    engine = TorchEngine(tiny_model(1, VOCAB),
                         max_running_requests=4, max_sequence_length=700, seed=0).start()
    inference = TorchInferenceEngine(engine)
    prompts = [[3 + i, 4, 5, 6 + 2 * i] for i in range(4)]
    # Long enough that the updates, each landed after ~40 more tokens per request, come
    # while every request is still generating.
    params = SamplingParams(max_new_tokens=600, temperature=1.0, ignore_eos=True)

    async def tokens_generated(count: int) -> None:
        await wait_for(lambda: engine.status().generated_tokens_total >= count, timeout=120)

    async def scenario():
        client = redis.from_url(redis_server.url)
        trainer_side = BufferStore(client, [JobConfig(JOB, max_staleness=1, batch_size=1,
                                                      group_size=1)])
        await trainer_side.register()
        watcher = WeightWatcher(client, JOB, engine_applier(inference, tmp_path / "cache"),
                                poll_seconds=5.0)
        watching = asyncio.create_task(watcher.run())
        requests = [asyncio.create_task(inference.generate(p, params)) for p in prompts]
        for version, uri in ((1, f"file://{snapshots[1]}"), (2, str(snapshots[2]))):
            await tokens_generated(engine.status().generated_tokens_total + 40 * len(prompts))
            await trainer_side.set_version(JOB, version, uri)
            await wait_for(lambda: engine.version == version, timeout=60)
            assert engine.status().running_requests == len(prompts)
        results = await asyncio.gather(*requests)
        watching.cancel()
        await client.aclose()
        return results, watcher.updates

    try:
        results, updates = asyncio.run(asyncio.wait_for(scenario(), timeout=300))
        status = engine.status()
    finally:
        engine.stop()
    assert updates == 2 and not status.paused
    assert status.interrupted_requests_total == 2 * len(prompts)
    for prompt, result in zip(prompts, results):
        assert len(result.output_ids) == 600 and result.finish_reason == "length"
        assert result.interruptions == 2
        # The versions switch at one point for each update: 0...0 1...1 2...2.
        versions = result.output_versions
        assert versions == sorted(versions) and set(versions) == {0, 1, 2}, versions
        expected = recomputed_logprobs(models, prompt, result.output_ids, versions)
        torch.testing.assert_close(torch.tensor(result.output_logprobs), expected,
                                   atol=1e-4, rtol=0)
