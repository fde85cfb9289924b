"""The torch engine against the trainer's own code path and plain transformers."""

import time

import pytest
import torch
from safetensors.torch import save_model

from asyncrl.models import TinyModelConfig, build_tiny_model, packed_token_logprobs
from asyncrl.rollout.engine import TorchEngine
from asyncrl.rollout.sampling import sample_tokens
from asyncrl.rollout.types import RequestError, SamplingParams

VOCAB = 256
# fp32 on CPU: the engine's cached attention and the trainer's packed forward agree to ~1e-6.
LOGPROB_TOLERANCE = 1e-4


def tiny(seed=1):
    return build_tiny_model(TinyModelConfig(seed=seed), vocab_size=VOCAB).eval()


def prompts(count, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (int(n),), generator=generator).tolist()
            for n in torch.randint(2, 12, (count,), generator=generator)]


def recomputed(model, prompt, output):
    ids = torch.tensor(prompt + output)
    with torch.no_grad():
        return packed_token_logprobs(model, ids, torch.arange(len(ids)), torch.tensor([0, len(ids)]))[len(prompt):]


@pytest.fixture
def engine():
    engine = TorchEngine(tiny(), max_running_requests=4, max_sequence_length=96, seed=0).start()
    yield engine
    engine.stop()


def wait_for_tokens(engine, count, timeout=30):
    deadline = time.monotonic() + timeout
    while engine.status().generated_tokens_total < count:
        assert time.monotonic() < deadline, "engine made no progress"
        time.sleep(0.001)


def test_behaviour_logprobs_equal_the_trainers_recomputation(engine):
    batch = prompts(6)
    futures = [engine.submit(p, SamplingParams(max_new_tokens=15, temperature=1.0)) for p in batch]
    for prompt, future in zip(batch, futures):
        result = future.result(timeout=60)
        assert len(result.output_ids) == 15 and result.finish_reason == "length"
        expected = recomputed(engine._model, prompt, result.output_ids)
        torch.testing.assert_close(torch.tensor(result.output_logprobs), expected,
                                   atol=LOGPROB_TOLERANCE, rtol=0)


def test_logprobs_use_the_sampling_temperature(engine):
    prompt = prompts(1)[0]
    result = engine.submit(prompt, SamplingParams(max_new_tokens=8, temperature=0.5)).result(60)
    ids = torch.tensor(prompt + result.output_ids)
    with torch.no_grad():
        expected = packed_token_logprobs(engine._model, ids, torch.arange(len(ids)),
                                         torch.tensor([0, len(ids)]), temperature=0.5)[len(prompt):]
    torch.testing.assert_close(torch.tensor(result.output_logprobs), expected,
                               atol=LOGPROB_TOLERANCE, rtol=0)


def test_continuous_batching_greedy_equals_unbatched_generate():
    """More requests than slots, arriving at different steps, with different lengths: each
    gets exactly the tokens transformers' unbatched greedy generate gives it."""
    model = tiny(seed=2)
    engine = TorchEngine(model, max_running_requests=3, max_sequence_length=96, seed=0).start()
    try:
        batch = prompts(7, seed=3)
        futures = []
        for index, prompt in enumerate(batch):
            futures.append(engine.submit(prompt, SamplingParams(max_new_tokens=5 + 4 * index,
                                                                temperature=0)))
            wait_for_tokens(engine, 2 * index)  # the next one joins a running batch
        distinct = set()
        for prompt, future in zip(batch, futures):
            result = future.result(timeout=60)
            distinct.add(tuple(result.output_ids))
            with torch.no_grad():
                reference = model.generate(
                    torch.tensor([prompt]), max_new_tokens=len(result.output_ids), do_sample=False,
                    eos_token_id=None, pad_token_id=0,
                )[0, len(prompt):].tolist()
            assert result.output_ids == reference
        assert len(distinct) == len(batch)  # a model that ignored its input would fail here
    finally:
        engine.stop()


def test_interrupted_generation_resumes_under_new_weights(tmp_path):
    old, new = tiny(seed=1), tiny(seed=9)
    save_model(new, str(tmp_path / "model.safetensors"))
    engine = TorchEngine(tiny(seed=1), max_running_requests=4, max_sequence_length=96, seed=0).start()
    try:
        batch = prompts(3, seed=5)
        futures = [engine.submit(p, SamplingParams(max_new_tokens=30)) for p in batch]
        wait_for_tokens(engine, 15)
        engine.pause()
        update = engine.update_weights(tmp_path, version=1)
        assert update.version == 1 and update.interrupted_requests == 3
        engine.resume()
        for prompt, future in zip(batch, futures):
            result = future.result(timeout=60)
            # Nothing lost or duplicated: exactly the requested tokens, versions in order.
            assert len(result.output_ids) == 30 and result.interruptions == 1
            versions = result.output_versions
            assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
            cut = versions.index(1)
            under_old = recomputed(old, prompt, result.output_ids)[:cut]
            under_new = recomputed(new, prompt, result.output_ids)[cut:]
            logprobs = torch.tensor(result.output_logprobs)
            torch.testing.assert_close(logprobs[:cut], under_old, atol=LOGPROB_TOLERANCE, rtol=0)
            torch.testing.assert_close(logprobs[cut:], under_new, atol=LOGPROB_TOLERANCE, rtol=0)
        status = engine.status()
        assert status.interrupted_requests_total == 3
        assert status.weight_swap_seconds_total > 0 and status.resume_prefill_seconds_total > 0
        # 3 requests x 30 tokens: every decode step after the first prefill serves all three
        # until they finish together, so the mean batch is close to 3.
        assert status.decode_rows_total / status.decode_steps_total > 2.5
        assert 0 < status.busy_seconds_total
    finally:
        engine.stop()


