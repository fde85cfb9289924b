"""The distributed weight transfer (trainer.weightTransfer: distributed): the trainer's
WeightBroadcaster as rank 0 and rollout engines that joined its group, the torch engine in
process and behind its SGLang-compatible HTTP API (driven by our SGLang client), over real gloo
process groups on loopback."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import redis.asyncio as redis
import torch

from asyncrl.engine.api import TorchInferenceEngine
from asyncrl.rollout.http_api import create_app
from asyncrl.rollout.metrics import RolloutMetrics
from asyncrl.rollout.sglang_client import SGLangClient
from asyncrl.rollout.sglang_engine import SGLangEngine
from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.engine.types import SamplingParams
from asyncrl.model.lora import adapter_state
from asyncrl.spec.job import RLJobSpec
from asyncrl.rollout.weights_receiver import (
    TransferMember,
    VersionSkipped,
    WeightWatcher,
    engine_applier,
)
from asyncrl.trainer.weights_broadcast import WeightBroadcaster
from asyncrl.weights.distributed import (
    announcement_uri,
    buckets,
    claim_ranks,
    connect_store,
    current_generation,
    directory_manifest,
    host_store,
    model_manifest,
    version_manifest,
)
from asyncrl.weights.announcements import WeightVersion, weights_channel, weights_key
from support.lora import trained_adapter
from support.ports import free_port
from support.rollout import recomputed_logprobs, tiny_engine
from support.servers import HttpServer
from support.tiny_model import tiny_model as tiny
from support.waiting import wait_for


def run(scenario):
    return asyncio.run(asyncio.wait_for(scenario, timeout=300))


def test_the_manifest_is_the_snapshot_layout_sorted_tied_weights_once(tmp_path):
    model = tiny(0)
    tensors = model_manifest(model, torch.bfloat16)
    names = [t.name for t in tensors]
    assert names == sorted(names)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names  # tied
    assert {t.dtype for t in tensors} == {torch.bfloat16}
    # An SGLang worker reads the same list from the model directory it serves.
    model.save_pretrained(tmp_path)
    assert directory_manifest(tmp_path, torch.bfloat16) == tensors

    limit = 3 * tensors[0].bytes
    parts = buckets(tensors, bucket_bytes=limit)
    assert len(parts) > 1 and [t for part in parts for t in part] == tensors
    assert all(sum(t.bytes for t in part) <= limit or len(part) == 1 for part in parts)


def test_ranks_are_claimed_once_each_and_never_past_the_world():
    port = free_port()
    store = host_store(port, timeout=10)
    client = connect_store("127.0.0.1", port, timeout=10)
    assert claim_ranks(client, 1, world=4, group_name="g1") == 1
    assert claim_ranks(client, 2, world=4, group_name="g1") == 2  # SGLang on two GPUs: 2, 3
    with pytest.raises(RuntimeError, match="joins the next generation"):
        claim_ranks(client, 1, world=4, group_name="g1")
    assert claim_ranks(client, 1, world=4, group_name="g2") == 1  # each generation its own
    del store


def test_a_group_that_never_forms_sends_versions_to_disk():
    broadcaster = WeightBroadcaster(free_port(), world_size=2, backend="gloo",
                                    tensors=model_manifest(tiny(0), torch.float32), timeout=1)
    first = broadcaster.address.group_name
    assert not broadcaster.ready(wait=0)  # still forming: this version goes to disk
    assert not broadcaster.ready(wait=30)  # no engine came within the timeout ...
    assert broadcaster.generations == 2   # ... so the next generation forms
    assert broadcaster.address.group_name != first
    assert current_generation(connect_store("127.0.0.1", broadcaster.address.master_port, 10)) \
        == (broadcaster.address.group_name, 2)


async def _join(member: TransferMember, broadcaster: WeightBroadcaster) -> None:
    await asyncio.gather(member.join(),
                         asyncio.to_thread(lambda: assert_ready(broadcaster)))
    assert member.joined


def assert_ready(broadcaster: WeightBroadcaster) -> None:
    assert broadcaster.ready(wait=60)


async def _update_while_generating(engine, torch_engine, member, broadcaster, new_model):
    """Four long requests; once they generate, version 1 is broadcast into the engine."""
    params = SamplingParams(max_new_tokens=60)
    requests = [asyncio.create_task(engine.generate([3 + i, 4, 5], params)) for i in range(4)]
    await asyncio.to_thread(wait_for, lambda: torch_engine.status().generated_tokens_total >= 20,
                            60, "tokens to be generated")
    update, seconds = await asyncio.gather(
        member.receive(1, broadcaster.address.group_name),
        asyncio.to_thread(broadcaster.send, new_model.state_dict()))
    return update, seconds, await asyncio.gather(*requests)


def _check_results(results, torch_engine) -> None:
    models = {0: tiny(0), 1: tiny(1)}
    spanning = 0
    for result in results:
        assert len(result.output_ids) == 60 and result.finish_reason == "length"
        assert result.output_versions == sorted(result.output_versions)
        spanning += len(set(result.output_versions)) > 1
        expected = recomputed_logprobs(models, result.prompt_ids, result.output_ids,
                                       result.output_versions)
        assert result.output_logprobs == pytest.approx(expected.tolist(), abs=1e-4)
    assert spanning >= 1
    # Every weight is version 1's, tied ones included.
    received = torch_engine._model.state_dict()
    for name, tensor in models[1].state_dict().items():
        assert torch.equal(received[name], tensor), name


def test_the_torch_engine_receives_a_version_in_place_mid_generation():
    torch_engine = tiny_engine(seed=0)
    engine = TorchInferenceEngine(torch_engine)
    new_model = tiny(1)
    tensors = model_manifest(new_model, torch.float32)
    port = free_port()
    broadcaster = WeightBroadcaster(port, world_size=2, backend="gloo", tensors=tensors)
    member = TransferMember(engine, f"127.0.0.1:{port}", ranks=1,
                            backend="gloo", tensors=tensors)
    storage = {n: t.data_ptr() for n, t in torch_engine._model.state_dict().items()}
    try:
        async def scenario():
            await _join(member, broadcaster)
            return await _update_while_generating(engine, torch_engine, member, broadcaster,
                                                  new_model)

        update, seconds, results = run(scenario())
    finally:
        torch_engine.stop()
    assert update.version == 1 and engine.version == 1 and update.interrupted_requests >= 1
    assert seconds > 0
    _check_results(results, torch_engine)
    # Received straight into the weights: no tensor was replaced.
    assert {n: t.data_ptr() for n, t in torch_engine._model.state_dict().items()} == storage


@pytest.fixture
def served_engine():
    torch_engine = tiny_engine(seed=0)
    app = create_app(torch_engine, model_path="tiny-random", metrics=RolloutMetrics(job="t"))
    with HttpServer(app) as served:
        yield served.url, torch_engine
    torch_engine.stop()


def test_an_sglang_api_server_receives_a_version_in_buckets_mid_generation(served_engine):
    url, torch_engine = served_engine
    new_model = tiny(1)
    tensors = model_manifest(new_model, torch.float32)
    port = free_port()
    broadcaster = WeightBroadcaster(port, world_size=2, backend="gloo", tensors=tensors)

    async def scenario():
        async with SGLangClient(url) as client:
            # Small buckets: the version spans several /update_weights_from_distributed calls.
            engine = SGLangEngine(client, max_running_requests=8, max_sequence_length=256,
                                  transfer_bucket_bytes=4 * tensors[0].bytes)
            member = TransferMember(engine, f"127.0.0.1:{port}", ranks=1,
                                    backend="gloo", tensors=tensors)
            await _join(member, broadcaster)
            return await _update_while_generating(engine, torch_engine, member, broadcaster,
                                                  new_model), engine.version

    (update, _, results), version = run(scenario())
    assert len(buckets(tensors, 4 * tensors[0].bytes)) > 1
    assert update.version == 1 and version == 1 and torch_engine.version == 1
    _check_results(results, torch_engine)


def test_bad_transfer_requests_are_refused_naming_the_fix(served_engine):
    url, torch_engine = served_engine
    with httpx.Client(base_url=url, timeout=30) as http:
        answer = http.post("/init_weights_update_group", json={
            "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 0,
            "world_size": 2, "backend": "gloo"})
        assert answer.status_code == 400 and "rank 0 is the trainer" in answer.text
        body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]}
        answer = http.post("/update_weights_from_distributed", json=body)
        assert answer.status_code == 400 and "/init_weights_update_group first" in answer.text
        answer = http.post("/update_weights_from_distributed",
                           json={**body, "dtypes": ["int8"]})
        assert answer.status_code == 400 and "not supported" in answer.text
        answer = http.post("/update_weights_from_distributed",
                           json={**body, "shapes": [[64], [1]]})
        assert answer.status_code == 400 and "same length" in answer.text
        # The engine is untouched and still serves.
        answer = http.post("/generate", json={"input_ids": [1, 2], "sampling_params":
                                              {"max_new_tokens": 3}})
        assert answer.status_code == 200 and len(answer.json()["output_ids"]) == 3
    assert torch_engine.version == 0


def test_a_tensor_the_model_lacks_is_refused_before_anything_is_received():
    torch_engine = tiny_engine(seed=0)
    tensors = model_manifest(tiny(1), torch.float32)
    wrong = [type(tensors[0])("model.no_such.weight", torch.float32, (4,))] + tensors
    try:
        with pytest.raises(Exception, match="no such tensor"):
            torch_engine.update_weights_from_distributed(object(), wrong, 1)
        assert torch_engine.version == 0
        assert torch_engine.submit([1, 2], SamplingParams(max_new_tokens=2)).result(30)
    finally:
        torch_engine.stop()


def test_a_worker_outside_the_group_skips_a_broadcast_and_takes_the_version_from_disk(
    redis_server, tmp_path,
):
    """A worker that is not in the group (it restarted) leaves a broadcast version alone, and
    takes the same version once the trainer, whose broadcast failed, announces it on disk."""
    torch_engine = tiny_engine(seed=0)
    tiny(1).save_pretrained(tmp_path / "v1")
    reads = []

    class CountingWatcher(WeightWatcher):
        async def catch_up(self) -> None:
            await super().catch_up()
            reads.append(self.version)

    async def announce(client, uri: str) -> None:
        await client.hset(weights_key("t"), mapping=WeightVersion(1, uri, 1).to_hash())
        await client.publish(weights_channel("t"), "1")

    async def scenario():
        client = redis.from_url(redis_server.url)
        apply = engine_applier(TorchInferenceEngine(torch_engine), tmp_path / "cache")
        watcher = CountingWatcher(client, "t", apply, poll_seconds=0.2)
        task = asyncio.create_task(watcher.run())
        await announce(client, announcement_uri("asyncrl-weights"))
        await asyncio.to_thread(wait_for, lambda: len(reads) >= 3, 30, "re-reads")
        assert torch_engine.version == 0 and watcher.version == 0 and not task.done()
        await announce(client, str(tmp_path / "v1"))  # the trainer's fallback
        # The watcher's own read that took version 1: the engine serves it a moment before
        # the watcher's update returns and is counted.
        await asyncio.to_thread(wait_for, lambda: reads[-1] == 1, 30, "version 1")
        assert torch_engine.version == 1 and watcher.updates == 1
        task.cancel()
        await client.aclose()

    try:
        run(scenario())
    finally:
        torch_engine.stop()


def _trainer_that_dies_mid_broadcast(port: int, sent: int, hosting) -> None:
    """Rank 0 that broadcasts the first `sent` tensors of version 1, then is gone. Sets
    `hosting` (an Event) once its store is up."""
    import os

    model = tiny(1)
    broadcaster = WeightBroadcaster(port, world_size=2, backend="gloo",
                                    tensors=model_manifest(model, torch.float32)[:sent])
    hosting.set()
    assert broadcaster.ready(wait=120)
    broadcaster.send(model.state_dict())
    os._exit(0)


def test_a_trainer_lost_mid_broadcast_holds_generation_until_the_version_comes_from_disk(
    tmp_path,
):
    import multiprocessing

    torch_engine = tiny_engine(seed=0)
    engine = TorchInferenceEngine(torch_engine)
    tensors = model_manifest(tiny(1), torch.float32)
    tiny(1).save_pretrained(tmp_path / "v1")
    port = free_port()
    spawn = multiprocessing.get_context("spawn")
    hosting = spawn.Event()
    trainer = spawn.Process(target=_trainer_that_dies_mid_broadcast, args=(port, 3, hosting))
    trainer.start()
    member = TransferMember(engine, f"127.0.0.1:{port}", ranks=1,
                            backend="gloo", tensors=tensors)
    try:
        async def scenario():
            # One join gives up on a store that has not answered within its check timeout, and
            # a trainer process still starting on a busy machine can take longer than that.
            assert await asyncio.to_thread(hosting.wait, 120), "the trainer never hosted its store"
            await member.join()
            assert member.joined
            with pytest.raises(VersionSkipped, match="broadcast failed"):
                await member.receive(1, member.group_name)
            assert not member.joined and torch_engine.version == 0
            # Half old, half new weights: nothing is generated with them.
            pending = torch_engine.submit([1, 2], SamplingParams(max_new_tokens=4))
            await asyncio.sleep(1.0)
            assert torch_engine.status().generated_tokens_total == 0 and not pending.done()
            # The trainer's fallback: the same version from disk; generation goes on.
            await engine.update_weights_from_disk(tmp_path / "v1", 1)
            return await asyncio.wrap_future(pending)

        result = run(scenario())
    finally:
        torch_engine.stop()
        trainer.join(30)
    assert torch_engine.version == 1 and result.output_versions == [1] * 4


def _trainer_that_sends_one_version(port: int, seed: int) -> None:
    """Rank 0 of a fresh store on `port` that broadcasts tiny(seed) once its group has formed,
    then is gone (a trainer that crashed, or the one that replaced it)."""
    import os

    model = tiny(seed)
    broadcaster = WeightBroadcaster(port, world_size=2, backend="gloo",
                                    tensors=model_manifest(model, torch.float32))
    assert broadcaster.ready(wait=120)
    broadcaster.send(model.state_dict())
    os._exit(0)


def _assert_weights(torch_engine, seed: int) -> None:
    received = torch_engine._model.state_dict()
    for name, tensor in tiny(seed).state_dict().items():
        assert torch.equal(received[name], tensor), name


def test_a_worker_joins_the_group_of_a_restarted_trainer():
    """The trainer is lost and another takes its place (a new store on the same port): the
    worker finds the new generation there, joins it and takes its broadcasts."""
    import multiprocessing

    spawn = multiprocessing.get_context("spawn")
    torch_engine = tiny_engine(seed=0)
    tensors = model_manifest(tiny(1), torch.float32)
    port = free_port()
    member = TransferMember(TorchInferenceEngine(torch_engine), f"127.0.0.1:{port}",
                            ranks=1, backend="gloo", tensors=tensors,
                            check_seconds=0.2)
    trainers = []
    try:
        async def scenario():
            following = asyncio.create_task(member.run())
            groups = []
            for version, seed in ((1, 1), (2, 2)):
                trainers.append(spawn.Process(target=_trainer_that_sends_one_version,
                                              args=(port, seed)))
                trainers[-1].start()
                await asyncio.to_thread(wait_for, lambda: member.joins == version, 120,
                                        f"joining trainer {version}'s group")
                groups.append(member.group_name)
                update = await member.receive(version, member.group_name)
                assert update.version == version and torch_engine.version == version
                _assert_weights(torch_engine, seed)
                await asyncio.to_thread(trainers[-1].join, 60)
            following.cancel()
            return groups

        groups = run(scenario())
    finally:
        torch_engine.stop()
        for trainer in trainers:
            trainer.kill()
    assert groups[0] != groups[1]


def _worker_that_joins_then_dies(port: int, formed) -> None:
    """Joins, then is gone once the trainer has seen the group formed (`formed`, an Event):
    a member gone sooner could break the group before the trainer's side of it formed."""
    import os

    async def join() -> None:
        member = TransferMember(TorchInferenceEngine(tiny_engine(seed=0)), f"127.0.0.1:{port}",
                                ranks=1, backend="gloo",
                                tensors=model_manifest(tiny(0), torch.float32))
        await member.join()
        assert member.joined
        await asyncio.to_thread(formed.wait, 120)  # holding the member, and its group, till then

    asyncio.run(join())
    os._exit(0)


