"""pass@k (the unbiased estimator) and maj@k (a majority vote over extracted answers)."""

import math

import pytest

from asyncrl.algorithms.evaluation import majority_score, pass_at_k


def test_pass_at_k_is_the_chance_that_k_of_n_samples_hold_a_solved_one():
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0  # fewer than k unsolved: any k hold a solved one
    # 1 of 4 solved, k = 2: 1 - C(3, 2) / C(4, 2) = 1 - 3/6.
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)  # pass@1 is the solved share
    assert pass_at_k(8, 2, 8) == 1.0
    assert pass_at_k(20, 5, 4) == pytest.approx(1 - math.comb(15, 4) / math.comb(20, 4))
    with pytest.raises(ValueError, match="k must be"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="solved must be"):
        pass_at_k(4, 5, 2)


def test_majority_score_is_the_score_of_the_most_given_answer():
    assert majority_score(["7", "8", "7", None], [1.0, 0.0, 1.0, 0.0]) == 1.0
    assert majority_score(["8", "7", "8"], [0.0, 1.0, 0.0]) == 0.0  # right once, outvoted
    assert majority_score(["8", "7"], [0.0, 1.0]) == 0.0  # a tie: the answer given first
    assert majority_score([None, None], [1.0, 1.0]) == 0.0  # no answer, no vote
    # A cut response (scored by truncatedReward) with the winning answer does not sink it.
    assert majority_score(["7", "7"], [-0.5, 1.0]) == 1.0
    with pytest.raises(ValueError, match="answers for"):
        majority_score(["7"], [1.0, 0.0])
