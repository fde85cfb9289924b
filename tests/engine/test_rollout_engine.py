"""The torch engine against the trainer's own code path and plain transformers."""

import threading
import time

import pytest
import torch
from safetensors.torch import save_model

from asyncrl.model.policy import packed_token_logprobs
from asyncrl.engine.torch_engine import (SHARED_PREFIX_MIN_TOKENS, TorchEngine,
                                         _shared_prefix_length)
from asyncrl.engine.sampling import sample_tokens
from asyncrl.engine.types import RequestError, SamplingParams
from support.tiny_model import tiny_model, tiny_transformers_model
from support.waiting import wait_for

VOCAB = 256
# fp32 on CPU: the engine's cached attention and the trainer's packed forward agree to ~1e-6.
LOGPROB_TOLERANCE = 1e-4


def tiny(seed=1):
    return tiny_model(seed, VOCAB).eval()


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
    wait_for(lambda: engine.status().generated_tokens_total >= count, timeout,
             f"{count} tokens generated", every=0.001)


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


def penalised_logprobs(model, prompt, output, params, sampled=True):
    """The log-probability of each output token computed directly from full forwards: the
    model's logits, minus frequency_penalty x (count so far) and presence_penalty x (seen so
    far), over temperature, cut to top-k and the top-p nucleus, renormalised. With `sampled`,
    every token must have been possible (-inf otherwise)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + output])).logits[0].float()
    logprobs = []
    for i, token in enumerate(output):
        row = logits[len(prompt) - 1 + i].clone()
        for seen in set(output[:i]):
            count = output[:i].count(seen)
            row[seen] -= params.frequency_penalty * count + params.presence_penalty
        if params.temperature == 0:
            assert token == int(row.argmax()) or not sampled
            logprobs.append(float(torch.log_softmax(row, -1)[token]))
            continue
        row = row / params.temperature
        order = row.argsort(descending=True)
        if params.top_k > 0:
            order = order[: params.top_k]
        probs = torch.softmax(row[order], -1)
        kept = order[(probs.cumsum(-1) - probs) < params.top_p].tolist()
        if token not in kept:
            assert not sampled, "sampled a token outside top-k / top-p"
            logprobs.append(float("-inf"))
            continue
        logprobs.append(float(torch.log_softmax(row[kept], -1)[kept.index(token)]))
    return torch.tensor(logprobs)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=24, temperature=0.8, top_k=40, top_p=0.9,
                       frequency_penalty=1.5, presence_penalty=0.5),
        SamplingParams(max_new_tokens=24, temperature=1.0, frequency_penalty=-1.0),
        SamplingParams(max_new_tokens=24, temperature=0, frequency_penalty=2.0,
                       presence_penalty=2.0),
    ],
    ids=["sampled-with-top-k-top-p", "negative-frequency", "greedy"],
)
def test_penalised_logprobs_are_those_of_the_distribution_sampled_from(engine, params):
    """With penalties the behaviour policy is the penalised distribution: the reported
    log-probabilities equal a direct computation of it, and differ from the model's own."""
    batch = prompts(3, seed=11)
    # Alongside an unpenalised request, so penalised and plain rows share decode steps.
    plain = engine.submit(batch[0], SamplingParams(max_new_tokens=24))
    futures = [engine.submit(p, params) for p in batch]
    for prompt, future in zip(batch, futures):
        result = future.result(timeout=60)
        assert len(result.output_ids) == 24
        expected = penalised_logprobs(engine._model, prompt, result.output_ids, params)
        torch.testing.assert_close(torch.tensor(result.output_logprobs), expected,
                                   atol=LOGPROB_TOLERANCE, rtol=0)
        unpenalised = penalised_logprobs(
            engine._model, prompt, result.output_ids,
            SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p),
            sampled=False,
        )
        assert (torch.tensor(result.output_logprobs) - unpenalised).abs().max() > 1e-2
    result = plain.result(timeout=60)
    expected = recomputed(engine._model, batch[0], result.output_ids)
    torch.testing.assert_close(torch.tensor(result.output_logprobs), expected,
                               atol=LOGPROB_TOLERANCE, rtol=0)