def test_a_lost_worker_breaks_a_generation_and_its_replacement_joins_the_next():
    """A worker joins, then is gone: the trainer's next broadcast fails, that version goes to
    disk and the next generation forms, which the restarted worker (refused a rank in the
    full first generation) joins; the version after that is broadcast to it."""
    import multiprocessing

    tensors = model_manifest(tiny(1), torch.float32)
    port = free_port()
    broadcaster = WeightBroadcaster(port, world_size=2, backend="gloo", tensors=tensors)
    spawn = multiprocessing.get_context("spawn")
    formed = spawn.Event()
    lost = spawn.Process(target=_worker_that_joins_then_dies, args=(port, formed))
    lost.start()
    assert broadcaster.ready(wait=120)
    first = broadcaster.address.group_name
    formed.set()
    lost.join(60)
    with pytest.raises(Exception):
        broadcaster.send(tiny(1).state_dict())
    torch_engine = tiny_engine(seed=0)
    member = TransferMember(TorchInferenceEngine(torch_engine), f"127.0.0.1:{port}",
                            ranks=1, backend="gloo", tensors=tensors,
                            check_seconds=0.2)
    try:
        async def scenario():
            await member.join()  # the first generation has no rank left
            assert not member.joined
            following = asyncio.create_task(member.run())
            assert not broadcaster.ready()  # this version goes to disk; the next generation forms
            assert broadcaster.address.group_name != first
            await asyncio.to_thread(assert_ready, broadcaster)
            # Formed on the trainer's side; the member's join may not have returned yet.
            await member.join_returned(broadcaster.address.group_name)
            assert member.group_name == broadcaster.address.group_name
            update, _ = await asyncio.gather(
                member.receive(1, member.group_name),
                asyncio.to_thread(broadcaster.send, tiny(1).state_dict()))
            following.cancel()
            return update

        assert run(scenario()).version == 1
        _assert_weights(torch_engine, 1)
    finally:
        torch_engine.stop()


