"""Each prompt once per epoch, across rollout replicas and restarts: the order a cursor names
(asyncrl.data.prompt_order), real rollout worker processes on one real buffer over a real
redis-server (two at once; one of them killed -9 mid-epoch), and the trainer ending the job
when the dataset is used up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest
import redis as sync_redis
import yaml

from asyncrl.buffer.store import JobConfig
from asyncrl.model.policy import load_tokenizer
from asyncrl.data.prompt_order import PromptOrder, epoch_of
from asyncrl.data.prompts import PromptItem, PromptSet, build_prompts
from asyncrl.platform.redis_keys import key
from asyncrl.platform.settings import serve_command
from asyncrl.spec import load_manifest
from asyncrl.v1 import buffer_pb2, buffer_pb2_grpc, common_pb2
from support import ROOT
from support.buffer import BufferProcess, BufferThread, make_group
from support.ports import free_port
from support.reward import RewardThread
from support.waiting import wait_for, wait_for_status

ASYNCRL = str(Path(sys.executable).parent / "asyncrl")


# --------------------------------------------------------------------------- the order


def prompt_set(count: int, max_prompt_tokens: int | None = None) -> PromptSet:
    return PromptSet.of([PromptItem(f"p{i}", [1] * (1 + i % 5), None) for i in range(count)],
                        max_prompt_tokens)


def test_each_epoch_is_a_permutation_of_its_own():
    order = PromptOrder(prompt_set(24), seed=7)
    epochs = [[order.index(c) for c in range(e * 24, (e + 1) * 24)] for e in range(4)]
    assert all(sorted(epoch) == list(range(24)) for epoch in epochs)
    assert len({tuple(epoch) for epoch in epochs}) == 4  # a new order each epoch
    assert epochs[0] != list(range(24))                 # shuffled, not the file's order
    assert [epoch_of(c, 24) for c in (0, 23, 24, 95)] == [0, 0, 1, 3]
    assert order.item(30).prompt_id == f"p{epochs[1][6]}"


def test_the_order_is_seeded_and_the_same_in_every_process():
    def orders(seed: int) -> list[int]:
        order = PromptOrder(prompt_set(24), seed)
        return [order.index(c) for c in range(72)]

    assert orders(3) == orders(3)
    assert orders(3) != orders(4)
    # What any worker computes, from the rule itself (numpy's seeded generator).
    expected = np.random.default_rng([3, 1]).permutation(24)
    assert orders(3)[24:48] == expected.tolist()
    assert sorted(orders(-1)[:24]) == list(range(24))  # a negative dataset.seed works too


def test_the_order_knows_which_prompts_fit_and_refuses_an_empty_set():
    order = PromptOrder(prompt_set(10, max_prompt_tokens=3), seed=0)
    assert [order.fits(order.prompts[i]) for i in range(5)] == [True, True, True, False, False]
    with pytest.raises(ValueError, match="no training prompts"):
        PromptOrder(prompt_set(0), seed=0)


# --------------------------------------------------------------------------- the trainer


def trainer_job(tmp_path: Path) -> Path:
    """One epoch of five prompts, batches of two: two steps, and one group never trained."""
    manifest = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    manifest["metadata"]["name"] = "short"
    manifest["spec"]["dataset"].update(numPrompts=6, evalFraction=0.125, epochs=1)
    manifest["spec"]["algorithm"].update(batchSize=2, groupSize=2, maxStaleness=4, maxSteps=10)
    manifest["spec"]["trainer"].update(checkpointEvery=5, evalEvery=5)
    path = tmp_path / "short.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def serve_trainer(job_file: Path, address: str, run_dir: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [ASYNCRL, "serve", "trainer", "--job-file", str(job_file), "--buffer-address", address,
         "--run-dir", str(run_dir), "--grpc-port", str(free_port()), "--threads", "1"],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "ASYNCRL_EVAL_PROMPTS": "0"})


def buffer_stats(address: str, job: str) -> buffer_pb2.BufferStats:
    with grpc.insecure_channel(address) as channel:
        return buffer_pb2_grpc.BufferStub(channel).GetStats(
            buffer_pb2.GetStatsRequest(job=job), timeout=10)


@pytest.mark.slow
def test_the_trainer_finishes_when_the_dataset_is_used_up(tmp_path, redis_server):
    """Every full batch is trained; the last partial one is not. The last step's weights
    are checkpointed and announced as final; a trainer started again does nothing."""
    job_file = trainer_job(tmp_path)
    buffer = BufferThread(redis_server.url, [JobConfig.from_job(load_manifest(job_file))]).start()
    run_dir = tmp_path / "run"
    try:
        with grpc.insecure_channel(buffer.address) as channel:
            stub = buffer_pb2_grpc.BufferStub(channel)
            for index in range(5):
                slot = stub.AcquireSlot(buffer_pb2.AcquireSlotRequest(
                    job="short", worker="w", prompts=5), timeout=10)
                stub.PutGroup(buffer_pb2.PutGroupRequest(
                    job="short", slot_id=slot.slot_id, group=make_group(f"p{index}#0", 2)),
                    timeout=10)
            assert not stub.AcquireSlot(buffer_pb2.AcquireSlotRequest(
                job="short", worker="w", prompts=5), timeout=10).granted
        done = serve_trainer(job_file, buffer.address, run_dir)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        stats = buffer_stats(buffer.address, "short")
        assert stats.dataset_used_up and stats.trainer_finished
        assert (stats.trainer_step, stats.trainer_version) == (2, 2)
        assert (stats.consumed_total, stats.depth_groups) == (4, 1)
        assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-000002"]
        state = json.loads((run_dir / "checkpoints/step-000002/state.json").read_text())
        assert (state["step"], state["version"]) == (2, 2)

        again = serve_trainer(job_file, buffer.address, run_dir)  # e.g. its pod restarted
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text()
                   .splitlines()]
        assert [r["step"] for r in records if r["kind"] == "train"] == [1, 2]
        assert buffer_stats(buffer.address, "short") == stats
    finally:
        buffer.stop()


# --------------------------------------------------------------------------- rollout workers
#
# The test stands in for the trainer: the gate (η = 0, batches of 4) lets 4 groups start per
# policy version, and the test announces the next version once they are in. It never sends
# the workers weights (they get no Redis URL), so they generate with version 0 throughout.

JOB = "cursor"
PROMPTS, EPOCHS, BATCH = 24, 2, 4


def cursor_job(tmp_path: Path, lease_seconds: float = 30) -> Path:
    manifest = yaml.safe_load((ROOT / "examples/tiny.yaml").read_text())
    manifest["metadata"]["name"] = JOB
    spec = manifest["spec"]
    spec["dataset"].update(kind="arith", numPrompts=PROMPTS, evalFraction=0, epochs=EPOCHS,
                           difficulty=1)
    spec["algorithm"].update(groupSize=2, batchSize=BATCH, maxStaleness=0,
                             skipUniformGroups=False)
    spec["rollout"].update(maxConcurrentRollouts=16, maxNewTokens=4)
    spec["buffer"]["leaseSeconds"] = lease_seconds
    path = tmp_path / f"{JOB}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


class Worker:
    """`asyncrl serve rollout` as its own process, named `name` (its slots are `<name>:...`)."""

    def __init__(self, name: str, job_file: Path, buffer: str, reward: str, log: Path):
        self.name = name
        self.http_port = free_port()
        self.log = log
        with log.open("a") as out:
            self.process = subprocess.Popen(
                [ASYNCRL, *serve_command(
                    "rollout", job_file=job_file, buffer_address=buffer, reward_address=reward,
                    http_port=self.http_port, grpc_port=free_port(), threads=1, worker=name)],
                stdout=out, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def wait_healthy(self, timeout: float = 180) -> None:
        wait_for_status(self.process, self.log, f"{self.url}/health", 200, timeout)

    def signal(self, number: int) -> None:
        self.process.send_signal(number)

    def stop(self) -> int:
        """SIGTERM, as Ctrl-C or a pod's stop: it exits as a stopped service does (130)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)
            self.process.terminate()
        return self.process.wait(timeout=120)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)