def test_frequency_penalty_stops_greedy_repetition(engine):
    # A random tiny model, greedy, soon loops; a strong penalty makes every token new.
    prompt = prompts(1, seed=2)[0]
    looping = engine.submit(prompt, SamplingParams(max_new_tokens=60, temperature=0)).result(60)
    assert len(set(looping.output_ids)) < 60
    fresh = engine.submit(prompt, SamplingParams(max_new_tokens=60, temperature=0,
                                                 presence_penalty=2.0,
                                                 frequency_penalty=2.0)).result(60)
    assert len(set(fresh.output_ids)) > len(set(looping.output_ids))


def test_ignore_eos_generates_past_the_eos_token():
    """As in SGLang 0.5.23 (Req._check_token_based_finish returns at once with ignore_eos),
    ignore_eos turns off every token stop: the EOS tokens and stop_token_ids alike."""
    prompt = prompts(1, seed=4)[0]
    probe = TorchEngine(tiny(), max_running_requests=2, max_sequence_length=96, seed=0).start()
    try:
        greedy = probe.submit(prompt, SamplingParams(max_new_tokens=12, temperature=0)).result(60)
    finally:
        probe.stop()
    eos = greedy.output_ids[3]
    cut = greedy.output_ids.index(eos) + 1
    engine = TorchEngine(tiny(), max_running_requests=2, max_sequence_length=96,
                         eos_token_ids=(eos,), seed=0).start()
    try:
        def run(**changes):
            params = SamplingParams(max_new_tokens=12, temperature=0, **changes)
            return engine.submit(prompt, params).result(60)

        stopped = run()
        assert stopped.finish_reason == "stop" and stopped.matched_stop == eos
        assert stopped.output_ids == greedy.output_ids[:cut]
        for changes in ({"ignore_eos": True}, {"ignore_eos": True, "stop_token_ids": (eos,)}):
            through = run(**changes)
            assert through.finish_reason == "length" and through.matched_stop is None
            assert through.output_ids == greedy.output_ids
        # Without ignore_eos an explicit stop token stops as before.
        other = greedy.output_ids[1]
        assert run(stop_token_ids=(other,)).output_ids == greedy.output_ids[:2]
    finally:
        engine.stop()


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
            assert_greedy_as_generate(model, prompt, result)
        assert len(distinct) == len(batch)  # a model that ignored its input would fail here
    finally:
        engine.stop()


@pytest.mark.parametrize("grouped", [False, True])
def test_interrupted_generation_resumes_under_new_weights(tmp_path, grouped):
    """Requests interrupted by a weight update resume where they were, under the new weights.
    `grouped`: three responses to one prompt and one to another, and a fourth response to
    the first prompt that starts four steps later: each prompt re-prefilled once, then each
    response's tokens after it (one pass for the 6-token ones, one for the late one's 2)."""
    old, new = tiny(seed=1), tiny(seed=9)
    save_model(new, str(tmp_path / "model.safetensors"))
    engine = TorchEngine(tiny(seed=1), max_running_requests=5, max_sequence_length=96, seed=0).start()
    reached, go = threading.Event(), threading.Event()
    steps, late = [], []

    def hold_once(module, args):  # in the engine's thread, inside its eighth forward pass
        steps.append(1)
        if len(steps) == 5 and grouped:  # joins in the next step
            late.append(engine.submit(batch[0], SamplingParams(max_new_tokens=30)))
        if len(steps) == 8 and not reached.is_set():
            reached.set()
            go.wait(timeout=120)

    try:
        batch = prompts(3, seed=5)
        if grouped:
            batch = [batch[0]] * 3 + [batch[1][:-2]]
        # Submitted while paused, they start in the same step; the engine is held inside its
        # eighth forward pass (7 tokens generated) until the next pause is asked for, so the update
        # comes while all of them are generating however loaded the machine is (no race
        # against their 30 tokens).
        engine.pause()
        futures = [engine.submit(p, SamplingParams(max_new_tokens=30)) for p in batch]
        hold = engine._model.model.embed_tokens.register_forward_pre_hook(hold_once)
        engine.resume()
        assert reached.wait(timeout=60), "the engine never started the requests"
        pausing = threading.Thread(target=engine.pause)
        pausing.start()
        deadline = time.monotonic() + 60
        while not engine.status().paused:
            assert time.monotonic() < deadline, "pause was never asked for"
            time.sleep(0.001)
        go.set()
        pausing.join(timeout=60)
        assert not pausing.is_alive(), "the engine never reached a step boundary"
        hold.remove()
        update = engine.update_weights(tmp_path, version=1)
        futures += late
        batch += [batch[0]] * len(late)
        assert update.version == 1 and update.interrupted_requests == len(batch)
        rows = []
        count = engine._model.model.embed_tokens.register_forward_hook(
            lambda module, args, output: rows.append(tuple(args[0].shape)))
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
        count.remove()
        # The resumed prefill: each distinct prompt once, then every request's tokens after it,
        # those of about the same length together.
        assert rows[0] == (len({tuple(p) for p in batch}), max(map(len, batch)))
        if grouped:  # 7 tokens generated: 6 cached, 1 pending; the late one 3: 2 cached
            assert rows[1:3] == [(4, 6), (1, 2)]
        else:  # 8 generated
            assert rows[1] == (len(batch), 7)
        assert len(late) == grouped
        status = engine.status()
        assert status.interrupted_requests_total == len(batch)
        assert status.weight_swap_seconds_total > 0 and status.resume_prefill_seconds_total > 0
        # n requests x 30 tokens: every decode step after the first prefill serves all of them
        # until they finish together (but the late one), so the mean batch is close to n.
        assert status.decode_rows_total / status.decode_steps_total > len(batch) - 0.5 - len(late)
        assert 0 < status.busy_seconds_total
    finally:
        engine.stop()


