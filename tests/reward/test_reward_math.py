"""Math rewards: answer extraction, and verification by math-verify in real worker processes."""

import pytest

from asyncrl.scoring.extract import extract_answer
from asyncrl.scoring.math_reward import MathScorer, MathVerifierPool
from asyncrl.scoring.types import Failure, MathReference


@pytest.mark.parametrize("text, rules, expected", [
    (r"so the answer is \boxed{42}.", ["boxed"], "42"),
    (r"\boxed{1} then \boxed{\frac{1}{2}}", ["boxed"], r"\frac{1}{2}"),
    (r"\boxed{\{1, 2\}}", ["boxed"], r"\{1, 2\}"),
    (r"\boxed {x^{2}}", ["boxed"], "x^{2}"),
    (r"\fbox{7}", ["boxed"], "7"),
    ("The answer is 12.", ["boxed"], None),
    ("The answer is 12.", ["boxed", "answer_is"], "12"),
    ("Final answer: $\\frac{3}{4}$.", ["answer_is"], r"\frac{3}{4}"),
    (r"the answer is \boxed{5} apples", ["answer_is"], "5"),
    ("first the answer is 3\nno wait, the answer is **4**", ["answer_is"], "4"),
    ("I have 3 apples and 1,250 pears, or 2.5 crates", ["last_number"], "2.5"),
    ("ratio 3/4 in the end", ["last_number"], "3/4"),
    ("it is -17", ["last_number"], "-17"),
    ("no digits here", ["boxed", "answer_is", "last_number"], None),
    (r"\boxed{} and \boxed{", ["boxed"], None),
])
def test_extract_answer(text, rules, expected):
    assert extract_answer(text, rules) == expected


def test_an_unknown_rule_is_an_error():
    with pytest.raises(ValueError, match="unknown answer rule"):
        extract_answer("x", ["magic"])


@pytest.fixture(scope="module")
def pool(loop):
    pool = MathVerifierPool(workers=2)
    loop.run(pool.start(), timeout=180)
    yield pool
    loop.run(pool.close())


def score(loop, pool, answer, reference, timeout=5.0, rules=("boxed",)):
    scorer = MathScorer(pool, rules, timeout)
    return loop.run(scorer.score("t", f"... so \\boxed{{{answer}}}", MathReference(reference)))


EQUIVALENT = [
    ("1/2", "0.5"),
    (r"\frac{1}{2}", "0.5"),
    (r"\frac12", r"\dfrac{1}{2}"),
    (r"\dfrac{3}{4}", "0.75"),
    ("0.333333", r"\frac{1}{3}"),
    ("1,000", "1000"),
    ("3.0", "3"),
    (r"10\%", "0.1"),
    ("2^{10}", "1024"),
    (r"\sqrt{2}/2", r"\frac{1}{\sqrt{2}}"),
    (r"\sin(\pi/3)", r"\frac{\sqrt{3}}{2}"),
    ("(x+1)^2", "x^2+2x+1"),
    ("x=5", "5"),
    (r"\{2, 1\}", r"\{1,2\}"),
    ("[1, 2)", "[1,2)"),
    (r"(-\infty, 3)", r"(-\infty,3)"),
    ("2i+3", "3+2i"),
    (r"\text{(A)}", "A"),
]

NOT_EQUIVALENT = [
    ("2", "3"),
    ("0.33", r"\frac{1}{3}"),
    ("3.14159", r"\pi"),
    (r"\{1,3\}", r"\{1,2\}"),
    ("(0,1)", "[0,1]"),
    ("(1,2]", "[1,2)"),
    ("-5", "5"),
    ("x^2", "2x"),
    ("B", "A"),
]


@pytest.mark.parametrize("answer, reference", EQUIVALENT)
def test_equivalent_answers_score_1(loop, pool, answer, reference):
    result = score(loop, pool, answer, reference)
    assert (result.score, result.failure, result.passed, result.total) == (1.0, Failure.NONE, 1, 1)


@pytest.mark.parametrize("answer, reference", NOT_EQUIVALENT)
def test_different_answers_score_0(loop, pool, answer, reference):
    result = score(loop, pool, answer, reference)
    assert (result.score, result.failure) == (0.0, Failure.WRONG_ANSWER), result.detail


def test_a_response_without_an_answer_scores_0(loop, pool):
    scorer = MathScorer(pool, ["boxed"])
    result = loop.run(scorer.score("t", "I think it is 4", MathReference("4")))
    assert (result.score, result.failure) == (0.0, Failure.NO_ANSWER)
    fallback = MathScorer(pool, ["boxed", "answer_is", "last_number"])
    assert loop.run(fallback.score("t", "I think it is 4", MathReference("4"))).score == 1.0


def test_garbage_answer_is_wrong_and_a_bad_reference_is_a_verifier_error(loop, pool):
    for garbage in (")(", r"\sqrt", "+*", "hello world"):
        assert score(loop, pool, garbage, "1").failure is Failure.WRONG_ANSWER
    result = score(loop, pool, "1", " ")
    assert (result.score, result.failure) == (0.0, Failure.VERIFIER_ERROR)


def test_a_slow_verification_times_out_and_every_worker_answers_after(loop, pool):
    result = score(loop, pool, "9^{9^{9^{9}}}", "5", timeout=1.0)
    assert (result.score, result.failure) == (0.0, Failure.TIMEOUT)
    # One request per worker (the pool hands them out in turn), each with a generous limit
    # that only catches a hang: a worker left computing the tower would never answer.
    for _ in range(pool.size):
        assert score(loop, pool, "1/4", "0.25", timeout=30).score == 1.0


def test_a_worker_that_overruns_is_killed_and_replaced(loop):
    # No grace past the limit: the parent kills the worker before its own alarm fires.
    pool = MathVerifierPool(workers=1, kill_grace=0.0)
    try:
        loop.run(pool.start(), timeout=180)
        scorer = MathScorer(pool, ["boxed"], timeout_seconds=0.3)
        result = loop.run(scorer.score("t", r"\boxed{9^{9^{9^{9}}}}", MathReference("5")))
        assert (result.score, result.failure) == (0.0, Failure.TIMEOUT)
        assert "killed" in result.detail and pool.replaced == 1
        # The replacement answers the next request (after loading sympy).
        patient = MathScorer(pool, ["boxed"], timeout_seconds=30)
        ok = loop.run(patient.score("t", r"\boxed{0.5}", MathReference(r"\frac12")), timeout=180)
        assert ok.score == 1.0
    finally:
        loop.run(pool.close())
