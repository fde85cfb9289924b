"""The rollout workflow with a real engine and tiny model, and the in-process gate (which hands
out prompt cursors as the buffer does)."""

import asyncio

import pytest

from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.engine.types import SamplingParams
from asyncrl.engine.api import TorchInferenceEngine
from asyncrl.rollout.workflow import (
    EngineGenerator,
    PromptItem,
    RolloutWorkflow,
    SingleTurnGroups,
)
from asyncrl.data.samples import Trajectory
from support.rollout import InOrder, InProcessGate
from support.tiny_model import tiny_model


class CountingScorer:
    """Rewards a response by whether it contains the reference token (deterministic)."""

    def __init__(self):
        self.calls = 0
        self.cut: list[list[bool]] = []

    async def score(self, item, responses, cut=None):
        self.calls += 1
        self.cut.append(cut)
        return [1.0 if item.reference in r else 0.0 for r in responses]


def items(count):
    return InOrder([PromptItem(f"p{i}", [1 + i, 2 + i, 3 + i], reference=7)
                    for i in range(count)])


@pytest.fixture
def engine():
    model = tiny_model(vocab_size=64)
    engine = TorchEngine(model, max_running_requests=8, max_sequence_length=64, seed=0).start()
    yield engine
    engine.stop()


def test_workflow_puts_scored_groups_with_complete_records(engine):
    gate = InProcessGate(max_staleness=10, batch_size=2, prompts=5)
    scorer = CountingScorer()
    workflow = RolloutWorkflow(
        items(5),
        source=SingleTurnGroups(
            generator=EngineGenerator(TorchInferenceEngine(engine)),
            scorer=scorer,
            group_size=3,
            params=SamplingParams(max_new_tokens=6),
        ),
        gate=gate,
    )
    stats = asyncio.run(workflow.run())
    assert stats.groups_put == 5 and scorer.calls == 5 and gate.running == 0
    assert sorted(g.prompt_id for g in gate.groups) == [f"p{i}" for i in range(5)]
    # The scorer is told which responses ran into maxNewTokens (reward.truncatedReward): with
    # no end-of-sequence token, all of them.
    assert scorer.cut == [[True] * 3] * 5
    assert all(t.finish_reason == "length" for g in gate.groups for t in g.samples)
    for group in gate.groups:
        assert len(group.samples) == 3
        for sample in group.samples:
            n = len(sample.response_ids)
            assert n == 6 and len(sample.behaviour_logprobs) == n and sample.token_versions == [0] * n
            assert sample.loss_mask == [0] * 3 + [1] * 6
            assert sample.reward == (1.0 if 7 in sample.response_ids else 0.0)
            assert sample.generate_seconds > 0 and sample.reward_seconds >= 0


def test_workflow_requests_are_counted_in_the_rollout_metrics(engine):
    from prometheus_client import generate_latest

    from asyncrl.rollout.metrics import RolloutMetrics

    metrics = RolloutMetrics("job")
    workflow = RolloutWorkflow(
        items(2),
        source=SingleTurnGroups(
            generator=EngineGenerator(TorchInferenceEngine(engine), metrics),
            scorer=CountingScorer(),
            group_size=3,
            params=SamplingParams(max_new_tokens=6),
        ),
        gate=InProcessGate(max_staleness=10, batch_size=2, prompts=2),
    )
    asyncio.run(workflow.run())
    text = generate_latest(metrics.registry).decode()
    assert 'asyncrl_rollout_requests_total{finish_reason="length",rljob="job"} 6.0' in text
    assert 'asyncrl_rollout_request_seconds_count{rljob="job"} 6.0' in text


class WatchedGate(InProcessGate):
    """Counts the workflow's requests for a slot that found the gate closed."""

    refused = 0

    async def acquire(self):
        if self.capacity() <= 0:
            self.refused += 1
        return await super().acquire()


