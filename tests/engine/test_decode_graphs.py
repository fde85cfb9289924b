"""The bookkeeping of decode steps as CUDA graphs (asyncrl.engine.decode_graphs), checked on
the CPU by running the same padded, bucketed step eagerly: no GPU needed."""

import pytest
import torch

from asyncrl.engine.decode_graphs import (
    MIN_READ_LENGTH,
    DecodeGraphs,
    batch_buckets,
    bucket,
    length_buckets,
)
from asyncrl.engine.fused_decode import FusedDecoder
from asyncrl.engine.kv_cache import SlotKVCache
from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.engine.types import SamplingParams
from support.tiny_model import tiny_model

VOCAB = 256


def test_buckets_cover_every_batch_and_length_with_few_graphs():
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(512) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 96, 128, 160, 192,
                                  224, 256, 320, 384, 448, 512]
    assert batch_buckets(3) == [1, 2, 3]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert length_buckets(1032) == [128, 256, 512, 1024, 1032]
    assert length_buckets(100) == [100]
    for slots in (1, 5, 33, 64):
        buckets = batch_buckets(slots)
        assert [bucket(n, buckets) >= n for n in range(1, slots + 1)] == [True] * slots
        assert buckets[-1] == slots
    assert bucket(9, batch_buckets(64)) == 16 and bucket(129, length_buckets(600)) == 256
    with pytest.raises(ValueError, match="larger than the largest bucket"):
        bucket(65, batch_buckets(64))


def test_capture_needs_a_cuda_device():
    model = tiny_model(1, VOCAB).eval()
    cache = cache_for(model, slots=4, length=160)
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs(FusedDecoder(model).logits, cache, torch.device("cpu"))


def cache_for(model, slots, length):
    config = model.config
    return SlotKVCache(num_layers=config.num_hidden_layers, num_slots=slots,
                       num_kv_heads=config.num_key_value_heads, max_length=length,
                       head_dim=config.hidden_size // config.num_attention_heads,
                       dtype=torch.float32)


def test_a_padded_bucketed_step_computes_the_unpadded_step():
    """Three rows padded to a batch bucket of 4 and attending over a length bucket: the same
    logits and cache writes as the step over exactly those rows and lengths; the padding row
    writes position 0 of the free row 3 only."""
    torch.manual_seed(0)
    model = tiny_model(1, VOCAB).eval()
    decoder = FusedDecoder(model)
    exact, padded = cache_for(model, 6, 160), cache_for(model, 6, 160)
    for layer in range(len(exact.keys)):
        for tensors in (exact.keys, exact.values):
            tensors[layer].normal_()
        padded.keys[layer].copy_(exact.keys[layer])
        padded.values[layer].copy_(exact.values[layer])
    tokens, positions = [7, 200, 31], [5, 9, 2]
    before = [k.clone() for k in padded.keys]

    with torch.no_grad():
        ids = torch.tensor(tokens)[:, None]
        at = torch.tensor(positions)[:, None]
        span = torch.arange(10)[None, :]
        expected = decoder.logits(ids, at, exact, 10, (span <= at)[:, None, None, :])
        graphs = DecodeGraphs(decoder.logits, padded, torch.device("cpu"), capture=False)
        got = graphs.logits(tokens, positions)

    assert got.shape == (3, VOCAB)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    for layer in range(len(exact.keys)):
        torch.testing.assert_close(padded.keys[layer][:3], exact.keys[layer][:3])
        torch.testing.assert_close(padded.values[layer][:3], exact.values[layer][:3])
        changed = (padded.keys[layer] != before[layer]).any(dim=-1).nonzero().tolist()
        # rows 0-2 at their positions (every kv head), the padding row 3 at position 0
        written = {(row, position) for row, _, position in changed}
        assert written == {(0, 5), (1, 9), (2, 2), (3, 0)}


def test_an_engine_decoding_padded_buckets_gives_the_same_tokens_and_logprobs():
    """The engine with its decode steps padded and bucketed as CUDA graphs run them (eagerly
    here) gives the tokens and log-probs of the unpadded engine, requests of different
    lengths joining and leaving, with a row longer than the smallest length bucket."""
    outputs = []
    for padded in (False, True):
        engine = TorchEngine(tiny_model(4, VOCAB).eval(), max_running_requests=5,
                             max_sequence_length=MIN_READ_LENGTH * 2, seed=3)
        if padded:
            engine._graphs = DecodeGraphs(engine._fused.logits, engine._cache,
                                          torch.device("cpu"), capture=False)
        generator = torch.Generator().manual_seed(11)
        batch = [torch.randint(0, VOCAB, (int(n),), generator=generator).tolist()
                 for n in (3, 9, 5, 40, 7, 2, 11)]
        lengths = [4, 30, 9, 150, 12, 5, 20]
        futures = [engine.submit(p, SamplingParams(max_new_tokens=n, temperature=0.8,
                                                   top_k=50, ignore_eos=True))
                   for p, n in zip(batch, lengths)]
        engine.run_until_idle()
        results = [f.result() for f in futures]
        assert [len(r.output_ids) for r in results] == lengths
        outputs.append(results)
    for plain, padded in zip(*outputs):
        assert padded.output_ids == plain.output_ids
        # Padded rows change the matmuls' shapes, so their float32 sums round differently:
        # 1.4e-5 apart in one of 150 log-probs of about -6 on an Ice Lake Xeon.
        torch.testing.assert_close(torch.tensor(padded.output_logprobs),
                                   torch.tensor(plain.output_logprobs), atol=5e-5, rtol=0)


def test_a_step_that_cannot_be_captured_leaves_the_engine_decoding_eagerly(caplog):
    engine = TorchEngine(tiny_model(4, VOCAB).eval(), max_running_requests=2,
                         max_sequence_length=MIN_READ_LENGTH, seed=3)

    def uncapturable(*_):
        raise RuntimeError("operation not permitted when stream is capturing")

    engine._graphs = DecodeGraphs(uncapturable, engine._cache, torch.device("cpu"),
                                  capture=False)
    future = engine.submit([5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True))
    engine.run_until_idle()
    assert len(future.result().output_ids) == 6
    assert engine.cuda_graphs is None
    assert "could not be captured as a CUDA graph" in caplog.text
