"""An agent framework drives an episode unchanged: an OpenAI Agents SDK agent with a function
tool, its model the episode's client (OpenAIChatCompletionsModel), over a scripted model that
calls the tool and then answers. The episode's calls are recorded and become one sample, the
tool's output masked out."""

from __future__ import annotations

import asyncio

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from fastapi import FastAPI

from asyncrl.data.prompts import PromptItem
from asyncrl.model.policy import load_tokenizer
from asyncrl.rollout.episode_record import EpisodeBook, EpisodeLimits
from asyncrl.rollout.episodes import EpisodeGroups, EpisodeSettings
from asyncrl.rollout.openai_api import openai_router
from support.scripted import Scripted

MODEL = "smollm2"
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 4}}\n</tool_call>'


@function_tool
def add(a: int, b: int) -> int:
    """Adds two whole numbers."""
    return a + b


async def agent_episode(client, row: dict) -> float:
    agent = Agent(name="solver", instructions="Use the add tool, then give \\boxed{N}.",
                  model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
                  tools=[add])
    result = await Runner.run(agent, row["prompt"], max_turns=3)
    return 1.0 if "\\boxed{6}" in result.final_output else 0.0


def test_an_agents_sdk_agent_runs_an_episode_and_its_turns_become_one_sample():
    set_tracing_disabled(True)  # the SDK would send traces to OpenAI's servers
    tokenizer = load_tokenizer()
    model = Scripted(tokenizer, CALL, "2 + 4 is \\boxed{6}.")
    book = EpisodeBook()
    app = FastAPI()
    app.include_router(openai_router(model, tokenizer, model_name=MODEL, episodes=book,
                                     max_sequence_length=2048))
    settings = EpisodeSettings(group_size=1, limits=EpisodeLimits(max_turns=3,
                                                                  default_max_tokens=64))
    source = EpisodeGroups(agent_episode, book, app, settings)
    item = PromptItem("p0", [1], reference=6, text="What is 2 + 4?")
    samples = asyncio.run(source.samples(item))
    # The SDK offered its tool and ran it on the model's call; the result reached the model.
    assert '"name": "add"' in tokenizer.decode(model.prompts[0])
    assert "<tool_response>\n6\n</tool_response>" in tokenizer.decode(model.prompts[1])
    [sample] = samples
    assert sample.reward == 1.0
    runs = [r for r in "".join(map(str, sample.response_mask)).split("0") if r]
    assert len(runs) == 2  # the call and the answer, the model's own tokens
    masked = [t for t, m in zip(sample.response_ids, sample.response_mask) if not m]
    assert "<tool_response>" in tokenizer.decode(masked)
