"""Overlapped decode steps (TorchEngine(overlap=True), a GPU's default): each step launched
before the previous one's tokens are read back gives the tokens and log-probs of steps run one
after the other, whatever joins, stops or moves rows meanwhile."""

import pytest
import torch

from asyncrl.engine.decode_graphs import MIN_READ_LENGTH, DecodeGraphs
from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.engine.types import SamplingParams
from support.tiny_model import tiny_model
from support.waiting import wait_for

VOCAB = 256


def engine_for(overlap: bool, padded: bool = False, slots: int = 5) -> TorchEngine:
    engine = TorchEngine(tiny_model(4, VOCAB).eval(), max_running_requests=slots,
                         max_sequence_length=MIN_READ_LENGTH, seed=3, overlap=overlap)
    if padded:  # the steps CUDA graphs replay, run eagerly
        engine._graphs = DecodeGraphs(engine._fused.logits, engine._cache,
                                      torch.device("cpu"), capture=False)
    return engine


def counting_launches(engine: TorchEngine) -> list[bool]:
    """Records, for every decode step launched, whether its input tokens came from the
    device (a step launched before the previous one was read back)."""
    launches = []
    launch = engine._launch_decode

    def counted(from_device):
        launches.append(from_device)
        return launch(from_device)

    engine._launch_decode = counted
    return launches


def serve(engine: TorchEngine, requests) -> list:
    futures = [engine.submit(prompt, params) for prompt, params in requests]
    engine.run_until_idle()
    return [future.result() for future in futures]


def workload(stops: dict[int, int] | None = None) -> list[tuple[list[int], SamplingParams]]:
    """Greedy requests of mixed lengths, more than the slots: three responses to one prompt
    (copied prefill rows), one that runs to the cache's length, one with a frequency penalty,
    and stop tokens (`stops`: request index -> its stop token) that end some early."""
    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (int(n),), generator=generator).tolist()
               for n in (3, 9, 5, 7, 2, 11)]
    prompts = [prompts[0]] * 3 + prompts[1:]
    lengths = [4, 30, 9, 12, MIN_READ_LENGTH - 5, 20, 25, 16]  # the 5th: 5 + 123 tokens
    stops = stops or {}
    requests = []
    for index, (prompt, length) in enumerate(zip(prompts, lengths)):
        params = SamplingParams(max_new_tokens=length, temperature=0,
                                stop_token_ids=[stops[index]] if index in stops else [],
                                frequency_penalty=0.5 if index == 6 else 0.0)
        requests.append((prompt, params))
    return requests


@pytest.mark.parametrize("padded", [False, True], ids=["eager", "padded like graphs"])
def test_overlapped_steps_give_the_tokens_and_logprobs_of_steps_one_after_another(padded):
    plain = serve(engine_for(False, padded), workload())
    # Stop tokens that end requests 1 and 5 part way (at their 6th and 3rd tokens).
    stops = {1: plain[1].output_ids[5], 5: plain[5].output_ids[2]}
    requests = workload(stops)
    one_by_one = engine_for(False, padded)
    expected = serve(one_by_one, requests)
    overlapped = engine_for(True, padded)
    launches = counting_launches(overlapped)
    got = serve(overlapped, requests)
    assert sum(launches) > len(launches) / 2  # most steps overlapped the previous one
    assert expected[1].finish_reason == expected[5].finish_reason == "stop"
    assert len(expected[4].prompt_ids) + len(expected[4].output_ids) == MIN_READ_LENGTH
    for before, after in zip(expected, got):
        assert after.output_ids == before.output_ids
        assert (after.finish_reason, after.matched_stop) == (before.finish_reason,
                                                             before.matched_stop)
        assert len(after.output_logprobs) == len(after.output_versions) == len(after.output_ids)
        # A stopped request's extra row changes the matmuls' shapes, so their float32 sums
        # round differently.
        torch.testing.assert_close(torch.tensor(after.output_logprobs),
                                   torch.tensor(before.output_logprobs), atol=5e-5, rtol=0)
    # Each request that ended while the next step was in flight cost that step one row.
    assert overlapped.status().decode_rows_total > one_by_one.status().decode_rows_total


def test_overlapped_sampling_logs_the_logprob_of_each_requests_own_token():
    """Sampled tokens (which differ from the plain engine's: a stopped row shifts the draws)
    keep their own log-probs through rows moved while a step is in flight: the trainer's
    recomputation of each request's tokens gives them."""
    from asyncrl.model.policy import packed_token_logprobs

    model = tiny_model(4, VOCAB).eval()
    engine = TorchEngine(model, max_running_requests=4, max_sequence_length=MIN_READ_LENGTH,
                         seed=5, overlap=True)
    launches = counting_launches(engine)
    generator = torch.Generator().manual_seed(2)
    requests = [(torch.randint(0, VOCAB, (int(n),), generator=generator).tolist(),
                 SamplingParams(max_new_tokens=length, temperature=0.8, ignore_eos=True))
                for n, length in zip((4, 6, 3, 8, 5, 2), (5, 17, 9, 23, 3, 11))]
    results = serve(engine, requests)
    assert any(launches)
    for (prompt, params), result in zip(requests, results):
        assert len(result.output_ids) == params.max_new_tokens
        ids = torch.tensor(prompt + result.output_ids)
        with torch.no_grad():
            expected = packed_token_logprobs(model, ids, torch.arange(len(ids)),
                                             torch.tensor([0, len(ids)]), 0.8)[len(prompt):]
        torch.testing.assert_close(torch.tensor(result.output_logprobs), expected,
                                   atol=1e-4, rtol=0)


def test_an_overlapped_engine_on_its_thread_aborts_and_pauses_at_step_boundaries():
    engine = TorchEngine(tiny_model(4, VOCAB).eval(), max_running_requests=2,
                         max_sequence_length=512, seed=0, overlap=True).start()
    try:
        futures = [engine.submit([3, 4, 5 + i], SamplingParams(max_new_tokens=400,
                                                               ignore_eos=True))
                   for i in range(4)]
        wait_for(lambda: engine.status().generated_tokens_total >= 12, 30, "12 tokens",
                 every=0.001)
        engine.pause()
        status = engine.status()
        paused_at = status.generated_tokens_total
        assert status.running_requests == 2
        aborted = engine.abort()
        assert len(aborted) == 4 and engine.status().generated_tokens_total == paused_at
        engine.resume()
        for future in futures:
            result = future.result(timeout=30)
            assert result.finish_reason == "abort"
            assert len(result.output_ids) == len(result.output_logprobs) < 400
        later = engine.submit([7, 8], SamplingParams(max_new_tokens=5, ignore_eos=True))
        assert len(later.result(timeout=30).output_ids) == 5
    finally:
        engine.stop()
