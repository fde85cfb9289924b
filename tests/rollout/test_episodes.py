"""Episodes (rollout.workflow.kind: episode): an episode function drives the torch engine
through the official OpenAI client, its calls are recorded with every token's log-prob and
version, and become training samples (asyncrl.rollout.episodes, episode_record, trajectories).

The engine runs a tiny random model with SmolLM2's vocabulary, so prompts go through SmolLM2's
real tokenizer and chat template; log-probs are checked against the trainer's own forward."""

from __future__ import annotations

import asyncio
import textwrap

import httpx
import openai
import pytest

from asyncrl.data.prompts import PromptItem
from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.engine.types import SamplingParams
from asyncrl.model.policy import load_tokenizer
from asyncrl.rollout.episode_record import EpisodeBook, EpisodeLimits
from asyncrl.rollout.episodes import (
    EpisodeFailed,
    EpisodeFunctionError,
    EpisodeGroups,
    EpisodeSettings,
    load_episode_function,
)
from asyncrl.rollout.http_api import create_app
from asyncrl.rollout.metrics import RolloutMetrics
from asyncrl.rollout.workflow import ROW_FAILURES_TO_STOP, RolloutWorkflow
from support.rollout import InOrder, InProcessGate, queued, recomputed_logprobs
from support.tiny_model import tiny_model

MODEL = "tiny-random"
RETRY = "That is not right. Try again."
# The engine decodes in float32; the trainer's forward of the same tokens agrees to this.
LOGPROB_TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def models(tokenizer):
    """The weights of versions 0 and 1."""
    return {0: tiny_model(0, len(tokenizer)), 1: tiny_model(1, len(tokenizer))}


@pytest.fixture
def worker(tokenizer, models):
    """A started torch engine at version 0, the book of its episodes and the app serving
    them, as an episode job's rollout worker has them."""
    engine = TorchEngine(tiny_model(0, len(tokenizer)), max_running_requests=8,
                         max_sequence_length=512, eos_token_ids=(tokenizer.eos_token_id,),
                         seed=0).start()
    book = EpisodeBook()
    app = create_app(engine, model_path=MODEL, metrics=RolloutMetrics(job="test-job"),
                     tokenizer=tokenizer, episodes=book,
                     episode_sampling=SamplingParams(temperature=1.0))
    yield engine, book, app
    engine.stop()


def groups(function, worker, *, group_size=1, **limits):
    outcomes: list[str] = []
    timeout = limits.pop("timeout_seconds", 60.0)
    discount = limits.pop("turn_discount", 1.0)
    settings = EpisodeSettings(group_size=group_size, limits=EpisodeLimits(**limits),
                               timeout_seconds=timeout, turn_discount=discount)
    return EpisodeGroups(function, worker[1], worker[2], settings,
                         on_episode=outcomes.append), outcomes


def item(text="What is 2 + 2?", answer="4"):
    return PromptItem("p0", [1, 2, 3], reference=answer, text=text)


async def ask(client, messages, max_tokens=8, **options):
    return await client.chat.completions.create(model=MODEL, messages=messages,
                                                max_tokens=max_tokens, **options)


def test_a_two_turn_episode_is_one_sample_with_the_environment_masked_and_each_tokens_version(
        worker, models, tokenizer):
    engine = worker[0]
    answers = []

    async def two_turns(client, row):
        question = [{"role": "user", "content": row["prompt"]}]
        first = await ask(client, question)
        answers.append(first.choices[0].message.content)
        # The trainer's next version lands between the turns.
        await asyncio.to_thread(engine.update_weights_from_state_dict,
                                models[1].state_dict(), 1)
        history = question + [{"role": "assistant", "content": answers[0]},
                              {"role": "user", "content": RETRY}]
        second = await ask(client, history)
        answers.append(second.choices[0].message.content)
        return 1.0 if row["answer"] in answers[-1] else 0.25

    source, outcomes = groups(two_turns, worker)
    [sample] = asyncio.run(source.samples(item()))
    assert outcomes == ["completed"] and not sample.continues_episode
    mask = sample.response_mask
    first, rest = mask.index(0), mask[mask.index(0):]
    second = len(mask) - (rest.index(1) + first)  # the tokens of the second answer
    environment = sample.response_ids[first:len(mask) - second]
    # The model's tokens are exactly the two answers; between them, the chat template's
    # markers and the environment's reply, masked out.
    assert mask == [1] * first + [0] * len(environment) + [1] * second
    assert tokenizer.decode(sample.response_ids[:first], skip_special_tokens=True) == answers[0]
    assert tokenizer.decode(sample.response_ids[-second:], skip_special_tokens=True) == answers[1]
    assert RETRY in tokenizer.decode(environment)
    assert sample.loss_mask == [0] * len(sample.prompt_ids) + mask
    # Each model token keeps the version that made it; the environment's carry the one before.
    assert sample.token_versions == [0] * (first + len(environment)) + [1] * second
    assert all(v == 0 for v, m in zip(sample.behaviour_logprobs, mask) if not m)
    model_tokens = [i for i, m in enumerate(mask) if m]
    recomputed = recomputed_logprobs(models, sample.prompt_ids, sample.response_ids,
                                     sample.token_versions)
    behaviour = [sample.behaviour_logprobs[i] for i in model_tokens]
    assert max(abs(recomputed[i].item() - b) for i, b in zip(model_tokens, behaviour)) \
        < LOGPROB_TOLERANCE
    assert sample.reward in (1.0, 0.25) and sample.finish_reason in ("stop", "length")
    assert len(worker[1]) == 0 and queued(engine) == 0