async def until(condition, what: str, timeout: float = 60.0) -> None:
    """Polls `condition` (the limit only catches a hang)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, f"never {what}"
        await asyncio.sleep(0.01)


def test_gate_holds_rollouts_until_the_trainer_advances(engine):
    """η = 0, batch 2: only 2 groups may exist before version 1, 4 before version 2."""
    gate = WatchedGate(max_staleness=0, batch_size=2, prompts=6)

    async def scenario():
        workflow = RolloutWorkflow(
            items(6),
            source=SingleTurnGroups(
                generator=EngineGenerator(TorchInferenceEngine(engine)),
                scorer=CountingScorer(),
                group_size=2,
                params=SamplingParams(max_new_tokens=3),
            ),
            gate=gate,
        )
        run = asyncio.create_task(workflow.run())
        # Both groups of the budget done, and the workflow asking for a third slot: from here
        # only a new version can let anything start. peak_in_flight records any overshoot.
        await until(lambda: gate.accepted == 2 and gate.running == 0 and gate.refused >= 1,
                    "2 groups with the workflow waiting at the gate")
        assert gate.peak_in_flight == 2 and not run.done()
        refused = gate.refused
        await gate.set_version(1)
        await until(lambda: gate.accepted == 4 and gate.running == 0 and gate.refused > refused,
                    "4 groups with the workflow waiting at the gate")
        assert gate.peak_in_flight == 4 and not run.done()
        await gate.set_version(2)
        await asyncio.wait_for(run, 60)

    asyncio.run(scenario())
    assert gate.accepted == 6 and gate.peak_in_flight <= 6


def test_failed_generation_releases_its_slot_and_its_prompt_comes_back(engine, caplog):
    """A group whose generation fails gives its slot back unused: the gate hands its prompt
    out again (here to the same workflow, which then succeeds); the worker goes on."""
    gate = InProcessGate(max_staleness=4, batch_size=2, prompts=1)

    class FailsOnce:
        def __init__(self, engine):
            self.calls = 0
            self.engine = EngineGenerator(TorchInferenceEngine(engine))

        async def generate(self, prompt_ids, params):
            self.calls += 1
            if self.calls == 1:
                raise RuntimeError("engine went away")
            return await self.engine.generate(prompt_ids, params)

    workflow = RolloutWorkflow(
        items(1),
        source=SingleTurnGroups(
            generator=FailsOnce(engine),
            scorer=CountingScorer(),
            group_size=2,
            params=SamplingParams(max_new_tokens=3),
        ),
        gate=gate,
    )
    with caplog.at_level("WARNING", logger="asyncrl.rollout.workflow"):
        stats = asyncio.run(asyncio.wait_for(workflow.run(), 60))
    assert gate.released == ["generation failed"] and stats.groups_failed == 1
    assert [g.prompt_id for g in gate.groups] == ["p0"] and stats.groups_put == 1
    assert gate.used_up() and gate.running == 0
    assert "handed out again" in caplog.text and "went away" in caplog.text


def test_group_ids_are_unique_across_workers_over_the_same_prompts(engine):
    """Two workers (or one restarted) walk the same prompts from the same start: their group
    ids must still differ, or the buffer's history could not tell their groups apart."""
    gate = InProcessGate(max_staleness=10, batch_size=2)
    for _ in range(2):
        workflow = RolloutWorkflow(
            items(3),
            source=SingleTurnGroups(
                generator=EngineGenerator(TorchInferenceEngine(engine)),
                scorer=CountingScorer(),
                group_size=2,
                params=SamplingParams(max_new_tokens=2),
            ),
            gate=gate,
        )
        asyncio.run(workflow.run(max_groups=3))
    ids = [g.group_id for g in gate.groups]
    assert len(ids) == 6 and len(set(ids)) == 6, ids
    assert all(g.group_id.startswith(f"{g.prompt_id}#") for g in gate.groups)


class Overlapping:
    """A group source that takes a while per group and records how many run at once."""

    def __init__(self):
        self.running = self.peak = 0

    async def samples(self, item, cursor):
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(0.02)
            return [Trajectory(prompt_ids=list(item.prompt_ids), response_ids=[5],
                               behaviour_logprobs=[-1.0], token_versions=[0], reward=float(i),
                               finish_reason="stop", generate_seconds=0.02, reward_seconds=0.0)
                    for i in range(2)]
        finally:
            self.running -= 1