def test_an_sglang_server_leaves_the_old_generation_when_it_joins_the_next(served_engine):
    url, torch_engine = served_engine
    tensors = model_manifest(tiny(1), torch.float32)
    port = free_port()
    broadcaster = WeightBroadcaster(port, world_size=2, backend="gloo", tensors=tensors)

    async def scenario():
        async with SGLangClient(url) as client:
            engine = SGLangEngine(client, max_running_requests=8, max_sequence_length=256)
            member = TransferMember(engine, f"127.0.0.1:{port}", ranks=1,
                                    backend="gloo", tensors=tensors)
            await _join(member, broadcaster)
            first = member.group_name
            broadcaster.broken = True   # as a failed broadcast leaves it
            assert not broadcaster.ready()  # the next generation forms
            await _join(member, broadcaster)
            assert member.group_name != first and member.joins == 2
            async with httpx.AsyncClient(base_url=url) as http:  # the server left the first
                answer = await http.post("/destroy_weights_update_group",
                                         json={"group_name": first})
                assert answer.status_code == 400 and "no weight transfer group" in answer.text
            update, _ = await asyncio.gather(
                member.receive(1, member.group_name),
                asyncio.to_thread(broadcaster.send, tiny(1).state_dict()))
            return update

    assert run(scenario()).version == 1 and torch_engine.version == 1
    _assert_weights(torch_engine, 1)


