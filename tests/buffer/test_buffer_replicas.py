"""Two buffer processes (`asyncrl serve buffer`) on one Redis: rollout workers and a trainer
whose calls alternate between them see one buffer. The staleness bound holds across both, and
every group is accepted once and then trained, dropped as stale or left waiting, once."""

import asyncio
import itertools

import yaml

from asyncrl.clients.buffer import BufferClient
from support import ROOT
from support.buffer import BufferProcess, group_fates, make_group, wait_healthy

WORKERS = 4
TASKS_PER_WORKER = 3     # slots each worker holds at once, like a rollout worker's concurrency
STEPS = 24


def test_two_buffer_replicas_agree(redis_server, tmp_path):
    manifest = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    manifest["spec"]["rollout"]["maxConcurrentRollouts"] = 64  # the staleness gate binds
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(manifest))
    job = manifest["metadata"]["name"]
    algorithm = manifest["spec"]["algorithm"]
    eta, batch_size, group_size = (algorithm["maxStaleness"], algorithm["batchSize"],
                                   algorithm["groupSize"])
    buffers = [BufferProcess(job_file, redis_server.url, tmp_path / f"buffer-{i}.log").start()
               for i in range(2)]

    put: list[str] = []            # group ids whose PutGroup succeeded
    trained: list[str] = []        # group ids of the batches the trainer acknowledged
    staleness: list[int] = []      # trainer version at consumption minus the group's version

    async def worker(name: str, clients: list[BufferClient], counter, done) -> None:
        """One task of a rollout worker: a slot through one replica, the group through the
        other (the worker's calls reach whichever replica the Service picks). It stops
        waiting for a slot once the trainer is done; a group it holds a slot for is put."""
        for turn in itertools.count():
            via, then = clients[turn % 2], clients[(turn + 1) % 2]
            acquiring = asyncio.ensure_future(via.acquire())
            stopping = asyncio.ensure_future(done.wait())
            await asyncio.wait({acquiring, stopping}, return_when=asyncio.FIRST_COMPLETED)
            stopping.cancel()
            if not acquiring.done():
                acquiring.cancel()
                await asyncio.gather(acquiring, return_exceptions=True)
                return
            slot = acquiring.result()
            version = (await then.stats()).trainer_version  # the weights it generates with
            group_id = f"{name}-{next(counter)}"
            await then.put(slot, make_group(group_id, group_size, version=version))
            put.append(group_id)

    async def trainer(clients: list[BufferClient]) -> None:
        version = 0
        for step in range(STEPS):
            via, then = clients[step % 2], clients[(step + 1) % 2]
            batch = await via.get_batch("trainer-0", batch_size, wait_ms=2000)
            while not batch.batch_id:
                batch = await via.get_batch("trainer-0", batch_size, wait_ms=2000)
            staleness.extend(version - min(g.samples[0].token_versions) for g in batch.groups)
            await then.ack(batch.batch_id)
            trained.extend(g.group_id for g in batch.groups)
            version += 1
            await via.set_version(version, f"file:///weights/{version}")

    async def scenario():
        trainer_clients = [BufferClient(b.address, job, "trainer") for b in buffers]
        for client in trainer_clients:
            await wait_healthy(client)
        worker_clients = {f"w{i}": [BufferClient(b.address, job, f"w{i}") for b in buffers]
                          for i in range(WORKERS)}
        done = asyncio.Event()
        producers = [asyncio.create_task(worker(name, clients, counter, done))
                     for name, clients in worker_clients.items()
                     for counter in [itertools.count()] for _ in range(TASKS_PER_WORKER)]
        try:
            await trainer(trainer_clients)
        finally:
            done.set()
            await asyncio.gather(*producers)
        stats = [await client.stats() for client in trainer_clients]
        for client in [*trainer_clients, *(c for cs in worker_clients.values() for c in cs)]:
            await client.close()
        return stats

    try:
        stats_a, stats_b = asyncio.run(scenario())
    finally:
        for buffer in buffers:
            buffer.kill()
    redis_server.kill()  # appendfsync always: its AOF holds every write

    # Both replicas report the one state, and the gate held across them: no group was
    # consumed more than maxStaleness versions after the weights it was generated with, and
    # no more groups were let in than (η + version + 1) × batchSize.
    assert stats_a == stats_b
    assert stats_a.trainer_version == STEPS
    assert staleness and max(staleness) <= eta, staleness
    assert stats_a.accepted_total - stats_a.dropped_stale_total + stats_a.running_slots <= \
        (eta + STEPS + 1) * batch_size
    assert stats_a.accepted_total == len(put) and stats_a.consumed_total == len(trained)

    # By group id, from what Redis wrote: each put once, then exactly one fate each.
    fates = group_fates(redis_server.data_dir, job)
    assert len(set(put)) == len(put)
    assert sorted(fates.accepted) == sorted(put)
    assert sorted(fates.trained) == sorted(trained) and len(trained) == STEPS * batch_size
    assert sorted(fates.trained + fates.dropped + fates.waiting) == sorted(put)
    assert len(fates.dropped) == stats_a.dropped_stale_total
