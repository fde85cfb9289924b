"""Finding the part of a response that is scored: the final answer of a math response, the
program of a code response. Pure functions over text."""

from __future__ import annotations

import re
from typing import Iterable

MATH_RULES = ("boxed", "answer_is", "last_number")
CODE_RULES = ("last_block", "first_block", "longest_block")

_BOXED = re.compile(r"\\(?:boxed|fbox)\b")
_ANSWER_IS = re.compile(
    r"(?:final answer|the answer|answer)\s*(?:is|:|=)\s*:?\s*(?P<rest>[^\n]*)", re.IGNORECASE
)
_NUMBER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
_FENCE = re.compile(r"^[ \t]*(`{3,}|~{3,})[ \t]*([\w+#.-]*)[^\n]*\n(.*?)^[ \t]*\1[ \t]*$",
                    re.DOTALL | re.MULTILINE)
_MATH_DELIMITERS = (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]"), ("**", "**"))


def extract_answer(text: str, rules: Iterable[str] = ("boxed",)) -> str | None:
    """The final answer in a response: the last match of the first rule (in `rules` order)
    that matches, as text for the verifier, or None.

    boxed: the content of the last \\boxed{...} (nested braces allowed); answer_is: what
    follows the last "the answer is" / "final answer:" on its line; last_number: the last
    number (integer, decimal, a/b, with thousands commas).
    """
    for rule in rules:
        if rule == "boxed":
            found = _last_boxed(text)
        elif rule == "answer_is":
            found = _last_answer_is(text)
        elif rule == "last_number":
            numbers = _NUMBER.findall(text)
            found = numbers[-1] if numbers else None
        else:
            raise ValueError(f"unknown answer rule {rule!r}; use one of {', '.join(MATH_RULES)}")
        if found:
            return found
    return None


def _last_boxed(text: str) -> str | None:
    for match in reversed(list(_BOXED.finditer(text))):
        content = _braced(text, match.end())
        if content:
            return content
    return None


def _braced(text: str, start: int) -> str | None:
    """`{...}` (balanced) or a single token after `\\boxed` at `start`, or None."""
    i = start
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":
        token = re.match(r"[^\s$]+", text[i:]) if i > start else None
        return token.group(0) if token else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{" and text[j - 1] != "\\":
            depth += 1
        elif text[j] == "}" and text[j - 1] != "\\":
            depth -= 1
            if depth == 0:
                return text[i + 1:j].strip() or None
    return None


def _last_answer_is(text: str) -> str | None:
    matches = list(_ANSWER_IS.finditer(text))
    for match in reversed(matches):
        rest = match.group("rest").strip()
        boxed = _last_boxed(rest)
        if boxed:
            return boxed
        answer = _strip_delimiters(rest.rstrip(" ."))
        if answer:
            return answer
    return None


def _strip_delimiters(answer: str) -> str:
    changed = True
    while changed:
        changed = False
        for left, right in _MATH_DELIMITERS:
            wrapped = answer.startswith(left) and answer.endswith(right)
            if wrapped and len(answer) > len(left) + len(right):
                answer = answer[len(left):-len(right)].strip()
                changed = True
        if answer.endswith(".") or answer.endswith(","):
            answer = answer[:-1].rstrip()
            changed = True
    return answer


def extract_program(text: str, rule: str = "last_block", language: str = "python") -> str | None:
    """The program in a response's fenced code blocks (``` or ~~~), or None if it has none.

    Blocks tagged with `language` (or one of its aliases) win over untagged blocks, which win
    over blocks tagged with another language; among those, `rule` picks the last, the first or
    the longest block.
    """
    if rule not in CODE_RULES:
        raise ValueError(f"unknown code rule {rule!r}; use one of {', '.join(CODE_RULES)}")
    aliases = _LANGUAGE_TAGS.get(language, {language})
    blocks = [(tag.lower(), body) for _, tag, body in _FENCE.findall(text)]
    for wanted in (lambda t: t in aliases, lambda t: t == "", lambda t: True):
        chosen = [body for tag, body in blocks if wanted(tag)]
        if chosen:
            if rule == "first_block":
                return chosen[0]
            if rule == "longest_block":
                return max(chosen, key=len)
            return chosen[-1]
    return None


_LANGUAGE_TAGS = {"python": {"python", "python3", "py", "py3"}}
