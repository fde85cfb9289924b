"""What both example episodes check: the final answer of a response against the row's."""

from asyncrl.scoring.extract import extract_answer


def is_right(response: str, expected) -> bool:
    """Whether the response's final answer (its last \\boxed{...}, or what follows "the
    answer is") is the number `expected`."""
    answer = extract_answer(response, ("boxed", "answer_is"))
    try:
        return answer is not None and float(answer.replace(",", "")) == float(expected)
    except ValueError:
        return False
