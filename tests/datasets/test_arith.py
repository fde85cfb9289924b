from asyncrl.data import arith


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
