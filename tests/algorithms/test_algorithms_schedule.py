"""The learning-rate schedule and the evaluation's standard error."""

from __future__ import annotations

import math

import pytest

from asyncrl.algorithms.evaluation import accuracy_record, standard_error
from asyncrl.algorithms.schedule import learning_rate_factor


def factors(max_steps=5, **schedule):
    return [learning_rate_factor(step, max_steps, **schedule) for step in range(max_steps)]


def test_constant_is_one_throughout():
    assert factors() == [1.0] * 5


def test_warmup_rises_linearly_then_holds():
    assert factors(warmup_steps=2) == [0.5, 1.0, 1.0, 1.0, 1.0]


def test_linear_and_cosine_reach_the_final_fraction_at_the_last_step():
    assert factors(decay="linear", final_fraction=0.2) == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    cosine = factors(decay="cosine", final_fraction=0.0)
    assert cosine == pytest.approx([1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5,
                                    0.5 * (1 + math.cos(3 * math.pi / 4)), 0.0])


def test_decay_starts_after_warmup():
    values = factors(max_steps=6, warmup_steps=2, decay="linear", final_fraction=0.0)
    assert values == pytest.approx([0.5, 1.0, 1.0, 2 / 3, 1 / 3, 0.0])


def test_steps_past_the_end_keep_the_final_rate():
    assert learning_rate_factor(9, 5, decay="linear", final_fraction=0.3) == pytest.approx(0.3)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="decay"):
        learning_rate_factor(0, 5, decay="step")
    with pytest.raises(ValueError, match="max_steps"):
        learning_rate_factor(0, 0)


def test_standard_error_is_binomial():
    assert standard_error(0.5, 160) == pytest.approx(math.sqrt(0.25 / 160))
    assert standard_error(0.5, 160) <= 0.04
    assert standard_error(1.0, 10) == 0.0
    record = accuracy_record([1, 0, 1, 1])
    assert record == {"eval_accuracy": 0.75, "eval_stderr": pytest.approx(math.sqrt(0.75 * 0.25 / 4)),
                      "eval_problems": 4}
    with pytest.raises(ValueError):
        accuracy_record([])
