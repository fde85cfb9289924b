"""Generated arithmetic word problems with integer answers (the `arith` dataset).

Deterministic by seed, so a rerun and every service see the same prompts. Difficulty grows
from one addition (1) to several chained operations on larger numbers (5).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

INSTRUCTION = "Give the final answer as \\boxed{N}."

_NAMES = ("Ada", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo")
_ITEMS = ("apples", "marbles", "stickers", "books", "coins", "pencils", "shells", "cards")


@dataclass(frozen=True)
class Problem:
    prompt_id: str
    question: str
    answer: int

    @property
    def prompt(self) -> str:
        return f"{self.question} {INSTRUCTION}"


def generate(count: int, seed: int = 0, difficulty: int = 2) -> list[Problem]:
    """`count` problems; the same (seed, difficulty) always gives the same list."""
    if not 1 <= difficulty <= 5:
        raise ValueError(f"dataset.difficulty must be between 1 and 5, got {difficulty}")
    rng = random.Random(f"arith-{seed}-{difficulty}")
    return [_problem(rng, difficulty, f"arith-{seed}-{difficulty}-{i}") for i in range(count)]


def split(problems: list, eval_fraction: float) -> tuple[list, list]:
    """(train, eval): the last `eval_fraction` of the list is held out."""
    held_out = int(round(len(problems) * eval_fraction))
    cut = len(problems) - held_out
    return problems[:cut], problems[cut:]


def _problem(rng: random.Random, difficulty: int, prompt_id: str) -> Problem:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    top = (10, 20, 50, 100, 500)[difficulty - 1]
    start = rng.randint(2, top)
    question = f"{name} has {start} {item}."
    total = start
    for _ in range(difficulty if difficulty > 1 else 1):
        kind = rng.choice(("gain", "lose", "times") if difficulty >= 3 else ("gain", "lose"))
        if kind == "gain":
            amount = rng.randint(1, top)
            question += f" {name} gets {amount} more."
            total += amount
        elif kind == "lose" and total > 1:
            amount = rng.randint(1, total - 1)
            question += f" {name} gives away {amount}."
            total -= amount
        else:
            factor = rng.randint(2, 4)
            question += f" Then the number of {item} is multiplied by {factor}."
            total *= factor
    question += f" How many {item} does {name} have now?"
    return Problem(prompt_id, question, total)
