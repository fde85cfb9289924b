"""The shipped example episodes (examples/episodes) through the worker's recording API, over a
scripted model that answers with chosen text: what each rewards, what the environment adds,
and how the turns become samples. (Runs of the examples with SmolLM2 are in the README.)"""

from __future__ import annotations

import asyncio
import json

import pytest
from fastapi import FastAPI

from asyncrl.data.prompts import PromptItem
from asyncrl.model.policy import load_tokenizer
from asyncrl.rollout.episode_record import EpisodeBook, EpisodeLimits
from asyncrl.rollout.episodes import EpisodeGroups, EpisodeSettings, load_episode_function
from asyncrl.rollout.openai_api import openai_router
from support import ROOT
from support.scripted import Scripted

EXAMPLES = ROOT / "examples" / "episodes"
QUESTION = ("Fatima has 2 books. Fatima gets 4 more. How many books does Fatima have now? "
            "Give the final answer as \\boxed{N}.")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def run_example(tokenizer, name: str, *answers: str):
    """One episode of examples/episodes/<name>.py on the arith row above, the model answering
    `answers` in turn; its samples and the scripted model (with the prompts it got)."""
    model = Scripted(tokenizer, *answers)
    book = EpisodeBook()
    app = FastAPI()
    app.include_router(openai_router(model, tokenizer, model_name="smollm2", episodes=book,
                                     max_sequence_length=1024))
    function = load_episode_function(f"{name}:episode", str(EXAMPLES))
    settings = EpisodeSettings(group_size=1, limits=EpisodeLimits(max_turns=2,
                                                                  default_max_tokens=64))
    source = EpisodeGroups(function, book, app, settings)
    item = PromptItem("arith-0", [1], reference=6, text=QUESTION)
    return asyncio.run(source.samples(item)), model


def model_runs(mask: list[int]) -> int:
    """How many stretches of the model's own tokens a response mask holds."""
    return len([run for run in "".join(map(str, mask)).split("0") if run])


def test_retry_rewards_a_right_first_answer_fully(tokenizer):
    [sample], model = run_example(tokenizer, "retry", "2 + 4 = 6, so \\boxed{6}.")
    assert sample.reward == 1.0 and len(model.prompts) == 1 and sample.response_mask == []


def test_retry_asks_again_and_the_two_answers_are_one_sample(tokenizer):
    [sample], model = run_example(tokenizer, "retry", "\\boxed{5}", "Sorry: \\boxed{6}.")
    assert sample.reward == 0.5
    # The second prompt is the first call's very tokens, then the environment's reply.
    first = model.prompts[0] + model.answers[0]
    assert model.prompts[1][:len(first)] == first
    assert model_runs(sample.response_mask) == 2
    masked = [t for t, m in zip(sample.response_ids, sample.response_mask) if not m]
    assert "That is not right. Try again" in tokenizer.decode(masked)


def test_retry_scores_zero_after_two_wrong_answers(tokenizer):
    [sample], model = run_example(tokenizer, "retry", "\\boxed{5}", "\\boxed{7}")
    assert sample.reward == 0.0 and len(model.prompts) == 2


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 4"}}\n</tool_call>'


def test_the_calculator_runs_the_models_tool_call_and_rewards_the_answer_with_a_bonus(
        tokenizer):
    samples, model = run_example(tokenizer, "calculator", CALL, "So \\boxed{6}.")
    # The tool was offered, its result came back to the model as a tool response.
    assert "calculator" in tokenizer.decode(model.prompts[0])
    assert "<tool_response>\n6\n</tool_response>" in tokenizer.decode(model.prompts[1])
    # The call is shown back to the model as it wrote it, so the turns merge into one
    # sample: both of the model's turns trained on, the tool's output never.
    [sample] = samples
    assert sample.reward == pytest.approx(1.2) and model_runs(sample.response_mask) == 2
    masked = [t for t, m in zip(sample.response_ids, sample.response_mask) if not m]
    assert "<tool_response>\n6\n</tool_response>" in tokenizer.decode(masked)


def test_the_calculator_gives_no_bonus_for_a_call_it_cannot_evaluate(tokenizer):
    bad = CALL.replace("2 + 4", "import os")
    samples, model = run_example(tokenizer, "calculator", bad, "\\boxed{6}")
    assert "error: SyntaxError" in tokenizer.decode(model.prompts[1])
    assert samples[-1].reward == 1.0


def test_the_calculator_tool_evaluates_arithmetic_only():
    import sys
    sys.path.insert(0, str(EXAMPLES))
    from calculator import calculate

    assert calculate(json.dumps({"expression": "12 * (3 + 4) - 1"})) == "83"
    assert calculate(json.dumps({"expression": "__import__('os')"})).startswith("error")
    assert calculate("not json").startswith("error")