def test_a_version_broadcast_as_the_group_forms_waits_for_the_join_to_return():
    """The trainer may announce the first version of a generation before the engine's join
    has returned: receiving it waits for the join instead of skipping the version."""
    torch_engine = tiny_engine(seed=0)
    engine = TorchInferenceEngine(torch_engine)
    tensors = model_manifest(tiny(1), torch.float32)
    port = free_port()
    broadcaster = WeightBroadcaster(port, world_size=2, backend="gloo", tensors=tensors)
    joined = engine.join_weight_transfer
    late = asyncio.Event()

    async def slow_join(address, rank):  # the group forms, then the join returns when let
        await joined(address, rank)
        await late.wait()

    engine.join_weight_transfer = slow_join
    member = TransferMember(engine, f"127.0.0.1:{port}", ranks=1,
                            backend="gloo", tensors=tensors)
    try:
        async def scenario():
            joining = asyncio.create_task(member.join())
            await asyncio.to_thread(assert_ready, broadcaster)
            assert not member.joined  # formed, but the join has not returned yet

            async def let_the_join_return():
                late.set()

            # gather starts them in this order: receive is waiting for the join when it returns.
            update, _, _ = await asyncio.gather(
                member.receive(1, broadcaster.address.group_name),
                asyncio.to_thread(broadcaster.send, tiny(1).state_dict()),
                let_the_join_return())
            await joining
            return update

        assert run(scenario()).version == 1
        _assert_weights(torch_engine, 1)
    finally:
        torch_engine.stop()