def test_pause_holds_new_requests_until_resume(engine):
    engine.pause()
    # The submission wakes the engine's loop, which looks at the queue and, paused, notifies
    # on its way back to waiting: after that notice the request would have started if pause
    # did not hold it. (Held from before the submission, so the notice cannot be missed; the
    # limit only catches a hang.)
    with engine._wake:
        future = engine.submit(prompts(1)[0], SamplingParams(max_new_tokens=3))
        assert engine._wake.wait(timeout=60), "the engine's loop never looked at the request"
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
        ([1, 2], SamplingParams(frequency_penalty=2.5), "frequency_penalty"),
        ([1, 2], SamplingParams(presence_penalty=-3), "presence_penalty"),
        ([1, 2], SamplingParams(frequency_penalty=float("nan")), "frequency_penalty"),
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
    save_model(tiny_model(vocab_size=VOCAB, hidden_size=32), str(wrong_shape))
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


def test_engine_on_the_selected_device_in_bfloat16(tmp_path):
    """What `serve rollout` builds for model.dtype bfloat16 on a GPU pool: the device comes
    from select_device (the CPU here, cuda:0 on a GPU machine, the same code); weights and KV
    cache are bf16, log-probabilities are still those of the model (computed in float32), and
    a float32 snapshot from the trainer loads into the bf16 weights."""
    from asyncrl.platform.devices import select_device

    device = select_device(gpus_requested=1)
    model = tiny(seed=4).to(device=device, dtype=torch.bfloat16)
    engine = TorchEngine(model, max_running_requests=4, max_sequence_length=96, seed=0).start()
    try:
        batch = prompts(3, seed=6)
        # Submitted while paused, they start in the same step. Otherwise how they are batched
        # (and so how bf16 rounds) depends on when the engine's loop sees each one.
        engine.pause()
        futures = [engine.submit(p, SamplingParams(max_new_tokens=12)) for p in batch]
        engine.resume()
        for prompt, future in zip(batch, futures):
            result = future.result(timeout=60)
            expected = recomputed(model, prompt, result.output_ids).float().cpu()
            # bf16 rounds differently in cached decoding and in one packed forward pass, and
            # each CPU's bf16 kernels round their own way: on average the two agree closely,
            # no token far apart (a wrong token or position would be off by whole units).
            difference = (torch.tensor(result.output_logprobs) - expected).abs()
            assert difference.mean() < 0.05 and difference.max() < 0.25, difference
        save_model(tiny(seed=5), str(tmp_path / "model.safetensors"))  # float32, as published
        assert engine.update_weights(tmp_path, version=1).version == 1
        assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
        assert {p.device for p in model.parameters()} == {device}
        result = engine.submit(batch[0], SamplingParams(max_new_tokens=4)).result(timeout=60)
        assert result.output_versions == [1] * 4
    finally:
        engine.stop()


