"""Generated Python function tasks with unit tests (the `code` dataset).

Each task asks for one small function and is checked by assert-style tests that the reward
service runs in its sandbox. Deterministic by seed; difficulty widens the set of templates.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

INSTRUCTION = "Reply with the complete function in a ```python code block."


@dataclass(frozen=True)
class CodeTask:
    prompt_id: str
    question: str
    test_code: str

    @property
    def prompt(self) -> str:
        return f"{self.question} {INSTRUCTION}"


def _affine(rng):
    a, b = rng.randint(2, 9), rng.randint(1, 20)
    cases = [(x, a * x + b) for x in (0, 1, 5, -3)]
    return (f"Write a Python function `f(x)` that returns {a} times x plus {b}.",
            "\n".join(f"assert f({x}) == {y}" for x, y in cases))


def _count_char(rng):
    char = rng.choice("aeiost")
    words = ["banana", "testing", "", "aaa", "mississippi"]
    return (f"Write a Python function `count(s)` that returns how many times the letter "
            f"'{char}' appears in the string s.",
            "\n".join(f"assert count({w!r}) == {w.count(char)}" for w in words))


def _sum_multiples(rng):
    k = rng.randint(2, 7)
    cases = [(n, sum(i for i in range(n + 1) if i % k == 0)) for n in (0, 10, 25)]
    return (f"Write a Python function `total(n)` that returns the sum of all multiples of {k} "
            f"from 0 to n inclusive.",
            "\n".join(f"assert total({n}) == {t}" for n, t in cases))


def _reverse_words(rng):
    cases = ["hello world", "a b c", "single"]
    return ("Write a Python function `flip(s)` that returns the words of s in reverse order, "
            "joined by single spaces.",
            "\n".join(f"assert flip({c!r}) == {' '.join(reversed(c.split()))!r}" for c in cases))


def _max_gap(rng):
    lists = [[rng.randint(0, 50) for _ in range(rng.randint(2, 6))] for _ in range(3)]
    return ("Write a Python function `gap(xs)` that returns the largest value in the list xs "
            "minus the smallest.",
            "\n".join(f"assert gap({xs}) == {max(xs) - min(xs)}" for xs in lists))


_TEMPLATES = [_affine, _count_char, _sum_multiples, _reverse_words, _max_gap]


def generate(count: int, seed: int = 0, difficulty: int = 2) -> list[CodeTask]:
    if not 1 <= difficulty <= 5:
        raise ValueError(f"dataset.difficulty must be between 1 and 5, got {difficulty}")
    rng = random.Random(f"code-{seed}-{difficulty}")
    templates = _TEMPLATES[: 1 + difficulty]
    tasks = []
    for index in range(count):
        question, tests = rng.choice(templates)(rng)
        tasks.append(CodeTask(f"code-{seed}-{difficulty}-{index}", question, tests))
    return tasks