@pytest.mark.parametrize("share", [None, 2])
def test_a_worker_runs_at_most_its_share_of_the_job_wide_limit(share):
    """Replicas share rollout.maxConcurrentRollouts: a worker with a share asks for no slot
    while it runs that many groups, so another worker finds the rest free."""
    gate = InProcessGate(max_staleness=10, batch_size=2, prompts=6)
    source = Overlapping()
    workflow = RolloutWorkflow(items(6), source=source, gate=gate, max_in_flight=share)
    stats = asyncio.run(asyncio.wait_for(workflow.run(), 60))
    assert stats.groups_put == 6 and gate.running == 0
    assert source.peak == (6 if share is None else share), source.peak


def responses_by_prompt(seed, *, engine_seed, share):
    """Each prompt's responses from a workflow over 4 prompts on an engine of its own."""
    engine = TorchEngine(tiny_model(vocab_size=64), max_running_requests=8,
                         max_sequence_length=64, seed=engine_seed).start()
    try:
        gate = InProcessGate(max_staleness=10, batch_size=2, prompts=4)
        workflow = RolloutWorkflow(
            items(4),
            source=SingleTurnGroups(
                generator=EngineGenerator(TorchInferenceEngine(engine)),
                scorer=CountingScorer(), group_size=3,
                params=SamplingParams(max_new_tokens=8, ignore_eos=True, seed=seed)),
            gate=gate, max_in_flight=share)
        asyncio.run(asyncio.wait_for(workflow.run(), 60))
    finally:
        engine.stop()
    return {g.prompt_id: [s.response_ids for s in g.samples] for g in gate.groups}


def test_with_a_seed_a_groups_responses_do_not_depend_on_how_they_were_batched():
    """One group at a time on one engine, all four at once on another seeded otherwise: the
    same responses to each prompt, each response its own stream. Without a seed the engine's
    generator decides."""
    one_at_a_time = responses_by_prompt(3, engine_seed=0, share=1)
    assert responses_by_prompt(3, engine_seed=9, share=None) == one_at_a_time
    assert all(len({tuple(r) for r in group}) == 3 for group in one_at_a_time.values())
    assert responses_by_prompt(4, engine_seed=0, share=1) != one_at_a_time
    assert (responses_by_prompt(None, engine_seed=0, share=1)
            != responses_by_prompt(None, engine_seed=9, share=None))


class MixedWhereOdd:
    """Every response to an even-numbered prompt gets 0; an odd one's first response gets 1."""

    async def score(self, item, responses, cut=None):
        odd = int(item.prompt_id[1:]) % 2
        return [float(odd and i == 0) for i in range(len(responses))]


@pytest.mark.parametrize("skip", [True, False])
def test_uniform_groups_are_skipped_and_their_budget_given_back(engine, skip):
    """With skip_uniform, a group of equal rewards gives its slot back instead of being put.
    The gate's budget is whole again: with eta = 0 and batches of 2, the workflow gets through
    7 prompts (5 of them uniform) without the trainer advancing."""
    from prometheus_client import generate_latest

    from asyncrl.rollout.metrics import RolloutMetrics

    gate = InProcessGate(max_staleness=0, batch_size=2, prompts=7)
    metrics = RolloutMetrics("job")
    prompts = InOrder([PromptItem(f"p{i}", [1 + i, 2 + i], reference=7)
                       for i in (0, 2, 1, 4, 6, 8, 3)])
    workflow = RolloutWorkflow(
        prompts,
        source=SingleTurnGroups(
            generator=EngineGenerator(TorchInferenceEngine(engine)),
            scorer=MixedWhereOdd(),
            group_size=3,
            params=SamplingParams(max_new_tokens=2),
        ),
        gate=gate,
        skip_uniform=skip,
        on_skipped=lambda _group: metrics.observe_skipped_group(),
    )

    async def scenario():
        return await asyncio.wait_for(workflow.run(max_groups=None if skip else 2), 60)

    stats = asyncio.run(scenario())
    text = generate_latest(metrics.registry).decode()
    if skip:
        assert sorted(g.prompt_id for g in gate.groups) == ["p1", "p3"]
        assert stats.groups_put == 2 and stats.groups_skipped == 5 and gate.running == 0
        assert gate.released == ["every reward equal"] * 5
        assert 'asyncrl_rollout_skipped_groups_total{rljob="job"} 5.0' in text
    else:  # both uniform groups are put, and fill the gate
        assert sorted(g.prompt_id for g in gate.groups) == ["p0", "p2"]
        assert stats.groups_skipped == 0 and gate.released == []
        assert 'asyncrl_rollout_skipped_groups_total{rljob="job"} 0.0' in text


