"""An example python reward: 1 for the right final answer, plus a small bonus for stating it
the way the prompt asks (one \\boxed{...}, at the end of the response).

Use it with (see format_bonus.yaml beside this file):

    reward:
      kind: python
      python:
        function: format_bonus:score
        path: examples/rewards

The reward service calls `score(response=..., row=...)` in its worker processes. `row` is the
dataset row: a file's fields (GSM8K: question, answer ending in '#### N'), or for the generated
arith dataset {"prompt_id", "prompt", "answer"}. The returned dict's `score` is the reward; the
other numbers are logged as metrics (asyncrl_reward_extra{field=...}).
"""

import re

BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
BONUS = 0.1


def score(response: str, row: dict) -> dict:
    answers = BOXED.findall(response)
    correct = bool(answers) and same_number(answers[-1], reference_answer(row))
    well_formed = len(answers) == 1 and response.rstrip().endswith("}")
    bonus = BONUS if well_formed else 0.0
    return {"score": float(correct) + bonus, "correct": float(correct), "format_bonus": bonus}


def reference_answer(row: dict) -> str:
    """The row's answer: a number (arith), or the text after '####' (GSM8K)."""
    return str(row["answer"]).split("####")[-1].strip()


def same_number(answer: str, reference: str) -> bool:
    def number(text: str) -> float | None:
        try:
            return float(text.replace(",", "").replace("$", "").strip())
        except ValueError:
            return None

    a, b = number(answer), number(reference)
    return a == b if a is not None and b is not None else answer.strip() == reference.strip()