def test_weight_copies_and_aborts_run_on_the_engines_thread(tmp_path):
    """Tensor work from other threads would give the process a second OpenMP pool (see
    asyncrl.platform.openmp): update_weights and abort hand their work to the engine's loop."""
    save_model(tiny(seed=4), str(tmp_path / "model.safetensors"))
    engine = TorchEngine(tiny(), max_running_requests=2, max_sequence_length=96, seed=0).start()
    ran_on = []
    for name in ("_swap_now", "_release_row"):
        original = getattr(engine, name)

        def recorded(*args, _original=original, **kwargs):
            ran_on.append(threading.current_thread())
            return _original(*args, **kwargs)

        setattr(engine, name, recorded)
    try:
        future = engine.submit(prompts(1)[0], SamplingParams(max_new_tokens=90, ignore_eos=True))
        wait_for_tokens(engine, 2)
        assert engine.update_weights(tmp_path, version=1).version == 1
        assert engine.abort() == [future.result(timeout=60).request_id]
        assert future.result().finish_reason == "abort"
        assert len(ran_on) == 2 and all(t is engine._thread for t in ran_on)
        assert threading.current_thread() is not engine._thread
    finally:
        engine.stop()
    # Stopped: the same calls run inline and still work.
    assert engine.update_weights(tmp_path, version=2).version == 2


def test_prefill_batches_are_runs_of_uncached_rows_within_the_token_cap():
    from asyncrl.engine.torch_engine import _prefill_batches, _Request
    from asyncrl.engine.types import GenerationResult

    def request(length, cached):
        r = _Request(GenerationResult("r", list(range(length))), SamplingParams(), frozenset())
        r.cached = cached
        return r

    running = [request(10, 0), request(10, 0), request(5, 5), request(30, 0), request(10, 0),
               request(40, 0)]
    assert _prefill_batches(running, 1000) == [slice(0, 2), slice(3, 6)]
    # 3 rows x 30 tokens pass 80: the run is cut where the padded size would.
    assert _prefill_batches(running, 80) == [slice(0, 2), slice(3, 5), slice(5, 6)]
    assert _prefill_batches([request(4, 4)], 80) == []


def test_an_engine_not_started_serves_in_the_callers_thread():
    """The trainer's evaluator: no thread of its own, the same tokens as a started engine."""
    batch = prompts(5, seed=8)
    params = SamplingParams(max_new_tokens=9, temperature=0)
    inline = TorchEngine(tiny(), max_running_requests=2, max_sequence_length=96, seed=0)
    futures = [inline.submit(p, params) for p in batch]
    inline.run_until_idle()
    assert all(f.done() for f in futures)
    threaded = TorchEngine(tiny(), max_running_requests=2, max_sequence_length=96, seed=0).start()
    try:
        expected = [threaded.submit(p, params).result(timeout=60).output_ids for p in batch]
        with pytest.raises(RuntimeError, match="own thread"):
            threaded.run_until_idle()
    finally:
        threaded.stop()
    assert [f.result().output_ids for f in futures] == expected
    assert torch.is_grad_enabled()  # the caller's thread is left as it was


def test_the_responses_to_one_prompt_share_its_prefill():
    """n requests with the same prompt (a GRPO group): one forward row, its cache copied to the
    others; each still samples on its own, and every log-prob matches a full forward."""
    model = tiny(seed=3)
    engine = TorchEngine(model, max_running_requests=8, max_sequence_length=96, seed=0)
    shared, other = prompts(2, seed=11)
    batch = [shared] * 5 + [other] * 2 + [shared[:-1]]
    sampled = [engine.submit(p, SamplingParams(max_new_tokens=12, temperature=1.0)) for p in batch]
    forwarded = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda module, args, output: forwarded.append(args[0].shape))
    engine.run_until_idle()
    hook.remove()
    assert forwarded[0][0] == 3  # the prefill: three distinct prompts went through the model
    results = [f.result() for f in sampled]
    assert len({tuple(r.output_ids) for r in results[:5]}) > 1  # twins sample independently
    for prompt, result in zip(batch, results):
        assert len(result.output_ids) == 12
        torch.testing.assert_close(torch.tensor(result.output_logprobs),
                                   recomputed(model, prompt, result.output_ids),
                                   atol=LOGPROB_TOLERANCE, rtol=0)