def test_scaling_the_rollout_up_forms_a_larger_generation_that_every_engine_joins():
    """An engine added to a running job (kubectl scale) finds the formed group full: the
    trainer forms the next generation, its world size read again from the job, and the old
    engine and the new one both join it and take the next broadcast."""
    tensors = model_manifest(tiny(1), torch.float32)
    port = free_port()
    replicas = [1]
    broadcaster = WeightBroadcaster(port, world_size=lambda: 1 + replicas[0], backend="gloo",
                                    tensors=tensors)
    engines = [tiny_engine(seed=0), tiny_engine(seed=0)]
    members = [TransferMember(TorchInferenceEngine(e), f"127.0.0.1:{port}", ranks=1,
                              backend="gloo", tensors=tensors, check_seconds=0.2)
               for e in engines]
    try:
        async def scenario():
            await _join(members[0], broadcaster)
            first = members[0].group_name
            replicas[0] = 2  # the job now says two rollout replicas
            following = [asyncio.create_task(m.run()) for m in members]
            await asyncio.to_thread(wait_for, lambda: not broadcaster.ready(), 30,
                                    "the trainer to see an engine outside the group")
            assert broadcaster.address.world_size == 3 and broadcaster.address.group_name != first
            await asyncio.to_thread(assert_ready, broadcaster)
            group = broadcaster.address.group_name
            updates = await asyncio.gather(
                *(m.receive(1, group) for m in members),
                asyncio.to_thread(broadcaster.send, tiny(1).state_dict()))
            for task in following:
                task.cancel()
            return updates[:2]

        assert [u.version for u in run(scenario())] == [1, 1]
        for engine in engines:
            _assert_weights(engine, 1)
    finally:
        for engine in engines:
            engine.stop()