def test_turns_that_do_not_extend_each_other_stay_separate_samples_of_one_episode(worker):
    async def rewritten(client, row):
        first = await ask(client, [{"role": "user", "content": row["prompt"]}])
        # A fresh conversation: no earlier call's tokens are a prefix of it.
        second = await ask(client, [{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": row["prompt"]}])
        return {first.id: 0.5, second.id: 1.0}

    source, _ = groups(rewritten, worker, group_size=2, turn_discount=0.5)
    samples = asyncio.run(source.samples(item()))
    assert [s.continues_episode for s in samples] == [False, True, False, True]
    # Per-completion rewards, each earlier turn's plus the discounted next one's.
    assert [s.reward for s in samples] == [0.5 + 0.5 * 1.0, 1.0] * 2
    assert all(s.response_mask == [] and s.model_tokens == len(s.response_ids)
               for s in samples)


def test_a_call_after_its_episode_ended_is_refused_and_records_nothing(worker):
    base_urls = []

    async def leaky(client, row):  # hands its URL to something that outlives it
        base_urls.append(str(client.base_url))
        await ask(client, [{"role": "user", "content": row["prompt"]}])
        return 1.0

    source, _ = groups(leaky, worker)
    asyncio.run(source.samples(item()))

    async def late():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=worker[2])) as http:
            client = openai.AsyncOpenAI(base_url=base_urls[0], api_key="unused",
                                        http_client=http, max_retries=0)
            await ask(client, [{"role": "user", "content": "still there?"}])

    with pytest.raises(openai.NotFoundError, match="is not running on this worker"):
        asyncio.run(late())


@pytest.mark.parametrize("catches", [False, True])
def test_max_turns_refuses_the_next_call_and_the_episode_keeps_what_it_recorded(
        worker, catches):
    async def endless(client, row):
        messages = [{"role": "user", "content": row["prompt"]}]
        try:
            while True:
                reply = await ask(client, messages, max_tokens=4)
                messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                             {"role": "user", "content": RETRY}]
        except openai.BadRequestError as exc:
            assert "rollout.workflow.maxTurns" in str(exc)
            if not catches:
                raise
            return 1.0

    source, outcomes = groups(endless, worker, max_turns=3)
    [sample] = asyncio.run(source.samples(item()))
    assert outcomes == ["completed" if catches else "cut_short"]
    assert sample.reward == (1.0 if catches else 0.0)
    # Three turns merged: three runs of model tokens.
    runs = "".join(map(str, sample.response_mask)).split("0")
    assert len([r for r in runs if r]) == 3


def test_the_episode_token_budget_bounds_each_call_and_then_refuses(worker):
    lengths = []

    async def thrifty(client, row):
        messages = [{"role": "user", "content": row["prompt"]}]
        for _ in range(3):
            try:
                reply = await ask(client, messages, max_tokens=8)
            except openai.BadRequestError as exc:
                assert "maxEpisodeTokens" in str(exc)
                return 1.0
            lengths.append(reply.usage.completion_tokens)
            messages = messages + [{"role": "user", "content": RETRY}]
        return 0.0

    source, _ = groups(thrifty, worker, max_tokens=12)
    asyncio.run(source.samples(item()))
    assert lengths[0] <= 8 and sum(lengths) <= 12 and len(lengths) <= 2


def failing_episodes():
    async def raises(client, row):
        await ask(client, [{"role": "user", "content": row["prompt"]}])
        raise ValueError("the environment broke")

    async def hangs(client, row):
        await ask(client, [{"role": "user", "content": row["prompt"]}])
        await asyncio.sleep(60)

    async def garbage(client, row):
        await ask(client, [{"role": "user", "content": row["prompt"]}])
        return "correct!"

    async def silent(client, row):
        return 1.0

    return [(raises, "error", "ValueError: the environment broke"),
            (hangs, "timeout", "rollout.workflow.timeoutSeconds"),
            (garbage, "bad_reward", "must return a finite number"),
            (silent, "no_completions", "made no call to the model")]