def assert_greedy_as_generate(model, prompt, result):
    """`result` holds the tokens unbatched greedy generate gives `prompt`, and the log-probs a
    full forward gives them."""
    with torch.no_grad():
        reference = model.generate(
            torch.tensor([prompt]), max_new_tokens=len(result.output_ids), do_sample=False,
            eos_token_id=None, pad_token_id=0,
        )[0, len(prompt):].tolist()
    assert result.output_ids == reference
    torch.testing.assert_close(torch.tensor(result.output_logprobs),
                               recomputed(model, prompt, result.output_ids),
                               atol=LOGPROB_TOLERANCE, rtol=0)


def test_distinct_prompts_that_begin_alike_compute_the_shared_tokens_once():
    """Distinct prompts behind one system turn (a chat template's): its tokens go through the
    model once, in one row, copied to the others; every greedy token is still the one
    unbatched generate gives, every log-prob the one a full forward gives."""
    model = tiny(seed=4)
    system = torch.randint(0, VOCAB, (SHARED_PREFIX_MIN_TOKENS + 4,),
                           generator=torch.Generator().manual_seed(12)).tolist()
    tails = prompts(4, seed=13)
    # Four prompts behind the whole system turn, a twin of the first (a group's), and one
    # that leaves the system turn two tokens early.
    batch = [system + tail for tail in tails] + [
        system + tails[0], system[:-2] + [(system[-2] + 1) % VOCAB, 2]]
    engine = TorchEngine(model, max_running_requests=len(batch), max_sequence_length=96, seed=0)
    greedy = SamplingParams(max_new_tokens=10, temperature=0)
    futures = [engine.submit(p, greedy) for p in batch]
    forwarded = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda module, args, output: forwarded.append(tuple(args[0].shape)))
    engine.run_until_idle()
    hook.remove()
    longest = max(len(p) for p in batch)
    # The prefix (one row, as long as the shortest prompt's leading tokens the others share),
    # then the five distinct prompts' rest, padded to the longest.
    assert forwarded[:2] == [(1, len(system) - 2), (5, longest - len(system) + 2)]
    for prompt, future in zip(batch, futures):
        assert_greedy_as_generate(model, prompt, future.result())


def test_a_shared_prefix_lands_in_rows_after_running_ones_and_may_leave_one_token_each():
    """The prompts join a batch that is already decoding (their rows do not start at 0), and
    each is the shared turn and one token more (the rest is one position wide)."""
    model = tiny(seed=5)
    engine = TorchEngine(model, max_running_requests=4, max_sequence_length=96, seed=0).start()
    forwarded = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda module, args, output: forwarded.append(tuple(args[0].shape)))
    try:
        system = torch.randint(0, VOCAB, (SHARED_PREFIX_MIN_TOKENS + 2,),
                               generator=torch.Generator().manual_seed(14)).tolist()
        greedy = SamplingParams(max_new_tokens=8, temperature=0)
        running = engine.submit(prompts(1, seed=15)[0],
                                SamplingParams(max_new_tokens=60, temperature=0))
        wait_for_tokens(engine, 2)
        batch = [system + [token] for token in (3, 5, 7)]
        engine.pause()  # so that the three are admitted together, at one step boundary
        futures = [engine.submit(p, greedy) for p in batch]
        engine.resume()
        results = [f.result(timeout=60) for f in futures]
        running.result(timeout=60)
    finally:
        hook.remove()
        engine.stop()
    assert (1, len(system)) in forwarded and (3, 1) in forwarded
    for prompt, result in zip(batch, results):
        assert_greedy_as_generate(model, prompt, result)


