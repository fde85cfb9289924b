"""DAPO's soft overlong punishment (asyncrl.algorithms.shaping) against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from asyncrl.algorithms.shaping import overlong_penalties


def test_the_penalty_rises_linearly_over_the_buffer_to_the_factor_at_the_cut():
    # maxNewTokens 64, buffer 16: free up to 48 tokens, then 1/16 a token, 0.5 x 1 at 64.
    lengths = torch.tensor([1, 48, 49, 56, 63, 64])
    got = overlong_penalties(lengths, 64, 16, 0.5)
    assert got.tolist() == pytest.approx([0, 0, 0.5 / 16, 0.25, 0.5 * 15 / 16, 0.5])


def test_a_buffer_of_zero_turns_it_off_and_one_longer_than_the_room_is_refused():
    assert overlong_penalties(torch.tensor([64, 10]), 64, 0, 1.0).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="buffer_tokens 65 exceeds max_new_tokens 64"):
        overlong_penalties(torch.tensor([1]), 64, 65, 1.0)


def test_a_buffer_as_long_as_the_room_penalises_every_token():
    assert overlong_penalties(torch.tensor([0, 2, 4]), 4, 4, 1.0).tolist() == [0, 0.5, 1.0]
