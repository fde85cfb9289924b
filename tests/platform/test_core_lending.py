"""Cores lent between the trainer and the rollout worker of one machine: each computes with
its own threads plus those the other lends while it waits."""

import pytest
import torch

from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.engine.types import SamplingParams
from asyncrl.platform import core_lending
from asyncrl.platform.core_lending import CoreLending, create_lending_file, lending_from
from asyncrl.trainer.step import PolicyUpdater, UpdateConfig
from support.tiny_model import tiny_model
from support.trainer import make_samples
from support.trainer import tiny_model as tiny_policy
from support.waiting import wait_for


@pytest.fixture(autouse=True)
def torch_threads():
    """Each test sets torch's thread count through lending; the next one starts as before."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def lending_file(tmp_path):
    return create_lending_file(tmp_path / "cores")


def cores(monkeypatch, count: int) -> None:
    """The machine has `count` cores, as far as lending knows."""
    monkeypatch.setattr(core_lending.os, "sched_getaffinity", lambda pid: set(range(count)))


def test_a_process_computes_with_the_threads_the_other_lends_while_it_waits(lending_file,
                                                                            monkeypatch):
    cores(monkeypatch, 3)
    trainer = CoreLending(lending_file, "trainer", 1)
    rollout = CoreLending(lending_file, "rollout", 2)
    trainer.fit()
    assert trainer.current == torch.get_num_threads() == 1
    rollout.lend()  # the rollout waits for a policy version
    trainer.fit()
    assert trainer.current == torch.get_num_threads() == 3
    rollout.reclaim()  # it generates again: the trainer gives them back at its next pass
    assert trainer.current == 3
    trainer.fit()
    assert trainer.current == torch.get_num_threads() == 1
    trainer.lend()  # the trainer waits for a batch
    rollout.fit()
    assert rollout.current == torch.get_num_threads() == 3
    trainer.close()  # a process that ends lends nothing any more
    rollout.fit()
    assert rollout.current == 2


def test_no_process_computes_with_more_threads_than_there_are_cores(lending_file, monkeypatch):
    cores(monkeypatch, 2)
    trainer = CoreLending(lending_file, "trainer", 1)
    rollout = CoreLending(lending_file, "rollout", 2)  # --rollout-threads 2 on two cores
    rollout.lend()
    trainer.fit()
    assert trainer.current == 2
    trainer.lend()
    rollout.reclaim()
    rollout.fit()
    assert rollout.current == 2


def test_lending_refuses_what_it_cannot_share(lending_file):
    with pytest.raises(ValueError, match="slot must be one of"):
        CoreLending(lending_file, "reward", 1)
    with pytest.raises(ValueError, match="threads must be 1 to 255"):
        CoreLending(lending_file, "trainer", 0)
    with pytest.raises(ValueError, match="own thread count"):
        lending_from(lending_file, "trainer", None)
    assert lending_from(None, "trainer", 2) is None


def test_the_engine_lends_while_idle_and_computes_with_what_is_lent(lending_file, monkeypatch):
    cores(monkeypatch, 2)
    trainer = CoreLending(lending_file, "trainer", 1)
    rollout = CoreLending(lending_file, "rollout", 1)
    engine = TorchEngine(tiny_model(1, 256).eval(), max_running_requests=2,
                         max_sequence_length=32, seed=0, lending=rollout).start()
    try:
        trainer.lend()
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        assert len(engine.submit([1, 2, 3], params).result(timeout=60).output_ids) == 4
        assert rollout.current == 2  # its steps computed with the trainer's thread too
        # Done, the engine waits for work and lends its thread: the trainer computes with it.
        trainer.reclaim()
        wait_for(lambda: (trainer.fit(), trainer.current)[1] == 2, 30,
                 "the idle engine's thread lent")
        # Work again: the engine takes its thread back before its first step.
        engine.submit([4, 5], params).result(timeout=60)
        assert rollout.current == 1
    finally:
        engine.stop()


def test_the_trainer_fits_its_threads_before_every_pass(lending_file):
    passes = []
    model = tiny_policy()
    updater = PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            UpdateConfig(micro_batch_max_tokens=10_000),
                            before_pass=lambda: passes.append("pass"))
    updater.step(make_samples(4))
    layers = len(model.model.layers)
    # the forward, the backward and the optimizer step, and each layer forward and backward
    assert len(passes) == 3 + 2 * layers
    passes.clear()
    model = tiny_policy()
    split = PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          UpdateConfig(micro_batch_max_tokens=16),
                          before_pass=lambda: passes.append("pass"))
    stats = split.step(make_samples(4))
    assert len(passes) == (2 + 2 * layers) * stats["micro_batches"] + 1
