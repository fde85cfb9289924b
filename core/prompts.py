"""Prompts of a job as token ids, with what their responses are checked against.

The rollout workers draw training prompts from here and the trainer its held-out evaluation
prompts; both build the same list from the job spec, so they agree without talking.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncrl import arith, code_tasks


@dataclass(frozen=True)
class PromptItem:
    prompt_id: str
    prompt_ids: list[int]
    # What a scorer checks responses against (an answer, unit tests...).
    reference: Any


def build_prompts(spec, tokenizer) -> tuple[list[PromptItem], list[PromptItem]]:
    """(train, eval) prompt items for the job's dataset, in a fixed order."""
    dataset = spec.dataset
    if dataset.kind == "arith":
        items = [
            (p.prompt_id, p.prompt, p.answer)
            for p in arith.generate(dataset.num_prompts, dataset.seed, dataset.difficulty)
        ]
    elif dataset.kind == "code":
        items = [
            (t.prompt_id, t.prompt, t)
            for t in code_tasks.generate(dataset.num_prompts, dataset.seed, dataset.difficulty)
        ]
    else:
        raise NotImplementedError(
            f"dataset.kind {dataset.kind!r} has no prompt builder yet; use arith or code"
        )
    train, held_out = arith.split(items, dataset.eval_fraction)
    return [_chat_item(i, tokenizer) for i in train], [_chat_item(i, tokenizer) for i in held_out]


def _chat_item(item: tuple[str, str, Any], tokenizer) -> PromptItem:
    prompt_id, prompt, reference = item
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return PromptItem(prompt_id, list(ids), reference)
