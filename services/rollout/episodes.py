"""Episodes (rollout.workflow.kind: episode): a group is `groupSize` runs of the job's episode
function on one dataset row.

    async def episode(client: openai.AsyncOpenAI, row: dict) -> float | dict[str, float]

`client` is the official OpenAI client, pointed at this worker's OpenAI-compatible API under
the episode's own base URL (`/episodes/{id}/v1`, served in-process through the app, not over
the network), so any agent built on the OpenAI client drives the policy unchanged, and every
call is recorded (asyncrl.rollout.episode_record). `row` is the dataset row as a python reward
gets it (`episode_row`). The function returns the episode's reward, or
rewards by response id; asyncrl.rollout.trajectories turns the recorded calls into samples.

An episode that raises, runs past rollout.workflow.timeoutSeconds, records no call or returns
no usable reward fails, and its group with it: the group's other episodes are cancelled, the
failure is counted (`asyncrl_rollout_episodes_total{outcome}`), nothing of the group reaches
the buffer, its slot is given back with the row used (a row that fails would most likely fail
again), and the worker goes on. An episode refused a call by its limits (maxTurns,
maxEpisodeTokens) that then raises is cut short, not failed: what it recorded is kept with
reward 0.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
import sys
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import httpx
import openai

from asyncrl.clients.reward import reward_row
from asyncrl.data.prompts import PromptItem
from asyncrl.data.samples import Trajectory
from asyncrl.rollout.episode_record import Episode, EpisodeBook, EpisodeLimits
from asyncrl.rollout.trajectories import episode_samples
from asyncrl.rollout.workflow import RowFailed

log = logging.getLogger(__name__)

# What `_run` returns for an episode that raised after its limits refused a call.
_CUT_SHORT = object()

EpisodeFunction = Callable[[openai.AsyncOpenAI, dict], Awaitable[Any]]


class EpisodeFunctionError(Exception):
    """rollout.workflow.function cannot be used; the message says why and how to fix it."""


class EpisodeFailed(RowFailed):
    """An episode that gave nothing to train on; `outcome` is its metrics label."""

    def __init__(self, outcome: str, message: str):
        super().__init__(message)
        self.outcome = outcome


def load_episode_function(function: str, path: str | None = None) -> EpisodeFunction:
    """Imports rollout.workflow.function ("package.module:name"), with `path` first on the
    import path; EpisodeFunctionError names what is wrong."""
    module_name, _, name = function.partition(":")
    if path and path not in sys.path:
        sys.path.insert(0, path)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        where = f" (with {path!r} on the import path)" if path else ""
        raise EpisodeFunctionError(
            f"rollout.workflow.function {function!r}: importing {module_name!r}{where} failed: "
            f"{type(exc).__name__}: {exc}; fix: check the module name and "
            f"rollout.workflow.path") from None
    target = getattr(module, name, None)
    if target is None:
        raise EpisodeFunctionError(
            f"rollout.workflow.function {function!r}: module {module_name!r} has no "
            f"{name!r}")
    if not inspect.iscoroutinefunction(target):
        raise EpisodeFunctionError(
            f"rollout.workflow.function {function!r} is not an async function; fix: define "
            f"it as `async def {name}(client, row)`")
    return target


@dataclass(frozen=True)
class EpisodeSettings:
    group_size: int
    limits: EpisodeLimits
    timeout_seconds: float = 300.0
    turn_discount: float = 1.0

    @classmethod
    def from_spec(cls, spec) -> EpisodeSettings:
        """From an RLJob spec with rollout.workflow.kind: episode."""
        workflow = spec.rollout.workflow
        return cls(
            group_size=spec.algorithm.group_size,
            limits=EpisodeLimits(max_turns=workflow.max_turns,
                                 max_tokens=workflow.max_episode_tokens,
                                 default_max_tokens=spec.rollout.max_new_tokens),
            timeout_seconds=workflow.timeout_seconds,
            turn_discount=workflow.turn_discount,
        )


def episode_row(item: PromptItem) -> dict[str, Any]:
    """The row an episode gets: the one a python reward reads (a file's row, or a generated
    prompt's prompt_id, prompt and answer), with `prompt`, the prompt's text before the chat
    template, where the row has no field of that name."""
    row = reward_row(item)
    row.setdefault("prompt", item.text)
    return row


class EpisodeGroups:
    """The workflow's group source for episode jobs (asyncrl.rollout.workflow.GroupSource)."""

    def __init__(self, function: EpisodeFunction, book: EpisodeBook, app, settings:
                 EpisodeSettings, *, on_episode: Callable[[str], None] = lambda _outcome: None):
        """`app`: the ASGI app serving the OpenAI-compatible API with `book`; `on_episode`
        is told each episode's outcome (completed, cut_short or a failure's)."""
        self._function = function
        self._book = book
        self._transport = httpx.ASGITransport(app=app)
        self._settings = settings
        self._on_episode = on_episode

    async def samples(self, item: PromptItem, cursor: int = 0) -> list[Trajectory]:
        # The episode function's own calls choose their sampling (and `seed`), not the cursor.
        tasks = [asyncio.ensure_future(self._episode(item))
                 for _ in range(self._settings.group_size)]
        try:
            episodes = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # one failed: the group fails, its other episodes stop
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return [sample for samples in episodes for sample in samples]

    async def _episode(self, item: PromptItem) -> list[Trajectory]:
        settings = self._settings
        episode = self._book.open(settings.limits)
        began = time.perf_counter()
        try:
            try:
                returned = await self._run(episode, episode_row(item))
            finally:
                self._book.close(episode)  # a call still on its way is refused from now on
            rewards = 0.0 if returned is _CUT_SHORT else _rewards(returned, episode)
            if not episode.completions:
                raise EpisodeFailed("no_completions", "the episode made no call to the model, "
                                    "so it has nothing to train on")
        except EpisodeFailed as exc:
            self._on_episode(exc.outcome)
            raise
        self._on_episode("cut_short" if returned is _CUT_SHORT else "completed")
        return episode_samples(episode.completions, rewards, discount=settings.turn_discount,
                               seconds=time.perf_counter() - began)

    async def _run(self, episode: Episode, row: dict[str, Any]) -> Any:
        """The function's return value; _CUT_SHORT for an episode cut short by its limits."""
        timeout = self._settings.timeout_seconds
        async with httpx.AsyncClient(transport=self._transport, timeout=timeout) as http:
            client = openai.AsyncOpenAI(
                base_url=f"http://rollout/episodes/{episode.episode_id}/v1",
                api_key="asyncrl-episode", http_client=http, max_retries=0)
            try:
                return await asyncio.wait_for(self._function(client, row), timeout)
            except asyncio.TimeoutError:
                raise EpisodeFailed("timeout", f"the episode ran past its {timeout:g} s "
                                    "(rollout.workflow.timeoutSeconds)") from None
            except Exception as exc:
                if episode.limit_reached is not None:
                    return _CUT_SHORT
                raise EpisodeFailed("error", f"the episode raised {type(exc).__name__}: "
                                    f"{exc}") from exc


def _rewards(returned: Any, episode: Episode) -> float | dict[str, float]:
    """The function's return value as rewards; EpisodeFailed("bad_reward") when it is not a
    finite number or a dict of them by the episode's response ids."""
    if _finite(returned):
        return float(returned)
    if isinstance(returned, dict) and returned:
        known = {c.response_id for c in episode.completions}
        unknown = [key for key in returned if key not in known]
        bad = [key for key, value in returned.items() if not _finite(value)]
        if not unknown and not bad:
            return {key: float(value) for key, value in returned.items()}
        raise EpisodeFailed("bad_reward", f"the episode returned rewards for response ids it "
                            f"did not get ({unknown[:3]})" if unknown else
                            f"the episode's rewards for {bad[:3]} are not finite numbers")
    raise EpisodeFailed("bad_reward", f"the episode returned {returned!r:.80}; it must return "
                        "a finite number, or a dict of them by response id")


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)
