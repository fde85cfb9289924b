"""Sequence packing and token-balanced micro-batches."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.algorithms.packing import (
    PackedBatch,
    balance_micro_batches,
    balance_shares,
    balance_sharing_prefixes,
    pack_sequences,
    pack_sharing_prefixes,
    unpack,
)


def test_pack_exact_values():
    seqs = [torch.tensor([11, 12, 13]), torch.tensor([21]), torch.tensor([31, 32])]
    packed = pack_sequences(seqs)
    assert isinstance(packed, PackedBatch)
    assert packed.input_ids.tolist() == [11, 12, 13, 21, 31, 32]
    assert packed.position_ids.tolist() == [0, 1, 2, 0, 0, 1]
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 6]
    assert packed.cu_seqlens.dtype == torch.int32
    assert packed.max_seqlen == 3
    assert packed.num_sequences == 3 and packed.num_tokens == 6
    assert packed.fields == {}


def test_pack_extra_fields_and_round_trip():
    seqs = [torch.tensor([1, 2, 3]), torch.tensor([4, 5])]
    logprobs = [torch.tensor([-0.1, -0.2, -0.3]), torch.tensor([-0.4, -0.5])]
    mask = [torch.tensor([False, True, True]), torch.tensor([False, True])]
    hidden = [torch.arange(6.0).reshape(3, 2), torch.arange(4.0).reshape(2, 2)]
    packed = pack_sequences(seqs, {"logprobs": logprobs, "loss_mask": mask, "hidden": hidden})
    assert packed.fields["logprobs"].tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5])
    assert packed.fields["loss_mask"].tolist() == [False, True, True, False, True]
    assert packed.fields["hidden"].shape == (5, 2)

    for original, restored in zip(seqs, unpack(packed.input_ids, packed.cu_seqlens)):
        assert restored.tolist() == original.tolist()
    for original, restored in zip(hidden, unpack(packed.fields["hidden"], packed.cu_seqlens)):
        assert torch.equal(original, restored)


def test_pack_handles_empty_sequences_and_empty_input():
    packed = pack_sequences([torch.tensor([7, 8]), torch.tensor([], dtype=torch.long), torch.tensor([9])])
    assert packed.cu_seqlens.tolist() == [0, 2, 2, 3]
    assert packed.position_ids.tolist() == [0, 1, 0]
    assert [x.tolist() for x in unpack(packed.input_ids, packed.cu_seqlens)] == [[7, 8], [], [9]]

    empty = pack_sequences([])
    assert empty.num_sequences == 0 and empty.num_tokens == 0
    assert empty.cu_seqlens.tolist() == [0]
    assert unpack(empty.input_ids, empty.cu_seqlens) == []


def test_pack_errors():
    with pytest.raises(ValueError, match=r"sequences\[1\]"):
        pack_sequences([torch.tensor([1]), torch.tensor([[1, 2]])])
    with pytest.raises(ValueError, match="logprobs"):
        pack_sequences([torch.tensor([1, 2])], {"logprobs": [torch.tensor([0.0])]})
    with pytest.raises(ValueError, match="logprobs"):
        pack_sequences([torch.tensor([1, 2])], {"logprobs": []})
    with pytest.raises(ValueError, match="cu_seqlens"):
        unpack(torch.zeros(4), torch.tensor([0, 2, 5]))


@given(st.lists(st.integers(0, 6), max_size=6))
@settings(max_examples=40, deadline=None)
def test_pack_round_trip_property(lengths):
    seqs = [torch.randint(0, 100, (n,)) for n in lengths]
    packed = pack_sequences(seqs, {"copy": [s * 2 for s in seqs]})
    assert packed.cu_seqlens.diff().tolist() == lengths
    assert packed.position_ids.tolist() == [p for n in lengths for p in range(n)]
    for seq, a, b in zip(
        seqs, unpack(packed.input_ids, packed.cu_seqlens), unpack(packed.fields["copy"], packed.cu_seqlens)
    ):
        assert torch.equal(seq, a) and torch.equal(seq * 2, b)


def loads(batches, lengths):
    return [sum(lengths[i] for i in batch) for batch in batches]


def test_balance_exact_partitions():
    # Everything fits into one.
    assert balance_micro_batches([1, 2, 3], 100) == [[0, 1, 2]]
    # total 15, budget 8 -> k = 2; largest first into the least-loaded: 7 -> A, 7 -> B, 1 -> A.
    assert balance_micro_batches([7, 7, 1], 8) == [[0, 2], [1]]
    # total 16, budget 8 -> k = 2: 5 -> A, 5 -> B, 3 -> A (8), 3 -> B (8).
    assert balance_micro_batches([3, 5, 3, 5], 8) == [[0, 1], [2, 3]]
    # ceil(21/10) = 3: one sequence each.
    assert balance_micro_batches([7, 7, 7], 10) == [[0], [1], [2]]


def test_balance_falls_back_to_first_fit_before_adding_a_micro_batch():
    # total 20, budget 10 -> k = 2. Least-loaded placement fails: 6 -> A, 5 -> B, 4 -> B (9),
    # 3 -> A (9), 2 fits nowhere. First fit with k = 2 succeeds: A = 6+4, B = 5+3+2.
    assert balance_micro_batches([3, 6, 2, 5, 4], 10) == [[0, 2, 3], [1, 4]]


def test_balance_rebalances_a_first_fit_placement():
    # ceil(106/30) = 4. Least-loaded placement fails with 4; first fit alone would leave loads
    # 30, 27, 30, 19 (a gap of 11, more than the longest sequence); rebalancing evens them out.
    lengths = [9, 10, 10, 10, 9, 7, 7, 0, 9, 6, 8, 6, 8, 7]
    batches = balance_micro_batches(lengths, 30)
    assert len(batches) == 4
    batch_loads = loads(batches, lengths)
    assert sum(batch_loads) == 106 and max(batch_loads) <= 30
    assert max(batch_loads) - min(batch_loads) <= 10


def test_balance_retries_with_more_micro_batches():
    # total 18, budget 10 -> k = 2 is tried first, but no two sequences of 6 share 10 tokens.
    assert balance_micro_batches([6, 6, 6], 10) == [[0], [1], [2]]
    # total 11, budget 4 -> k = 3: the 3s take a micro-batch each and the 2 fits nowhere -> k = 4.
    assert balance_micro_batches([3, 3, 3, 2], 4) == [[0], [1], [2], [3]]
    # total 12, budget 4 -> k = 3 works: each 1 joins a 3 (ties go to the lowest bin first).
    assert balance_micro_batches([3, 3, 3, 1, 1, 1], 4) == [[0, 3], [1, 4], [2, 5]]


def test_balance_zero_length_sequences_do_not_leave_empty_micro_batches():
    batches = balance_micro_batches([0, 0, 0, 4, 4], 4)
    assert sorted(i for b in batches for i in b) == [0, 1, 2, 3, 4]
    assert all(batches) and len(batches) == 2
    assert balance_micro_batches([0, 0], 1) == [[0, 1]]


def test_balance_too_long_sequence_names_it_and_the_spec_field():
    with pytest.raises(ValueError) as info:
        balance_micro_batches([10, 4097, 20], 4096)
    message = str(info.value)
    assert "sequence 1" in message and "4097" in message and "4096" in message
    assert "trainer.microBatchMaxTokens" in message


def test_balance_trivial_and_invalid_inputs():
    assert balance_micro_batches([], 10) == []
    with pytest.raises(ValueError, match="max_tokens"):
        balance_micro_batches([1], 0)
    with pytest.raises(ValueError, match="sequence 0"):
        balance_micro_batches([-1], 5)


@given(
    lengths=st.lists(st.integers(0, 64), max_size=40),
    max_tokens=st.integers(64, 200),
)
@settings(max_examples=150, deadline=None)
def test_balance_properties(lengths, max_tokens):
    batches = balance_micro_batches(lengths, max_tokens)
    if not lengths:
        assert batches == []
        return
    # Every index exactly once, ascending inside each micro-batch, batches ordered by first index.
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(b == sorted(b) and b for b in batches)
    assert [b[0] for b in batches] == sorted(b[0] for b in batches)
    # Budget respected and loads balanced within one sequence length (least-loaded placement).
    batch_loads = loads(batches, lengths)
    assert max(batch_loads) <= max_tokens
    assert max(batch_loads) - min(batch_loads) <= max(lengths)
    # k is at least the lower bounds any partition must meet: total tokens / budget, and one
    # micro-batch per sequence longer than half the budget.
    total = sum(lengths)
    k = len(batches)
    big = sum(1 for n in lengths if 2 * n > max_tokens)
    lower = max(1, math.ceil(total / max_tokens), big)
    assert k >= lower
    # Upper bound: if k bins failed, either every bin was over half full (k < 2 * total / budget)
    # or more than k sequences were over half the budget.
    assert k <= max(lower, math.ceil(2 * total / max_tokens), big)


@given(lengths=st.lists(st.integers(1, 10), min_size=1, max_size=8), max_tokens=st.integers(10, 20))
@settings(max_examples=60, deadline=None)
def test_balance_is_near_optimal_on_small_inputs(lengths, max_tokens):
    """Brute force the optimal number of micro-batches for small inputs; allow one more."""
    k = len(balance_micro_batches(lengths, max_tokens))
    assert k <= optimal_bins(lengths, max_tokens) + 1


@given(lengths=st.lists(st.integers(0, 64), max_size=40), shares=st.integers(1, 8))
@settings(max_examples=150, deadline=None)
def test_balance_shares_places_every_sequence_in_exactly_the_shares_asked(lengths, shares):
    split = balance_shares(lengths, shares)
    assert len(split) == shares
    assert sorted(i for share in split for i in share) == list(range(len(lengths)))
    assert all(share == sorted(share) for share in split)
    # Least-loaded placement, longest first: loads within one sequence length of each other.
    share_loads = loads(split, lengths)
    assert max(share_loads) - min(share_loads) <= max(lengths, default=0)


def test_balance_shares_exact_and_invalid():
    assert balance_shares([5, 1, 4, 2], 2) == [[0, 1], [2, 3]]  # 5 + 1 and 4 + 2
    assert balance_shares([3], 3) == [[0], [], []]
    with pytest.raises(ValueError, match="shares"):
        balance_shares([1], 0)


def optimal_bins(lengths, capacity):
    order = sorted(lengths, reverse=True)
    best = len(order)

    def place(i, bins):
        nonlocal best
        if len(bins) >= best:
            return
        if i == len(order):
            best = len(bins)
            return
        for j in range(len(bins)):
            if bins[j] + order[i] <= capacity:
                bins[j] += order[i]
                place(i + 1, bins)
                bins[j] -= order[i]
        bins.append(order[i])
        place(i + 1, bins)
        bins.pop()

    place(0, [])
    return best


def test_pack_sharing_prefixes_holds_each_shared_prefix_once():
    prompt, other = [1, 2, 3], [7, 8]
    seqs = [torch.tensor(prompt + [4, 5]), torch.tensor(other + [9]),
            torch.tensor(prompt + [6]), torch.tensor([5, 5, 5, 5])]
    tags = [torch.arange(len(s)) + 10 * i for i, s in enumerate(seqs)]
    packed = pack_sharing_prefixes(seqs, [3, 2, 3, 2], {"tag": tags})
    # Sequence 1's and 3's prefixes are their own: they stay whole.
    assert packed.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 5, 5, 5, 5]
    assert packed.cu_seqlens.tolist() == [0, 3, 5, 6, 9, 13]
    assert packed.continues.tolist() == [-1, 0, 0, -1, -1]
    assert packed.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 2, 0, 1, 2, 3]
    # A shared prefix takes the first sequence's field values; each rest its own.
    assert packed.fields["tag"].tolist() == [0, 1, 2, 3, 4, 23, 10, 11, 12, 30, 31, 32, 33]
    assert packed.max_seqlen == 5


def test_pack_sharing_nothing_is_pack_sequences():
    seqs = [torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4]), torch.tensor([1])]
    for prefixes in ([0, 0, 0], [3, 3, 1], [1, 2, 0]):  # none, whole sequences, not equal
        packed = pack_sharing_prefixes(seqs, prefixes)
        plain = pack_sequences(seqs)
        assert packed.continues is None
        assert torch.equal(packed.input_ids, plain.input_ids)
        assert torch.equal(packed.cu_seqlens, plain.cu_seqlens)
    with pytest.raises(ValueError, match=r"prefix_lengths\[2\] is 2; sequences\[2\] has 1"):
        pack_sharing_prefixes(seqs, [0, 0, 2])
    with pytest.raises(ValueError, match="2 prefix lengths for 3 sequences"):
        pack_sharing_prefixes(seqs, [0, 0])
    with pytest.raises(ValueError, match=r"fields\['f'\]\[1\] has 2 tokens"):
        pack_sharing_prefixes(seqs, [2, 2, 0], {"f": [torch.zeros(3), torch.zeros(2),
                                                      torch.zeros(1)]})


def _shared_size(batch, seqs, prefixes):
    packed = pack_sharing_prefixes([seqs[i] for i in batch], [prefixes[i] for i in batch])
    return packed.num_tokens


def test_balance_sharing_prefixes_keeps_a_prompts_responses_together():
    prompt = list(range(10))
    seqs = [torch.tensor(prompt + [50] * n) for n in (4, 6, 3, 5)] + [torch.ones(12)]
    prefixes = [10, 10, 10, 10, 0]
    # Unshared, 70 tokens need three micro-batches of 30; shared, the group is 28 tokens.
    assert len(balance_micro_batches([len(s) for s in seqs], 30)) == 3
    batches = balance_sharing_prefixes(seqs, prefixes, 30)
    assert batches == [[0, 1, 2, 3], [4]]
    # A group over the budget is split, the prompt counted in each part.
    batches = balance_sharing_prefixes(seqs, prefixes, 20)
    assert sorted(i for b in batches for i in b) == list(range(5))
    assert all(_shared_size(b, seqs, prefixes) <= 20 for b in batches)
    assert len(batches) == 3
    # Two 9-token responses to one 8-token prompt and two sequences of 12, budget 21: kept
    # together the group takes a micro-batch of its own (3 in all); whole sequences two (2).
    seqs2 = [torch.tensor([1] * 8 + [2]), torch.tensor([1] * 8 + [3]), torch.ones(12),
             torch.zeros(12)]
    assert balance_sharing_prefixes(seqs2, [8, 8, 0, 0], 21) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="sequence 1 has 16 tokens"):  # a sequence is whole
        balance_sharing_prefixes(seqs, prefixes, 15)


@given(groups=st.lists(st.tuples(st.integers(1, 8), st.lists(st.integers(1, 12), min_size=1,
                                                            max_size=6)), max_size=6),
       max_tokens=st.integers(21, 60))
@settings(max_examples=80, deadline=None)
def test_balance_sharing_prefixes_properties(groups, max_tokens):
    seqs, prefixes = [], []
    for g, (prompt, rests) in enumerate(groups):
        for rest in rests:
            seqs.append(torch.cat([torch.full((prompt,), g), torch.full((rest,), 99)]))
            prefixes.append(prompt)
    batches = balance_sharing_prefixes(seqs, prefixes, max_tokens)
    assert sorted(i for b in batches for i in b) == list(range(len(seqs)))
    assert all(b == sorted(b) and b for b in batches)
    assert all(_shared_size(b, seqs, prefixes) <= max_tokens for b in batches)
    # Never more micro-batches than without sharing.
    assert len(batches) <= len(balance_micro_batches([len(s) for s in seqs], max_tokens))