def test_a_lora_version_is_the_adapter_broadcast_and_merged_from_the_base():
    """model.lora: both ends list the adapter's tensors (version_manifest), the broadcast
    carries those only, and the engine's weights become base + scale * B @ A."""
    spec = RLJobSpec.model_validate({"model": {"source": "tiny-random",
                                               "lora": {"rank": 4, "alpha": 8}}})
    base = tiny(1)
    tensors = version_manifest(base, spec.model)
    trained = trained_adapter(seed=3, base_seed=1, lora=spec.model.lora)
    adapter = adapter_state(trained)
    assert [t.name for t in tensors] == sorted(adapter)  # nothing but the adapter
    assert sum(t.bytes for t in tensors) == sum(t.numel() * 4 for t in adapter.values())
    torch_engine = TorchEngine(base, max_running_requests=2, max_sequence_length=32,
                               lora=spec.model.lora)
    engine = TorchInferenceEngine(torch_engine)
    port = free_port()
    broadcaster = WeightBroadcaster(port, world_size=2, backend="gloo", tensors=tensors)
    member = TransferMember(engine, f"127.0.0.1:{port}", ranks=1, backend="gloo",
                            tensors=tensors)

    async def scenario():
        await _join(member, broadcaster)
        return await asyncio.gather(member.receive(1, broadcaster.address.group_name),
                                    asyncio.to_thread(broadcaster.send, adapter))

    (update, _), = [run(scenario())]
    assert update.version == 1 == engine.version
    merged = trained.merge_and_unload().state_dict()
    for name, tensor in torch_engine._model.state_dict().items():
        torch.testing.assert_close(tensor, merged[name], atol=1e-6, rtol=0)
