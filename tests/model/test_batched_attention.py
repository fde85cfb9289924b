"""Packed attention as a GPU runs it, by variable-length attention
(asyncrl.model.packed_attention.VarlenLayout, here with the reference kernel) or in padded
batches (BatchedLayout), against the loop over sequences (what a CPU runs): the same values
and gradients."""

import pytest
import torch

import asyncrl.model.packed_attention as packed_attention
from asyncrl.algorithms.packing import pack_sharing_prefixes
from asyncrl.model.packed_attention import BatchedLayout, VarlenLayout, packed_sdpa_attention
from asyncrl.model.varlen_attention import varlen_call, varlen_reference
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


def test_varlen_keys_are_the_continued_sequence_then_its_own():
    edges = [0, 6, 9, 16, 17, 26]
    layout = VarlenLayout.build(edges, [-1, 0, 0, 0, -1], "cpu", varlen_reference)
    assert layout.cu_seq_q.tolist() == edges
    assert layout.cu_seq_k.tolist() == [0, 6, 15, 28, 35, 44]  # 6, 6+3, 6+7, 6+1, 9
    assert (layout.max_q, layout.max_k) == (9, 13)
    assert layout.key_positions.tolist() == [
        *range(6), *range(6), *range(6, 9), *range(6), *range(9, 16), *range(6), 16,
        *range(17, 26)]
    alone = VarlenLayout.build(edges, None, "cpu", varlen_reference)
    assert alone.key_positions is None and alone.cu_seq_k.tolist() == edges


def test_the_varlen_reference_is_causal_from_the_last_key():
    torch.manual_seed(0)
    query, key, value = torch.randn(3, 2, 4), torch.randn(5, 2, 4), torch.randn(5, 2, 4)
    bounds_q, bounds_k = torch.tensor([0, 3]), torch.tensor([0, 5])
    got = varlen_reference(query, key, value, bounds_q, bounds_k, 3, 5, window_size=(-1, 0))
    for i in range(3):  # query i sees keys 0 .. i + 2
        weights = torch.softmax((key[: i + 3] * query[i]).sum(-1) / 2, dim=0)  # [keys, heads]
        torch.testing.assert_close(got[i], (weights[..., None] * value[: i + 3]).sum(0))


def test_varlen_call_fits_each_releases_signature():
    """2.9 (is_causal, no scale, no enable_gqa), 2.10/2.11 (window_size, scale) and later
    (enable_gqa): the same attention through each."""
    def release_2_9(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False):
        return varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k,
                                window_size=(-1, 0) if is_causal else (-1, -1))

    def release_2_11(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        assert k.shape[1] == q.shape[1], "no enable_gqa: a head of keys per query head"
        return varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale,
                                window_size=window_size)

    torch.manual_seed(0)
    query, key, value = torch.randn(9, 4, 8), torch.randn(13, 2, 8), torch.randn(13, 2, 8)
    cu_q, cu_k = torch.tensor([0, 4, 9], dtype=torch.int32), torch.tensor([0, 6, 13],
                                                                           dtype=torch.int32)
    expected = varlen_reference(query, key, value, cu_q, cu_k, 5, 7, scale=0.3,
                                window_size=(-1, 0), enable_gqa=True)
    for kernel in (release_2_9, release_2_11, varlen_reference):
        got = varlen_call(kernel, query, key, value, cu_q, cu_k, 5, 7, 0.3)
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


LAYOUTS = {"batched": BatchedLayout.build,
           "varlen": lambda edges, continues, device: VarlenLayout.build(
               edges, continues, device, varlen_reference)}


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("groups", [2, 1], ids=["grouped-query", "one kv head per head"])
def test_a_gpu_layout_gives_the_loops_values_and_gradients(groups, kind):
    torch.manual_seed(0)
    edges = [0, 6, 9, 16, 17, 26, 30]
    continues = [-1, 0, 0, 0, -1, 4]
    heads, dim = 4, 8
    query = torch.randn(1, heads, 30, dim, requires_grad=True)
    key = torch.randn(1, heads // groups, 30, dim, requires_grad=True)
    value = torch.randn(1, heads // groups, 30, dim, requires_grad=True)
    bounds = torch.tensor(edges, dtype=torch.int32)
    results = []
    for layout in (None, LAYOUTS[kind](edges, continues, "cpu")):
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


def gpu_layout(monkeypatch, kind: str | None) -> None:
    """Packed forwards on the CPU take `kind`'s layout (None: the loop)."""
    monkeypatch.setattr(packed_attention, "BATCHED_DEVICES", ("cpu",) if kind else ())
    monkeypatch.setattr(packed_attention, "VARLEN_DEVICES", ("cpu",) if kind == "varlen" else ())
    monkeypatch.setattr(packed_attention, "VARLEN_KERNEL", varlen_reference)
    taken = packed_attention.packed_layout([0, 2], None, torch.device("cpu"))
    assert type(taken).__name__ == {None: "NoneType", "batched": "BatchedLayout",
                                    "varlen": "VarlenLayout"}[kind]


@pytest.mark.parametrize("kind", LAYOUTS)
def test_a_forward_on_a_gpu_layout_gives_the_loops_logprobs(monkeypatch, kind):
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 300, (6,), generator=generator)
    sequences = [torch.cat([prompt, torch.randint(0, 300, (n,), generator=generator)])
                 for n in (3, 7, 1)] + [torch.randint(0, 300, (9,), generator=generator)]
    packed = pack_sharing_prefixes(sequences, [6, 6, 6, 0])
    model = packed_attention.use_packed_attention(tiny_model(vocab_size=300)).eval()
    results = []
    for layout in (None, kind):
        gpu_layout(monkeypatch, layout)
        with torch.no_grad():
            results.append(packed_token_logprobs(model, packed.input_ids, packed.position_ids,
                                                 packed.cu_seqlens, 0.7,
                                                 continues=packed.continues))
    torch.testing.assert_close(results[1], results[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", LAYOUTS)
def test_an_update_on_a_gpu_layout_is_the_loops_update(monkeypatch, kind):
    """Two float32 steps on groups sharing their prompts, several micro-batches: the same
    parameters to 1e-6 and the same stats whether the forward attends by a GPU layout or not."""
    samples = make_groups(3, 4)
    gpu_layout(monkeypatch, None)
    *loop, loop_params, _ = two_sgd_steps(samples, True, micro_batch_max_tokens=40)
    gpu_layout(monkeypatch, kind)
    *batched, params, _ = two_sgd_steps(samples, True, micro_batch_max_tokens=40)
    assert_same_steps(loop, batched, params, loop_params)