class Gate:
    """What the test reads from Redis and tells the buffer, as a trainer would."""

    def __init__(self, redis_url: str, buffer_address: str):
        self.redis = sync_redis.Redis.from_url(redis_url)
        self.buffer_address = buffer_address
        self.version = 0

    def held(self, worker: str | None = None) -> int:
        """Slots granted and not yet put or released (expired ones too, until found)."""
        slots = [s.decode() for s in self.redis.zrange(key(JOB, "slots"), 0, -1)]
        return sum(1 for s in slots if worker is None or s.startswith(f"{worker}:"))

    def accepted(self) -> int:
        return int(self.redis.hget(key(JOB, "state"), "accepted") or 0)

    def full(self) -> bool:
        """Every slot this version allows is taken: no group can start before the next."""
        return self.accepted() + self.held() == BATCH * (self.version + 1)

    def stats(self) -> buffer_pb2.BufferStats:
        return buffer_stats(self.buffer_address, JOB)

    def serving(self) -> bool:
        try:
            self.stats()
        except grpc.RpcError:
            return False
        return True

    def reconnect(self, redis_url: str) -> None:
        self.redis.close()
        self.redis = sync_redis.Redis.from_url(redis_url)

    def next_version(self) -> None:
        self.version += 1
        with grpc.insecure_channel(self.buffer_address) as channel:
            buffer_pb2_grpc.BufferStub(channel).SetVersion(buffer_pb2.SetVersionRequest(
                job=JOB, version=self.version, weights_uri=""), timeout=30)

    def run_to_the_end(self, workers: list[Worker], timeout: float = 600) -> None:
        """Announces versions until every prompt of every epoch is used."""
        deadline = time.monotonic() + timeout
        while not self.stats().dataset_used_up:
            for worker in workers:
                assert worker.process.poll() is None, worker.log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"the dataset was never used up: {self.stats()}"
            if self.full() and self.held() == 0:
                self.next_version()
            time.sleep(0.05)

    def wait(self, condition, what: str, timeout: float = 300) -> None:
        wait_for(condition, timeout, what, lambda: f"stats: {self.stats()}", every=0.05)

    def accepted_groups(self) -> list[tuple[int, str, str]]:
        """(prompt cursor, prompt id, slot id) of every accepted group, from the groups stream
        and each group's own bytes (what the trainer would read)."""
        found = []
        for _, fields in self.redis.xrange(key(JOB, "groups")):
            slot = fields[b"slot"].decode()
            group = common_pb2.Group.FromString(self.redis.get(key(JOB, f"group:{slot}")))
            found.append((int(fields[b"c"]), group.prompt_id, slot))
        return found

    def close(self) -> None:
        self.redis.close()