@pytest.mark.parametrize("function,outcome,message", failing_episodes(),
                         ids=lambda v: v if isinstance(v, str) else None)
def test_a_failing_episode_fails_its_group_alone_and_the_worker_goes_on(
        worker, function, outcome, message):
    engine, book, _ = worker
    calls = {"n": 0}

    async def every_other(client, row):  # the second row's episodes fail, the others not
        if row["prompt"] == "row 1":
            return await function(client, row)
        calls["n"] += 1
        await ask(client, [{"role": "user", "content": row["prompt"]}], max_tokens=4)
        return 1.0

    # Long enough for the other rows' short episodes on a loaded machine.
    timeout = 5.0 if outcome == "timeout" else 60.0
    source, outcomes = groups(every_other, worker, group_size=2, timeout_seconds=timeout)
    with pytest.raises(EpisodeFailed, match=message) as failed:
        asyncio.run(source.samples(item("row 1")))
    assert failed.value.outcome == outcome and outcome in outcomes

    gate = InProcessGate(max_staleness=10, batch_size=1, prompts=3)
    rows = InOrder([item(f"row {i}") for i in range(3)])
    workflow = RolloutWorkflow(rows, source=source, gate=gate)
    stats = asyncio.run(workflow.run())
    # The failed row's slot came back with its row used; the other groups are whole.
    assert stats.groups_failed == 1 and stats.groups_put == 2 and gate.running == 0
    assert gate.released == ["generation failed"] and gate.used_up()
    assert all(len(g.samples) == 2 and g.prompt_id == "p0" for g in gate.groups)
    assert calls["n"] == 4 and len(book) == 0 and queued(engine) == 0


def test_a_function_that_fails_on_every_row_stops_the_workflow_with_its_error(worker):
    async def broken(client, row):
        return row["no such field"]

    source, outcomes = groups(broken, worker)
    workflow = RolloutWorkflow(InOrder([item()]), source=source,
                               gate=InProcessGate(max_staleness=10, batch_size=1))
    with pytest.raises(RuntimeError, match="last [0-9]+ groups all failed.*KeyError: 'no such "
                       "field'.*fix the episode function"):
        asyncio.run(workflow.run())
    # Groups in flight when the limit is reached fail too (their row was already running).
    assert workflow.stats.rows_failed_in_a_row >= ROW_FAILURES_TO_STOP
    assert outcomes[:ROW_FAILURES_TO_STOP] == ["error"] * ROW_FAILURES_TO_STOP


def test_an_episode_function_that_cannot_be_used_is_refused_naming_the_fix(tmp_path):
    (tmp_path / "my_episodes.py").write_text(textwrap.dedent("""
        def not_async(client, row):
            return 1.0

        async def episode(client, row):
            return 1.0
    """))
    assert load_episode_function("my_episodes:episode", str(tmp_path)).__name__ == "episode"
    with pytest.raises(EpisodeFunctionError, match="importing 'nowhere'.*rollout.workflow.path"):
        load_episode_function("nowhere:episode", str(tmp_path))
    with pytest.raises(EpisodeFunctionError, match="has no 'missing'"):
        load_episode_function("my_episodes:missing", str(tmp_path))
    with pytest.raises(EpisodeFunctionError, match="async def not_async"):
        load_episode_function("my_episodes:not_async", str(tmp_path))


def test_episode_outcomes_are_counted_in_the_rollout_metrics(worker):
    from prometheus_client import generate_latest

    metrics = RolloutMetrics("job")

    async def fine(client, row):
        await ask(client, [{"role": "user", "content": row["prompt"]}], max_tokens=2)
        return 1.0

    source = EpisodeGroups(fine, worker[1], worker[2],
                           EpisodeSettings(group_size=2, limits=EpisodeLimits()),
                           on_episode=metrics.observe_episode)
    asyncio.run(source.samples(item()))
    text = generate_latest(metrics.registry).decode()
    assert 'asyncrl_rollout_episodes_total{outcome="completed",rljob="job"} 2.0' in text


def test_an_episode_call_samples_at_the_jobs_temperature_or_is_refused(worker):
    async def picky(client, row):
        messages = [{"role": "user", "content": row["prompt"]}]
        await ask(client, messages, max_tokens=2, temperature=1.0)  # the job's: accepted
        with pytest.raises(openai.BadRequestError, match="rollout.temperature"):
            await ask(client, messages, max_tokens=2, temperature=0.3)
        return 1.0

    source, outcomes = groups(picky, worker)
    asyncio.run(source.samples(item()))
    assert outcomes == ["completed"]
