"""Packed attention in padded batches (asyncrl.model.packed_attention.BatchedLayout, what a
GPU runs) against the loop over sequences (what a CPU runs): the same values and gradients."""

import pytest
import torch

import asyncrl.model.packed_attention as packed_attention
from asyncrl.algorithms.packing import pack_sharing_prefixes
from asyncrl.model.packed_attention import BatchedLayout, packed_sdpa_attention
from asyncrl.model.policy import packed_token_logprobs

from support.tiny_model import tiny_model
from support.trainer import assert_same_steps, make_groups, two_sgd_steps


def test_batches_group_sequences_of_about_one_length_and_place_every_position_once():
    # sequences of 6, 3, 7, 1 and 9 tokens; the 2nd to 4th continue the 1st
    edges = [0, 6, 9, 16, 17, 26]
    layout = BatchedLayout.build(edges, [-1, 0, 0, 0, -1], "cpu")
    # longest first (9, 7, 6 | 3 | 1): a batch ends under half its first's length
    assert [b.queries.shape for b in layout.batches] == [(3, 9), (1, 3), (1, 1)]
    assert [b.keys.shape[1] for b in layout.batches] == [13, 9, 7]  # 6 + 7; 6 + 3; 6 + 1
    assert len(set(layout.placed.tolist())) == 26
    # the 7-token continuation sees the whole prompt, then itself causally
    continuation = layout.batches[0]
    row = continuation.queries[:, 0].tolist().index(9)
    assert continuation.keys[row].tolist() == list(range(6)) + list(range(9, 16))
    mask = continuation.mask[row, 0]
    assert mask[0].tolist() == [True] * 7 + [False] * 6
    assert mask[6].tolist() == [True] * 13
    assert mask[7:].sum(dim=1).tolist() == [1, 1]  # padding queries see one key


@pytest.mark.parametrize("groups", [2, 1], ids=["grouped-query", "one kv head per head"])
def test_batched_attention_gives_the_loops_values_and_gradients(groups):
    torch.manual_seed(0)
    edges = [0, 6, 9, 16, 17, 26, 30]
    continues = [-1, 0, 0, 0, -1, 4]
    heads, dim = 4, 8
    query = torch.randn(1, heads, 30, dim, requires_grad=True)
    key = torch.randn(1, heads // groups, 30, dim, requires_grad=True)
    value = torch.randn(1, heads // groups, 30, dim, requires_grad=True)
    bounds = torch.tensor(edges, dtype=torch.int32)
    results = []
    for layout in (None, BatchedLayout.build(edges, continues, "cpu")):
        extra = {"packed_layout": layout} if layout else {}
        out, _ = packed_sdpa_attention(None, query, key, value, None, scaling=0.3,
                                       cu_seq_lens_q=bounds, continues=continues, **extra)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        grads = torch.autograd.grad((out * weights).sum(), (query, key, value))
        results.append((out, grads))
    (expected, expected_grads), (got, grads) = results
    assert got.shape == (1, 30, heads, dim)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=1e-5)


def test_a_forward_on_a_batched_device_gives_the_loops_logprobs(monkeypatch):
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 300, (6,), generator=generator)
    sequences = [torch.cat([prompt, torch.randint(0, 300, (n,), generator=generator)])
                 for n in (3, 7, 1)] + [torch.randint(0, 300, (9,), generator=generator)]
    packed = pack_sharing_prefixes(sequences, [6, 6, 6, 0])
    model = packed_attention.use_packed_attention(tiny_model(vocab_size=300)).eval()
    results = []
    for devices in ((), ("cpu",)):
        monkeypatch.setattr(packed_attention, "BATCHED_DEVICES", devices)
        with torch.no_grad():
            results.append(packed_token_logprobs(model, packed.input_ids, packed.position_ids,
                                                 packed.cu_seqlens, 0.7,
                                                 continues=packed.continues))
    torch.testing.assert_close(results[1], results[0], atol=1e-6, rtol=1e-5)


def test_an_update_attending_in_batches_is_the_loops_update(monkeypatch):
    """Two float32 steps on groups sharing their prompts, several micro-batches: the same
    parameters to 1e-6 and the same stats whether the forward attends in batches or not."""
    samples = make_groups(3, 4)
    monkeypatch.setattr(packed_attention, "BATCHED_DEVICES", ())
    *loop, loop_params, _ = two_sgd_steps(samples, True, micro_batch_max_tokens=40)
    monkeypatch.setattr(packed_attention, "BATCHED_DEVICES", ("cpu",))
    *batched, params, _ = two_sgd_steps(samples, True, micro_batch_max_tokens=40)
    assert_same_steps(loop, batched, params, loop_params)