def test_a_shared_prefix_is_only_taken_when_it_is_long_enough_and_never_a_whole_prompt():
    head = list(range(SHARED_PREFIX_MIN_TOKENS))
    assert _shared_prefix_length([head + [1, 2], head + [3]]) == SHARED_PREFIX_MIN_TOKENS
    assert _shared_prefix_length([head + [1, 2], head + [1, 3]]) == SHARED_PREFIX_MIN_TOKENS + 1
    assert _shared_prefix_length([head[:-1] + [1], head[:-1] + [2]]) == 0  # too short to pay
    assert _shared_prefix_length([head + [1], head + [1, 2]]) == SHARED_PREFIX_MIN_TOKENS
    assert _shared_prefix_length([head + [1]]) == 0  # one prompt: nothing to share


def other_architecture(kind: str, seed: int = 1):
    """Tiny random models beyond build_tiny_model's plain Llama: biases in the projections
    (Llama with attention_bias and mlp_bias, Qwen2's q/k/v biases) and Qwen3's per-head
    q/k norms, which the fused decode step does not compute."""
    architecture, config = {
        "llama-biased": ("llama", {"attention_bias": True, "mlp_bias": True}),
        "qwen2": ("qwen2", {}),
        "qwen3": ("qwen3", {"head_dim": 16}),
    }[kind]
    return tiny_transformers_model(architecture, seed, bias_std=0.3, vocab_size=VOCAB,
                                   **config).eval()


@pytest.mark.parametrize("kind, fused", [("llama", True), ("llama-biased", True),
                                         ("qwen2", True), ("qwen3", False)])
def test_decode_steps_fused_or_not_give_the_trainers_logprobs(kind, fused):
    """Decode steps run fused projections for Llama-family layers (biases included) and the
    model's own layers otherwise; either way every log-prob is the trainer's, before and after
    a weight update copied into the model (the fused projections are views of its weights)."""
    build = tiny if kind == "llama" else lambda seed: other_architecture(kind, seed)
    engine = TorchEngine(build(1), max_running_requests=4, max_sequence_length=96, seed=0).start()
    try:
        assert engine.fused_decode is fused
        batch = prompts(4, seed=7)
        for version, model in enumerate([build(1), build(5)]):
            if version:
                engine.update_weights_from_state_dict(model.state_dict(), version)
            futures = [engine.submit(p, SamplingParams(max_new_tokens=10)) for p in batch]
            for prompt, future in zip(batch, futures):
                result = future.result(timeout=60)
                assert set(result.output_versions) == {version}
                torch.testing.assert_close(torch.tensor(result.output_logprobs),
                                           recomputed(model, prompt, result.output_ids),
                                           atol=LOGPROB_TOLERANCE, rtol=0)
    finally:
        engine.stop()


def test_fused_decode_gives_the_model_layers_greedy_tokens():
    """The same greedy tokens from an engine decoding through fused projections as from one
    decoding through the model's own layers, requests joining and leaving."""
    outputs = []
    for fused in (True, False):
        engine = TorchEngine(tiny(seed=4), max_running_requests=3, max_sequence_length=96,
                             seed=0, fused_decode=fused)
        assert engine.fused_decode is fused
        futures = [engine.submit(p, SamplingParams(max_new_tokens=6 + 3 * i, temperature=0))
                   for i, p in enumerate(prompts(6, seed=8))]
        engine.run_until_idle()
        outputs.append([f.result().output_ids for f in futures])
    assert outputs[0] == outputs[1]
    assert len({tuple(o) for o in outputs[0]}) == 6


def test_resumed_rows_extend_in_runs_of_about_one_length():
    from asyncrl.engine.torch_engine import _extend_runs

    # (row, tokens to cache): a run ends at a gap in the rows, at a row longer than its first
    # or under half of it.
    rows = [(3, 10), (4, 8), (5, 5), (6, 4), (8, 4), (9, 12), (10, 3)]
    assert _extend_runs(rows) == [slice(3, 6), slice(6, 7), slice(8, 9), slice(9, 10),
                                  slice(10, 11)]
    assert _extend_runs([]) == []
