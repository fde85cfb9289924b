"""Prompts of a job as token ids, with what their responses are checked against.

The rollout workers draw training prompts from here and the trainer its held-out evaluation
prompts; both build the same sets from the job spec, so they agree without talking. A set is
indexed, not listed: the buffer hands out prompt positions (see `asyncrl.data.prompt_order`), and a
file-based set reads, formats and tokenizes a row only when it is asked for, so a million-row
file is neither tokenized up front nor held in each worker's memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from asyncrl.data import arith, code_tasks


@dataclass(frozen=True)
class PromptItem:
    prompt_id: str
    prompt_ids: list[int]
    # What a math or code scorer checks responses against (an answer, unit tests...); None
    # where the dataset carries neither (a python or http reward reads the row instead).
    reference: Any
    # The dataset row with all its fields (file datasets), for python and http rewards.
    row: dict[str, Any] = field(default_factory=dict, compare=False)
    # The prompt's text before the chat template (what an http reward is sent as `prompt`).
    text: str = field(default="", compare=False)


class PromptSet:
    """Prompts by index (0 .. len-1), each built when it is asked for.

    `build(index)` makes the item at `index`; `max_prompt_tokens` (None: no limit) is the
    longest prompt the job runs, and `fits` says whether an item is within it. Items are not
    kept: a worker asks for each about once an epoch, and keeping a million rows' token ids
    would undo the memory mapping of a large file.
    """

    def __init__(self, size: int, build, max_prompt_tokens: int | None = None):
        self._size = size
        self._build = build
        self.max_prompt_tokens = max_prompt_tokens

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index: int) -> PromptItem:
        if not 0 <= index < self._size:
            raise IndexError(f"prompt {index} of a set of {self._size}")
        return self._build(index)

    def __iter__(self):
        return (self[i] for i in range(self._size))

    def fits(self, item: PromptItem) -> bool:
        return self.max_prompt_tokens is None or len(item.prompt_ids) <= self.max_prompt_tokens

    def head(self, count: int) -> list[PromptItem]:
        """The first `count` items that fit (the trainer's evaluation prompts)."""
        found = []
        for item in self:
            if len(found) == count:
                break
            if self.fits(item):
                found.append(item)
        return found

    @classmethod
    def of(cls, items: Sequence[PromptItem], max_prompt_tokens: int | None = None) -> PromptSet:
        items = list(items)
        return cls(len(items), items.__getitem__, max_prompt_tokens)


def build_prompts(spec, tokenizer) -> tuple[PromptSet, PromptSet]:
    """(train, eval) prompt sets for the job's dataset, in a fixed order."""
    dataset = spec.dataset
    if dataset.kind == "file":
        from asyncrl.data.mapping import file_prompts

        return file_prompts(spec, tokenizer)
    if dataset.kind == "arith":
        items = [
            (p.prompt_id, p.prompt, p.answer)
            for p in arith.generate(dataset.num_prompts, dataset.seed, dataset.difficulty)
        ]
    else:
        items = [
            (t.prompt_id, t.prompt, t)
            for t in code_tasks.generate(dataset.num_prompts, dataset.seed, dataset.difficulty)
        ]
    train, held_out = arith.split(items, dataset.eval_fraction)
    return (PromptSet.of([_chat_item(i, tokenizer, dataset.system_prompt) for i in train]),
            PromptSet.of([_chat_item(i, tokenizer, dataset.system_prompt) for i in held_out]))


def max_sequence_length(spec, prompts: PromptSet) -> int:
    """Longest prompt plus response an engine must hold for the job: the one owner of the
    rule for the rollout engines and the trainer's evaluator. Generated sets are measured;
    a file set's prompts are held to dataset.maxPromptTokens."""
    longest = prompts.max_prompt_tokens
    if longest is None:
        longest = max((len(item.prompt_ids) for item in prompts), default=1)
    return longest + spec.rollout.max_new_tokens


def rollout_sequence_length(spec, prompts: PromptSet) -> int:
    """Longest sequence a rollout engine must hold: a prompt and its response, or for an
    episode job a whole conversation (rollout.workflow.maxContextTokens), whichever is more."""
    single_turn = max_sequence_length(spec, prompts)
    workflow = spec.rollout.workflow
    return max(single_turn, workflow.max_context_tokens) if workflow.kind == "episode" \
        else single_turn


def chat_prompt_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of `messages` in the model's chat template, ready for the assistant's turn."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def chat_messages(prompt: str, system_prompt: str | None = None) -> list[dict[str, str]]:
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*system, {"role": "user", "content": prompt}]


def _chat_item(item: tuple[str, str, Any], tokenizer, system_prompt: str | None) -> PromptItem:
    prompt_id, prompt, reference = item
    ids = chat_prompt_ids(tokenizer, chat_messages(prompt, system_prompt))
    return PromptItem(prompt_id, ids, reference, text=prompt)