def test_pause_holds_new_requests_until_resume(engine):
    engine.pause()
    future = engine.submit(prompts(1)[0], SamplingParams(max_new_tokens=3))
    time.sleep(0.2)
    assert not future.done() and engine.status().waiting_requests == 1
    engine.resume()
    assert len(future.result(timeout=30).output_ids) == 3


def test_abort_returns_tokens_so_far():
    # Two slots and long outputs: the six requests cannot all finish before the abort.
    engine = TorchEngine(tiny(), max_running_requests=2, max_sequence_length=512, seed=0).start()
    try:
        futures = [engine.submit(p, SamplingParams(max_new_tokens=400)) for p in prompts(6)]
        wait_for_tokens(engine, 12)
        engine.pause()  # a step boundary, so the abort sees a settled batch
        aborted = engine.abort()
        engine.resume()
        results = [f.result(timeout=10) for f in futures]
        assert len(aborted) >= 4  # at most one wave of two could have finished
        for result in results:
            assert len(result.output_ids) == len(result.output_logprobs) == len(result.output_versions)
            if result.request_id in aborted:
                assert result.finish_reason == "abort" and len(result.output_ids) < 400
            else:
                assert result.finish_reason == "length" and len(result.output_ids) == 400
        assert any(r.output_ids for r in results if r.request_id in aborted)
        assert engine.status().running_requests == 0
        # Still serving.
        assert len(engine.submit(prompts(1)[0], SamplingParams(max_new_tokens=2)).result(30).output_ids) == 2
    finally:
        engine.stop()


def test_stop_tokens_end_a_request(engine):
    prompt = prompts(1)[0]
    first = engine.submit(prompt, SamplingParams(max_new_tokens=6, temperature=0)).result(30)
    stop = first.output_ids[2]
    result = engine.submit(prompt, SamplingParams(max_new_tokens=6, temperature=0,
                                                  stop_token_ids=(stop,))).result(30)
    assert result.finish_reason == "stop" and result.matched_stop == stop
    assert result.output_ids == first.output_ids[: first.output_ids.index(stop) + 1]


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "input_ids"),
        ([1, VOCAB], SamplingParams(), "outside the vocabulary"),
        ([1, 2], SamplingParams(max_new_tokens=-1), "max_new_tokens"),
        ([1, 2], SamplingParams(max_new_tokens=200), "max sequence length"),
        ([1, 2], SamplingParams(top_p=0), "top_p"),
        ([1, 2], SamplingParams(top_k=0), "top_k"),
        ([1, 2], SamplingParams(temperature=-1), "temperature"),
    ],
)
def test_bad_requests_are_refused_and_the_engine_keeps_serving(engine, prompt, params, message):
    with pytest.raises(RequestError, match=message):
        engine.submit(prompt, params)
    assert len(engine.submit([1, 2, 3], SamplingParams(max_new_tokens=2)).result(30).output_ids) == 2


def test_bad_weight_updates_are_refused_and_keep_the_old_weights(engine, tmp_path):
    good = tmp_path / "good.safetensors"
    save_model(tiny(seed=4), str(good))
    engine.update_weights(good, version=3)
    before = {k: v.clone() for k, v in engine._model.state_dict().items()}
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(good.read_bytes()[:1000])
    wrong_shape = tmp_path / "wrong.safetensors"
    save_model(build_tiny_model(TinyModelConfig(hidden_size=32), vocab_size=VOCAB), str(wrong_shape))
    for path, version, message in [
        (good, 2, "older than the serving version 3"),
        (corrupt, 4, "unreadable snapshot"),
        (tmp_path / "missing", 4, "no safetensors snapshot"),
        (wrong_shape, 4, "has shape"),
    ]:
        with pytest.raises(RequestError, match=message):
            engine.update_weights(path, version)
    assert engine.version == 3
    for name, value in engine._model.state_dict().items():
        assert torch.equal(value, before[name])
    assert len(engine.submit([1, 2], SamplingParams(max_new_tokens=2)).result(30).output_ids) == 2


def test_duplicate_request_id_is_refused(engine):
    engine.pause()
    engine.submit([1, 2], SamplingParams(max_new_tokens=2), request_id="a")
    with pytest.raises(RequestError, match="already running"):
        engine.submit([1, 2], SamplingParams(max_new_tokens=2), request_id="a")
    engine.resume()


def test_sampling_respects_top_k_top_p_and_renormalises():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]] * 3)
    generator = torch.Generator().manual_seed(0)
    temperature = torch.tensor([1.0, 1.0, 0.0])
    top_p = torch.tensor([1.0, 0.5, 1.0])
    top_k = torch.tensor([2, -1, -1])
    seen = set()
    for _ in range(200):
        tokens, logprobs = sample_tokens(logits, temperature, top_p, top_k, generator)
        seen.add(int(tokens[0]))
        # top-k 2: renormalised over the two best tokens.
        two = torch.log_softmax(logits[0, :2], -1)
        assert logprobs[0] == pytest.approx(float(two[tokens[0]]), abs=1e-6)
        # top-p 0.5: the best token alone holds > 0.5 of the mass, so it is certain.
        assert int(tokens[1]) == 0 and logprobs[1] == pytest.approx(0.0, abs=1e-6)
        # greedy: argmax with its unscaled log-probability.
        assert int(tokens[2]) == 0
        assert logprobs[2] == pytest.approx(float(torch.log_softmax(logits[2], -1)[0]), abs=1e-6)
    assert seen == {0, 1}
