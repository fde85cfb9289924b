import pytest

from asyncrl import arith


def test_generation_is_deterministic_and_answers_are_right():
    first = arith.generate(50, seed=3, difficulty=3)
    assert first == arith.generate(50, seed=3, difficulty=3)
    assert first != arith.generate(50, seed=4, difficulty=3)
    assert len({p.prompt_id for p in first}) == 50
    easy = arith.generate(20, seed=0, difficulty=1)
    for problem in easy:
        numbers = [int(w) for w in problem.question.replace(".", " ").split() if w.isdigit()]
        start, change = numbers
        assert problem.answer in (start + change, start - change)
    assert all(p.answer >= 0 for p in first)


def test_split_holds_out_the_tail():
    problems = arith.generate(20)
    train, held_out = arith.split(problems, 0.25)
    assert (len(train), len(held_out)) == (15, 5)
    assert train + held_out == problems


@pytest.mark.parametrize(
    ("text", "rules", "expected"),
    [
        ("so \\boxed{1,234} done", ["boxed"], 1234),
        ("\\boxed{3} then \\boxed{-7}", ["boxed"], -7),
        ("The answer is 42.", ["boxed", "answer_is"], 42),
        ("5 apples and 6 more gives 11", ["boxed", "last_number"], 11),
        ("no number here", ["boxed", "answer_is", "last_number"], None),
        ("\\boxed{x}", ["boxed"], None),
    ],
)
def test_extract_integer_follows_the_rules_in_order(text, rules, expected):
    assert arith.extract_integer(text, rules) == expected


def test_bad_difficulty_names_the_field():
    with pytest.raises(ValueError, match="dataset.difficulty"):
        arith.generate(1, difficulty=9)