def check_each_prompt_once_per_epoch(gate: Gate, job_file: Path) -> list[tuple[int, str, str]]:
    """Every cursor of every epoch accepted once, for the prompt the order names, so each
    epoch holds every training prompt exactly once."""
    spec = load_manifest(job_file).spec
    train, _ = build_prompts(spec, load_tokenizer(spec.model.source))
    order = PromptOrder(train, spec.dataset.seed)
    groups = gate.accepted_groups()
    assert sorted(c for c, _, _ in groups) == list(range(PROMPTS * EPOCHS))
    assert all(prompt == order.item(c).prompt_id for c, prompt, _ in groups)
    every = Counter(item.prompt_id for item in train)
    assert len(every) == PROMPTS
    for epoch in range(EPOCHS):
        assert Counter(p for c, p, _ in groups if epoch_of(c, PROMPTS) == epoch) == every
    stats = gate.stats()
    assert stats.accepted_total == PROMPTS * EPOCHS and stats.dataset_used_up
    assert (stats.prompt_cursor, stats.epoch, stats.prompts_to_reissue) == (48, 2, 0)
    return groups


@pytest.fixture
def reward(tmp_path):
    spec = load_manifest(cursor_job(tmp_path)).spec
    service = RewardThread(spec.reward, job=JOB, workers=1).start()
    yield service
    service.close()


