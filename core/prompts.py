"""Prompts of a job as token ids, with what their responses are checked against.

The rollout workers draw training prompts from here and the trainer its held-out evaluation
prompts; both build the same list from the job spec, so they agree without talking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncrl import arith


@dataclass(frozen=True)
class PromptItem:
    prompt_id: str
    prompt_ids: list[int]
    # What a scorer checks responses against (an answer, unit tests...).
    reference: Any


def build_prompts(spec, tokenizer) -> tuple[list[PromptItem], list[PromptItem]]:
    """(train, eval) prompt items for the job's dataset, in a fixed order."""
    dataset = spec.dataset
    if dataset.kind != "arith":
        raise NotImplementedError(
            f"dataset.kind {dataset.kind!r} has no prompt builder yet; use kind arith"
        )
    problems = arith.generate(dataset.num_prompts, dataset.seed, dataset.difficulty)
    train, held_out = arith.split(problems, dataset.eval_fraction)
    return [_chat_item(p, tokenizer) for p in train], [_chat_item(p, tokenizer) for p in held_out]


def _chat_item(problem: arith.Problem, tokenizer) -> PromptItem:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": problem.prompt}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return PromptItem(problem.prompt_id, list(ids), problem.answer)


class ArithScorer:
    """Scores arithmetic responses in-process: 1 if the extracted integer is the answer."""

    def __init__(self, tokenizer, rules: list[str]):
        self._tokenizer = tokenizer
        self._rules = rules

    def score_text(self, text: str, answer: int) -> float:
        return 1.0 if arith.extract_integer(text, self._rules) == answer else 0.0

    async def score(self, item: PromptItem, responses: list[list[int]]) -> list[float]:
        return [
            self.score_text(self._tokenizer.decode(r, skip_special_tokens=True), item.reference)
            for r in responses
        ]
