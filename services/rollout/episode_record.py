"""What an episode's calls to the OpenAI-compatible API leave behind, and the limits they run
under.

An episode (asyncrl.rollout.episodes) talks to the worker at `/episodes/{id}/v1`; each call
there passes through its `Episode`: checked against the episode's limits before it reaches the
engine, then recorded as `Completion`s (prompt token ids, output token ids, log-probs and the
policy version of every output token) once it finishes.

A multi-turn conversation sends the whole conversation again with each call. Tokenizing it
afresh could split the model's own earlier answer into other tokens than it generated, and the
turns would no longer line up into one sequence. So a prompt whose text starts with the text of
a recorded call (its prompt and output, special tokens included) reuses that call's very
tokens, and only the text after them is tokenized: the next call extends the last one
token-for-token, and asyncrl.rollout.trajectories merges them into one training sequence.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from asyncrl.engine.types import GenerationResult


class EpisodeLimitReached(Exception):
    """A call the episode's limits refuse (rollout.workflow.maxTurns, maxEpisodeTokens)."""


class EpisodeNotRunning(Exception):
    """A call for an episode that ended (returned, failed or timed out) or never began."""


@dataclass(frozen=True)
class Completion:
    """One recorded completion: a choice of one API call."""

    response_id: str  # the API response's `id`, what per-completion rewards are keyed by
    prompt_ids: list[int]
    result: GenerationResult  # cut after a stop string, as the API returned it

    @property
    def ids(self) -> list[int]:
        """The prompt and output: the whole sequence this completion saw and made."""
        return self.prompt_ids + self.result.output_ids


@dataclass(frozen=True)
class EpisodeLimits:
    max_turns: int = 8
    # Tokens the model may generate in the whole episode; None: no budget of its own.
    max_tokens: int | None = None
    # A call's max_tokens when it names none (chat completions otherwise take all the room
    # left in the context).
    default_max_tokens: int | None = None


@dataclass
class Episode:
    episode_id: str
    limits: EpisodeLimits
    completions: list[Completion] = field(default_factory=list)
    turns: int = 0
    generated_tokens: int = 0
    # The limit a call was refused by, if one was: an episode that then fails was cut short.
    limit_reached: str | None = None
    _texts: dict[int, str] = field(default_factory=dict, repr=False)

    def allow(self, max_tokens: int | None, n: int) -> int | None:
        """Checks a call asking for `n` completions of up to `max_tokens` (None: the
        endpoint's default) before it runs: the max_tokens it may use."""
        limits = self.limits
        if self.turns >= limits.max_turns:
            self._refuse("maxTurns", f"the episode has made its {limits.max_turns} calls "
                         f"(rollout.workflow.maxTurns)")
        if max_tokens is None:
            max_tokens = limits.default_max_tokens
        if limits.max_tokens is not None:
            left = (limits.max_tokens - self.generated_tokens) // n
            if left < 1:
                self._refuse("maxEpisodeTokens", f"the episode has generated "
                             f"{self.generated_tokens} of its {limits.max_tokens} tokens "
                             f"(rollout.workflow.maxEpisodeTokens)")
            max_tokens = left if max_tokens is None else min(max_tokens, left)
        self.turns += 1
        return max_tokens

    def _refuse(self, limit: str, why: str) -> None:
        self.limit_reached = limit
        raise EpisodeLimitReached(f"{why}; end the episode and return its reward")

    def record(self, response_id: str, prompt_ids: list[int],
               results: list[GenerationResult]) -> None:
        for result in results:
            self.completions.append(Completion(response_id, list(prompt_ids), result))
            self.generated_tokens += len(result.output_ids)

    def tokenize(self, text: str, tokenizer: Any, *, special_tokens: bool) -> list[int]:
        """`text`'s token ids, reusing the tokens of the longest recorded completion whose
        text it starts with (see the module's docstring); `special_tokens`: whether `text`
        alone would be encoded with the tokenizer's special tokens (a BOS)."""
        best: Completion | None = None
        for index, completion in enumerate(self.completions):
            known = self._texts.get(index)
            if known is None:
                known = self._texts[index] = tokenizer.decode(
                    completion.ids, skip_special_tokens=False,
                    clean_up_tokenization_spaces=False)
            if known and text.startswith(known) and (
                    best is None or len(completion.ids) > len(best.ids)):
                best, best_text = completion, known
        if best is None:
            return tokenizer.encode(text, add_special_tokens=special_tokens)
        rest = text[len(best_text):]
        return best.ids + (tokenizer.encode(rest, add_special_tokens=False) if rest else [])


class EpisodeBook:
    """The episodes running on this worker, by id: what `/episodes/{id}/v1` calls find."""

    def __init__(self):
        self._running: dict[str, Episode] = {}

    def open(self, limits: EpisodeLimits) -> Episode:
        episode = Episode(uuid.uuid4().hex, limits)
        self._running[episode.episode_id] = episode
        return episode

    def close(self, episode: Episode) -> None:
        """Ends the episode: later calls for it are refused (EpisodeNotRunning)."""
        self._running.pop(episode.episode_id, None)

    def get(self, episode_id: str) -> Episode:
        try:
            return self._running[episode_id]
        except KeyError:
            raise EpisodeNotRunning(
                f"episode {episode_id!r} is not running on this worker (it has ended, or its "
                f"rollout.workflow.timeoutSeconds passed)") from None

    def __len__(self) -> int:
        return len(self._running)