@pytest.mark.slow
def test_two_workers_use_each_prompt_once_per_epoch(tmp_path, redis_server, reward):
    """Two replicas started together on one buffer: they share the cursor, never walk the
    same prompts. For some rounds one of them is stopped (SIGSTOP) while the other takes the
    round's slots, so both do work whatever their start-up times; then both run at once."""
    job_file = cursor_job(tmp_path)
    buffer = BufferThread(redis_server.url, [JobConfig.from_job(load_manifest(job_file))]).start()
    gate = Gate(redis_server.url, buffer.address)
    workers = [Worker(name, job_file, buffer.address, reward.address, tmp_path / f"{name}.log")
               for name in ("w0", "w1")]
    try:
        for worker in workers:
            worker.wait_healthy()
        gate.wait(gate.full, "the first round's slots taken")
        for round_ in range(4):
            running, stopped = workers[round_ % 2], workers[1 - round_ % 2]
            # The one to stop holds nothing: the gate is full and its slots are put.
            gate.wait(lambda: gate.full() and gate.held(stopped.name) == 0,
                      f"{stopped.name}'s groups put")
            stopped.signal(signal.SIGSTOP)
            running.signal(signal.SIGCONT)
            gate.next_version()
            # A request the stopped one had on its way may still take a slot: at most one.
            gate.wait(lambda: gate.full() and gate.held(running.name) == 0,
                      f"round {round_ + 2} taken by {running.name}")
        for worker in workers:
            worker.signal(signal.SIGCONT)
        gate.run_to_the_end(workers)
        groups = check_each_prompt_once_per_epoch(gate, job_file)
        by_worker = Counter(slot.split(":")[0] for _, _, slot in groups)
        assert by_worker["w0"] >= 3 and by_worker["w1"] >= 3, by_worker
        # Their workflows are over; the workers serve on, idle, until stopped.
        for worker in workers:
            gate.wait(lambda: "generates no more" in worker.log.read_text(),
                      f"{worker.name} told the dataset is used up")
            assert worker.process.poll() is None
    finally:
        codes = [worker.stop() for worker in workers]
        gate.close()
        buffer.stop()
    assert codes == [130, 130], [w.log.read_text()[-2000:] for w in workers]


@pytest.mark.slow
def test_a_worker_killed_mid_epoch_has_its_prompts_handed_out_again(tmp_path, redis_server,
                                                                   reward):
    """w0 takes a round's slots and is killed -9 holding them; the buffer and Redis are
    killed -9 too and started again. w1, started afterwards, gets the dead worker's prompts
    first, once their leases expire, and every prompt is still accepted once per epoch."""
    job_file = cursor_job(tmp_path, lease_seconds=2)
    buffer = BufferProcess(job_file, redis_server.url, tmp_path / "buffer.log").start()
    gate = Gate(redis_server.url, buffer.address)
    w0 = Worker("w0", job_file, buffer.address, reward.address, tmp_path / "w0.log")
    w1 = None
    try:
        w0.wait_healthy()
        gate.wait(lambda: gate.accepted() == BATCH, "w0's first round accepted")
        # Its engine paused, w0 takes the next round's slots and holds them.
        assert httpx.post(f"{w0.url}/pause_generation", json={"mode": "in_place"},
                          timeout=30).status_code == 200
        gate.next_version()
        gate.wait(lambda: gate.held("w0") == BATCH, "w0 holding the second round")
        lost = sorted(int(c) for c in gate.redis.hvals(key(JOB, "cursors")))
        assert lost == list(range(BATCH, 2 * BATCH))
        w0.kill()
        # Every process of the job's state goes down and comes back.
        buffer.kill()
        redis_server.kill()
        redis_server.start()
        buffer.start()
        gate.reconnect(redis_server.url)
        gate.wait(gate.serving, "the buffer serving again")
        assert sorted(int(c) for c in gate.redis.hvals(key(JOB, "cursors"))) == lost

        w1 = Worker("w1", job_file, buffer.address, reward.address, tmp_path / "w1.log")
        w1.wait_healthy()
        gate.run_to_the_end([w1])
        groups = check_each_prompt_once_per_epoch(gate, job_file)
        by_cursor = {c: slot.split(":")[0] for c, _, slot in groups}
        assert {by_cursor[c] for c in range(BATCH)} == {"w0"}
        assert {by_cursor[c] for c in range(BATCH, PROMPTS * EPOCHS)} == {"w1"}
        # w0's four, and any of w1's that ran out on a busy machine (their prompts came back).
        assert gate.stats().expired_slots_total >= BATCH
    finally:
        w0.kill()
        if w1 is not None:
            assert w1.stop() == 130, w1.log.read_text()[-3000:]
        gate.close()
        buffer.kill()