def test_a_run_of_skipped_groups_warns_that_no_step_may_come(engine, monkeypatch, caplog):
    """Skipped groups in a row warn, naming the field, at the threshold and at each doubling
    of it; a put group starts the count again."""
    from asyncrl.rollout import workflow as workflow_module

    monkeypatch.setattr(workflow_module, "SKIP_STREAK_WARNING", 2)
    gate = InProcessGate(max_staleness=0, batch_size=8, prompts=6)
    prompts = InOrder([PromptItem(f"p{i}", [1 + i, 2 + i], reference=7)
                       for i in (0, 2, 4, 6, 8, 1)])
    workflow = RolloutWorkflow(
        prompts,
        source=SingleTurnGroups(
            generator=EngineGenerator(TorchInferenceEngine(engine)),
            scorer=MixedWhereOdd(),
            group_size=3,
            params=SamplingParams(max_new_tokens=2),
        ),
        gate=gate,
        skip_uniform=True,
    )

    async def scenario():
        return await asyncio.wait_for(workflow.run(max_groups=5), 60)  # the five uniform ones

    with caplog.at_level("WARNING", logger="asyncrl.rollout.workflow"):
        stats = asyncio.run(scenario())
    warnings = [r.getMessage() for r in caplog.records]
    assert stats.groups_skipped == 5 and stats.skipped_in_a_row == 5
    assert [w.split(" groups")[0] for w in warnings] == ["the last 2", "the last 4"]
    assert all("algorithm.skipUniformGroups" in w and "(the last one: 0)" in w for w in warnings)

    caplog.clear()
    with caplog.at_level("WARNING", logger="asyncrl.rollout.workflow"):
        stats = asyncio.run(asyncio.wait_for(workflow.run(), 60))  # p1, which is put
    assert stats.groups_put == 1 and stats.skipped_in_a_row == 0 and not caplog.records


def test_prompts_too_long_are_dropped_counted_and_never_truncated(engine, caplog):
    """A prompt over dataset.maxPromptTokens gives its slot back with the prompt used (not
    handed out again), is counted in the metrics and logged with the running count."""
    from prometheus_client import generate_latest

    from asyncrl.rollout.metrics import RolloutMetrics

    metrics = RolloutMetrics("job")
    lengths = {"p0": 3, "p1": 6, "p2": 2, "p3": 5}
    prompts = InOrder([PromptItem(name, list(range(1, 1 + n)), reference=7)
                       for name, n in lengths.items()], max_prompt_tokens=4)
    gate = InProcessGate(max_staleness=10, batch_size=2, prompts=4)
    workflow = RolloutWorkflow(
        prompts,
        source=SingleTurnGroups(
            generator=EngineGenerator(TorchInferenceEngine(engine)),
            scorer=CountingScorer(),
            group_size=2,
            params=SamplingParams(max_new_tokens=2),
        ),
        gate=gate,
        on_dropped=lambda _item: metrics.observe_dropped_prompt("too_long"),
    )
    with caplog.at_level("WARNING", logger="asyncrl.rollout.workflow"):
        stats = asyncio.run(asyncio.wait_for(workflow.run(), 60))
    assert sorted(g.prompt_id for g in gate.groups) == ["p0", "p2"]
    assert all(s.prompt_ids == list(range(1, 1 + lengths[g.prompt_id]))
               for g in gate.groups for s in g.samples)
    assert stats.prompts_dropped == 2 and gate.released == ["prompt too long"] * 2
    assert gate.used_up() and gate.reissue == []
    text = generate_latest(metrics.registry).decode()
    assert 'asyncrl_rollout_dropped_prompts_total{reason="too_long",rljob="job"} 2.0' in text
    dropped = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 2 and "p1 has 6 tokens" in dropped[0]
    assert dropped[1].endswith("(2 dropped by this worker so far)")
