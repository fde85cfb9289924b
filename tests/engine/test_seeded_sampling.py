"""Requests with a seed of their own (SamplingParams.seed): their tokens depend on the weights,
the prompt and the seed alone, not on what else the engine batches, on its own generator's
seed, on overlapped decode steps or on an interruption by a weight update."""

import pytest
import torch

from asyncrl.engine.sampling import sample_tokens, seeded_uniforms
from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.engine.types import RequestError, SamplingParams
from support.tiny_model import tiny_model

VOCAB = 256
MASK = (1 << 64) - 1


def splitmix64(seed: int, position: int) -> float:
    """The reference: splitmix64's output for step `position` of the stream at `seed`, in
    Python's unbounded integers, its top 24 bits as a fraction."""
    z = (seed + (position + 1) * 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    z ^= z >> 31
    return (z >> 40) / (1 << 24)


def test_seeded_uniforms_are_splitmix64_of_seed_and_position():
    seeds = [0, 1, 7, -1, -(1 << 63), (1 << 63) - 1, 123456789012345]
    positions = [0, 1, 2, 63, 1000, 1 << 20]
    pairs = [(s, p) for s in seeds for p in positions]
    got = seeded_uniforms(torch.tensor([s for s, _ in pairs]), torch.tensor([p for _, p in pairs]))
    assert got.dtype == torch.float32
    assert got.tolist() == [splitmix64(s % (1 << 64), p) for s, p in pairs]


def test_seeded_uniforms_spread_evenly_over_the_unit_interval():
    positions = torch.arange(100_000)
    draws = seeded_uniforms(torch.full_like(positions, 42), positions)
    assert 0 <= draws.min() and draws.max() < 1
    counts = torch.histc(draws, bins=10, min=0, max=1)
    # 10,000 expected a bin; a chi-square of 9 degrees of freedom is below 30 but for 1 in 2,500.
    assert float(((counts - 10_000) ** 2 / 10_000).sum()) < 30
    # Neighbouring seeds give unrelated streams.
    other = seeded_uniforms(torch.full_like(positions, 43), positions)
    assert abs(float(torch.corrcoef(torch.stack([draws, other]))[0, 1])) < 0.02


def test_the_least_and_the_greatest_draw_pick_tokens_with_mass():
    """A draw of 0 (1 in 2**24 seeded pairs) and the largest below 1 land on the first and the
    last token left by top-k, never on one it masked or whose mass underflowed."""
    logits = torch.tensor([[-200.0, 3.0, 2.0, -1.0, -300.0]] * 4)
    top_k = torch.tensor([-1, -1, 2, 2])
    draws = torch.tensor([0.0, 1 - 2**-24, 0.0, 1 - 2**-24])
    tokens, logprobs = sample_tokens(logits, torch.ones(4), torch.ones(4), top_k,
                                     uniforms=draws)
    assert tokens.tolist() == [1, 3, 1, 2]
    assert torch.isfinite(logprobs).all()


def sampled(seed, max_new_tokens=24):
    return SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0, ignore_eos=True,
                          seed=seed)


PROMPT = [5, 17, 99, 3, 42]


def serve(engine, requests):
    futures = [engine.submit(prompt, params) for prompt, params in requests]
    engine.run_until_idle()
    return [future.result() for future in futures]


def engine_for(seed=0, *, overlap=False, slots=6):
    return TorchEngine(tiny_model(4, VOCAB).eval(), max_running_requests=slots,
                       max_sequence_length=128, seed=seed, overlap=overlap)


def test_a_seeded_request_draws_the_same_tokens_whatever_else_runs():
    alone = serve(engine_for(seed=0), [(PROMPT, sampled(11))])[0]
    # Batched with unseeded requests, responses to the same prompt and other seeds, on an
    # engine whose own generator starts elsewhere, with steps overlapped or not.
    crowd = [([1, 2, 3], sampled(None)), (PROMPT, sampled(12)), (PROMPT, sampled(11)),
             ([9] * 20, sampled(None, 7)), (PROMPT, sampled(None))]
    for overlap in (False, True):
        results = serve(engine_for(seed=99, overlap=overlap), crowd)
        assert results[2].output_ids == alone.output_ids
        torch.testing.assert_close(torch.tensor(results[2].output_logprobs),
                                   torch.tensor(alone.output_logprobs), atol=5e-5, rtol=0)
        # Another seed is another stream.
        assert results[1].output_ids != alone.output_ids
    # Without a seed, the engine's generator decides: two engines seeded apart differ.
    unseeded = [serve(engine_for(seed=s), [(PROMPT, sampled(None))])[0].output_ids
                for s in (1, 2)]
    assert unseeded[0] != unseeded[1]


def test_a_seeded_request_interrupted_by_a_weight_update_resumes_its_stream():
    """The same weights installed as a new version part way: the request is prefilled again
    and continues drawing where it was, so its tokens are those of a run without the update."""
    uninterrupted = serve(engine_for(), [(PROMPT, sampled(11, 40))])[0]
    engine = engine_for()
    future = engine.submit(PROMPT, sampled(11, 40))
    with torch.no_grad():
        for _ in range(10):  # the prefill and nine decode steps
            engine._step()
    update = engine.update_weights_from_state_dict(
        {name: tensor.clone() for name, tensor in engine._model.state_dict().items()}, 1)
    assert update.interrupted_requests == 1
    engine.run_until_idle()
    result = future.result()
    assert result.interruptions == 1 and result.output_versions[-1] == 1
    assert result.output_ids == uninterrupted.output_ids


def test_a_seed_outside_64_signed_bits_is_refused():
    engine = engine_for()
    with pytest.raises(RequestError, match="sampling_seed must fit in 64 signed bits"):
        engine.submit(PROMPT, sampled(1 << 63))
