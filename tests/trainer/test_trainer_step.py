import copy

import pytest
import torch

from asyncrl.algorithms.packing import balance_micro_batches
from asyncrl.algorithms.ppo import decoupled_ppo_loss
from asyncrl.model.policy import packed_token_logprobs
from asyncrl.trainer.step import (PolicyUpdater, TrainSample, UpdateConfig, _compute_weights,
                                  _pack)
from support.trainer import (assert_same_steps, make_groups, make_samples, tiny_model,
                             two_sgd_steps)


def _step(model, samples, optimizer_cls=torch.optim.SGD, lr=0.1, **config):
    optimizer = optimizer_cls(model.parameters(), lr=lr, weight_decay=0.0)
    updater = PolicyUpdater(model, optimizer, UpdateConfig(**config))
    return updater.step(samples)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_step_updates_weights_and_reports_stats():
    model = tiny_model()
    before = _params(model)
    stats = _step(model, make_samples(6), torch.optim.AdamW, lr=1e-3)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert stats["trained_tokens"] == sum(int(s.loss_mask.sum()) for s in make_samples(6))
    assert torch.isfinite(torch.tensor(stats["loss"]))
    assert 0.0 <= stats["clip_fraction"] <= 1.0
    assert stats["grad_norm"] > 0


def test_zero_advantages_leave_weights_unchanged():
    model = tiny_model()
    before = _params(model)
    samples = [TrainSample(s.input_ids, s.loss_mask, s.behaviour_logprobs, 0.0) for s in make_samples(4)]
    stats = _step(model, samples, torch.optim.AdamW, lr=1e-2)
    assert stats["grad_norm"] == 0.0
    for a, b in zip(before, model.parameters()):
        assert torch.equal(a, b)


def test_micro_batch_split_does_not_change_the_update():
    samples = make_samples(8)
    whole, split = tiny_model(), tiny_model()
    stats_whole = _step(whole, samples, micro_batch_max_tokens=10_000)
    stats_split = _step(split, samples, micro_batch_max_tokens=16)
    assert stats_whole["micro_batches"] == 1 and stats_split["micro_batches"] > 2
    assert stats_whole["loss"] == pytest.approx(stats_split["loss"], abs=1e-5)
    for a, b in zip(whole.parameters(), split.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_positive_advantage_makes_the_response_more_likely():
    model = tiny_model()
    sample = make_samples(1)[0]
    good = TrainSample(sample.input_ids, sample.loss_mask, sample.behaviour_logprobs, 1.0)
    updater = PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.5), UpdateConfig())
    before = updater._logprobs(model, _packed(good))[good.loss_mask].sum()
    for _ in range(3):
        updater.step([good])
    after = updater._logprobs(model, _packed(good))[good.loss_mask].sum()
    assert after > before


def test_standard_ppo_ignores_the_proximal_policy():
    """With decoupled=False the importance ratio is taken against the behaviour policy."""
    samples = make_samples(4)
    a, b = tiny_model(), tiny_model()
    stats_a = _step(a, samples, decoupled=False)
    stats_b = _step(b, samples, decoupled=True)
    # Behaviour log-probs in make_samples are far from the model's, so the ratios differ.
    assert stats_a["clip_fraction"] != stats_b["clip_fraction"]


def test_kl_penalty_needs_a_reference_and_pulls_towards_it():
    with pytest.raises(ValueError, match="reference model"):
        PolicyUpdater(tiny_model(), torch.optim.SGD(tiny_model().parameters(), lr=0.1),
                      UpdateConfig(kl_coef=0.1))
    model = tiny_model()
    reference = copy.deepcopy(model).eval()
    updater = PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            UpdateConfig(kl_coef=0.5), reference_model=reference)
    first = updater.step(make_samples(4))
    second = updater.step(make_samples(4))
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)  # identical weights
    assert second["kl"] > 0


def _packed(sample):
    return _pack([sample])


def _as_version(samples, version, *, except_index=None):
    return [TrainSample(s.input_ids, s.loss_mask, s.behaviour_logprobs, s.advantage,
                        None if i == except_index else version) for i, s in enumerate(samples)]


def test_engine_behaviour_logprobs_of_current_weights_equal_the_trainers():
    """A trajectory the engine sampled (untruncated, at the job's temperature) from the weights
    the trainer holds has behaviour log-probs equal to the trainer's log-probs of it."""
    from asyncrl.engine.torch_engine import TorchEngine
    from asyncrl.engine.types import SamplingParams

    model = tiny_model()
    updater = PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            UpdateConfig(temperature=0.7))
    engine = TorchEngine(copy.deepcopy(model), max_running_requests=4, max_sequence_length=64,
                         seed=0).start()
    try:
        futures = [engine.submit(s.input_ids[~s.loss_mask].tolist(),
                                 SamplingParams(max_new_tokens=12, temperature=0.7))
                   for s in make_samples(4)]
        results = [f.result(timeout=60) for f in futures]
    finally:
        engine.stop()
    for result in results:
        ids = torch.tensor(result.prompt_ids + result.output_ids)
        mask = torch.arange(len(ids)) >= len(result.prompt_ids)
        behaviour = torch.zeros(len(ids))
        behaviour[mask] = torch.tensor(result.output_logprobs)
        proximal = updater._logprobs(model, _packed(TrainSample(ids, mask, behaviour, 1.0)))
        torch.testing.assert_close(proximal[mask], behaviour[mask], atol=1e-4, rtol=0)


def test_the_proximal_logprobs_are_the_training_forwards_and_match_a_separate_pass():
    """One optimizer step per batch: the weights before the update are the training forward's,
    so the step runs no proximal forward and updates exactly as the decoupled loss with a
    separate proximal pass of those weights would."""
    samples = make_samples(8)
    model, manual = tiny_model(), tiny_model()
    forwards = _forward_counter(model)
    updater = PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            UpdateConfig(micro_batch_max_tokens=24))
    stats = updater.step(samples, 3)
    assert stats["micro_batches"] > 1
    assert len(forwards) == stats["micro_batches"]  # the training forwards only
    assert stats["clip_fraction"] == stats["approx_kl"] == 0.0

    # The same update by hand: a no-grad proximal pass first, then the loss per micro-batch.
    config = UpdateConfig(micro_batch_max_tokens=24)
    reference = PolicyUpdater(manual, torch.optim.SGD(manual.parameters(), lr=0.1), config)
    groups = balance_micro_batches([s.input_ids.numel() for s in samples], 24)
    packed = [_pack([samples[i] for i in indices]) for indices in groups]
    tokens = torch.tensor(float(sum(int(s.loss_mask.sum()) for s in samples)))
    loss_sum = 0.0
    for mb in packed:
        with torch.no_grad():
            proximal = reference._logprobs(manual, mb)
        loss, _ = decoupled_ppo_loss(
            reference._logprobs(manual, mb), proximal, mb.fields["behaviour_logprobs"],
            mb.fields["advantages"], mb.fields["loss_mask"], clip_eps=0.2,
            behaviour_weight_cap=5.0, num_global_tokens=tokens)
        loss.backward()
        loss_sum += float(loss.detach())
    torch.nn.utils.clip_grad_norm_(manual.parameters(), 1.0)
    reference.optimizer.step()
    assert stats["loss"] == pytest.approx(loss_sum, abs=1e-6)
    for a, b in zip(model.parameters(), manual.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_training_runs_without_dropout():
    """A model configured with dropout trains without it: the proximal log-probs are the
    training forward's, which must be the policy's own (a dropped-out forward is not)."""
    model = tiny_model()
    model.get_input_embeddings().register_forward_hook(
        lambda module, _, output: torch.nn.functional.dropout(output, 0.5, module.training))
    updater = PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.1), UpdateConfig())
    samples = make_samples(4)
    before = [updater._logprobs(model, _packed(s)).detach() for s in samples]
    model.train()  # as a caller may leave it
    again = [updater._logprobs(model, _packed(s)).detach() for s in samples]
    assert any(not torch.equal(a, b) for a, b in zip(before, again))  # dropout is real here
    updater.step(samples, 3)
    assert not model.training


# The decoder's forwards: the trainer runs the decoder alone and the head a block at a time.
def _forward_counter(model):
    calls = []
    model.get_decoder().register_forward_hook(lambda *_: calls.append(1))
    return calls


def _tokens_through(model):
    tokens = []
    model.get_decoder().register_forward_pre_hook(
        lambda _, args, kwargs: tokens.append(kwargs["input_ids"].numel()), with_kwargs=True)
    return tokens


@pytest.mark.parametrize("budget", [2048, 18])
def test_a_groups_prompt_goes_through_the_model_once_with_the_same_update(budget):
    """Responses to one prompt are packed with the prompt once: the same update as packing
    each sequence whole (the update by hand below), and the prompt's tokens computed once per
    micro-batch instead of once per response. With a budget of 18 tokens the groups are split
    across micro-batches, the prompt in each."""
    samples = make_groups(3, 4)
    model, manual = tiny_model(), tiny_model()
    tokens = _tokens_through(model)
    config = UpdateConfig(micro_batch_max_tokens=budget)
    stats = PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.1), config).step(
        samples, 3)
    prompts = sum(4 + 3 * group for group in range(3))
    whole = sum(s.input_ids.numel() for s in samples)
    if budget == 2048:
        assert tokens == [whole - 3 * prompts]  # one micro-batch, each prompt once
    else:
        assert max(tokens) <= budget and whole - 3 * prompts < sum(tokens) < whole

    reference = PolicyUpdater(manual, torch.optim.SGD(manual.parameters(), lr=0.1), config)
    mb = _pack(samples)
    assert mb.continues is None
    loss, _ = decoupled_ppo_loss(
        reference._logprobs(manual, mb), reference._logprobs(manual, mb).detach(),
        mb.fields["behaviour_logprobs"], mb.fields["advantages"], mb.fields["loss_mask"],
        clip_eps=0.2, behaviour_weight_cap=5.0,
        num_global_tokens=torch.tensor(float(mb.fields["loss_mask"].sum())))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(manual.parameters(), 1.0)
    reference.optimizer.step()
    assert stats["loss"] == pytest.approx(float(loss.detach()), abs=1e-6)
    for a, b in zip(model.parameters(), manual.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_a_model_with_its_own_logprobs_gets_whole_sequences():
    """Another backend's model (Megatron-Core's) computes each sequence whole."""
    model = tiny_model()
    seen = []

    def own_logprobs(*args, **kwargs):
        seen.append(kwargs)
        return packed_token_logprobs(model, *args, **kwargs)

    model.packed_token_logprobs = own_logprobs
    PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.1), UpdateConfig()).step(
        make_groups(2, 3), 3)
    assert seen and all("continues" not in kwargs for kwargs in seen)


def test_loglinear_runs_no_proximal_forward_and_matches_recompute_on_older_tokens():
    samples = _as_version(make_samples(8), 2)  # generated one version before the weights

    def run(**config):
        model = tiny_model()
        forwards = _forward_counter(model)
        updater = PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                UpdateConfig(micro_batch_max_tokens=24, **config))
        return updater.step(samples, 3), len(forwards), model

    recomputed, recompute_forwards, with_forward = run()
    approximated, loglinear_forwards, without = run(proximal="loglinear")
    assert approximated["micro_batches"] > 1
    assert loglinear_forwards == recompute_forwards == approximated["micro_batches"]
    # One optimizer step per batch: the proximal weights are the current ones, so for tokens
    # older than them the approximation is the recomputed value.
    assert torch.isfinite(torch.tensor(approximated["loss"]))
    assert approximated["loss"] == pytest.approx(recomputed["loss"], abs=1e-6)
    assert approximated["clip_fraction"] == recomputed["clip_fraction"] == 0.0
    for a, b in zip(with_forward.parameters(), without.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_loglinear_keeps_behaviour_logprobs_of_tokens_the_current_weights_generated():
    # Weights updated mid-generation: each response's first token is from the current version
    # 3, the rest from version 2.
    samples = []
    for s in make_samples(6, behaviour_noise=1.0):
        versions = torch.where(s.loss_mask, 2, -1)
        versions[int(s.loss_mask.nonzero()[0])] = 3
        samples.append(TrainSample(s.input_ids, s.loss_mask, s.behaviour_logprobs, s.advantage,
                                   token_versions=versions))
    model = tiny_model()
    updater = PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            UpdateConfig(proximal="loglinear"))
    # The behaviour weight exp(proximal - behaviour) is 1 where proximal is the behaviour
    # log-prob, and exp(current - behaviour) where it is the current one.
    weights = []
    for s in samples:
        current = updater._logprobs(model, _packed(s)).detach()
        weight = torch.where(s.token_versions == 3, 1.0, torch.exp(current - s.behaviour_logprobs))
        weights.append(weight[s.loss_mask])
    expected = torch.cat(weights).mean().item()
    assert expected != pytest.approx(1.0, abs=0.05)
    stats = updater.step(samples, 3)
    assert stats["behaviour_weight_mean"] == pytest.approx(expected, rel=1e-5)


def test_loglinear_needs_versions():
    model = tiny_model()
    updater = PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            UpdateConfig(proximal="loglinear"))
    with pytest.raises(ValueError, match="proximal loglinear needs the version"):
        updater.step(_as_version(make_samples(2), 2), None)
    with pytest.raises(ValueError, match="proximal loglinear needs the version"):
        updater.step(make_samples(2), 3)
    with pytest.raises(ValueError, match="proximal must be one of"):
        PolicyUpdater(model, updater.optimizer, UpdateConfig(proximal="approx"))


def test_bf16_on_a_cpu_where_it_is_slower_is_warned_about(monkeypatch, caplog):
    import asyncrl.trainer.step as step

    model = tiny_model()
    monkeypatch.setattr(step, "fast_bf16", lambda device: False)
    PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.1),
                  UpdateConfig(compute_dtype="bfloat16"))
    assert "trainer.computeDtype: auto or float32" in caplog.text
    caplog.clear()
    monkeypatch.setattr(step, "fast_bf16", lambda device: True)
    PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.1),
                  UpdateConfig(compute_dtype="bfloat16"))
    PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.1), UpdateConfig())
    assert caplog.text == ""


def _saved_for_backward_bytes(updater, samples) -> tuple[int, dict]:
    """Bytes of the tensors autograd keeps for backward during one step (those a
    checkpointed layer keeps for its recomputation are counted too; the parameters are not),
    and the step's stats."""
    saved = 0
    weights = {p.untyped_storage().data_ptr() for p in updater.model.parameters()}

    def pack(tensor):
        nonlocal saved
        if tensor.untyped_storage().data_ptr() not in weights:
            saved += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        stats = updater.step(samples)
    return saved, stats


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_activation_checkpointing_makes_the_same_update_keeping_a_fraction(dtype):
    samples = make_samples(12)
    results = {}
    for checkpointing in (False, True):
        model = tiny_model()
        updater = PolicyUpdater(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                UpdateConfig(compute_dtype=dtype,
                                             activation_checkpointing=checkpointing))
        saved, stats = _saved_for_backward_bytes(updater, samples)
        updater.step(samples)  # a second step: AdamW's moments in play
        results[checkpointing] = saved, stats, [p.detach().clone() for p in model.parameters()]
    (plain_saved, plain, plain_params), (kept, checkpointed, params) = results[False], results[True]
    for name in ("loss", "grad_norm", "clip_fraction", "trained_tokens"):
        assert checkpointed[name] == pytest.approx(plain[name], rel=1e-5, abs=1e-7), name
    for got, expected in zip(params, plain_params):
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)
    assert kept < plain_saved / 4, (kept, plain_saved)


def test_activation_checkpointing_is_refused_for_a_model_with_its_own_logprobs():
    model = tiny_model()
    model.packed_token_logprobs = lambda *args, **kwargs: None  # as Megatron-Core's policy
    with pytest.raises(ValueError, match="transformers models"):
        PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.1),
                      UpdateConfig(activation_checkpointing=True))


def test_an_evaluator_sharing_the_trainers_weights_generates_with_every_update():
    """The trainer's evaluator (asyncrl.model.policy.sharing_weights): no weights of its own, the
    trainer's model still trains, and each evaluation sees the latest update, as an engine
    over a full copy of the updated model does."""
    from asyncrl.model.policy import sharing_weights
    from asyncrl.engine.torch_engine import TorchEngine
    from asyncrl.engine.types import SamplingParams

    model = tiny_model()
    updater = PolicyUpdater(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                            UpdateConfig(activation_checkpointing=True))
    shared = sharing_weights(model)
    assert [p.data_ptr() for p in shared.parameters()] == [p.data_ptr() for p in model.parameters()]
    prompts = [s.input_ids[:4].tolist() for s in make_samples(3, seed=5)]

    def evaluate(policy) -> list[list[float]]:
        engine = TorchEngine(policy, max_running_requests=3, max_sequence_length=32, seed=0,
                             fused_decode=False)
        futures = [engine.submit(p, SamplingParams(max_new_tokens=6, temperature=0))
                   for p in prompts]
        engine.run_until_idle()
        return [f.result().output_logprobs for f in futures]

    before = evaluate(shared)
    updater.step(make_samples(8))
    assert all(p.requires_grad for p in model.parameters())
    after = evaluate(shared)
    assert after != before
    assert after == evaluate(copy.deepcopy(model))


@pytest.mark.parametrize("fast", [True, False])
def test_auto_compute_dtype_is_bf16_only_where_the_device_computes_it_faster(
        monkeypatch, caplog, fast):
    """auto steps exactly as bfloat16 where bf16 is faster than float32 and as float32
    elsewhere (emulated or dot products only: slower there), without the warning."""
    import asyncrl.platform.devices as devices

    monkeypatch.setattr(devices, "fast_bf16", lambda device: fast)
    caplog.set_level("INFO", logger="asyncrl.trainer.step")
    samples = make_samples(4)
    losses = {dtype: _step(tiny_model(), samples, compute_dtype=dtype)["loss"]
              for dtype in ("auto", "bfloat16", "float32")}
    expected = "bfloat16" if fast else "float32"
    assert losses["auto"] == losses[expected]
    assert losses["bfloat16"] != losses["float32"]  # the two are told apart
    assert f"computes in {expected} (trainer.computeDtype auto" in caplog.text

    # A backend whose layers autocast on CUDA only (Megatron-Core's) stays float32 on a CPU.
    model = tiny_model()
    model.autocast_devices = ("cuda",)
    updater = PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            UpdateConfig(compute_dtype="auto"))
    assert updater.config.compute_dtype == "float32"


@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_a_batchs_advantages_carry_the_loss_aggregation(aggregation):
    """samples_from_groups scales each response's advantage by algorithm.lossAggregation's
    factor: with sequence_mean, a response's summed advantage over its tokens is the same
    for every response of equal |advantage|, whatever its length."""
    from types import SimpleNamespace

    from asyncrl.data.samples import Group, Trajectory
    from asyncrl.trainer.service import samples_from_groups

    def response(length, reward):
        return Trajectory([1, 2], [3] * length, [-0.5] * length, [0] * length, reward, "stop",
                          0.0, 0.0)

    groups = [Group("g", "p", [response(2, 1.0), response(10, 0.0)], 0)]
    algorithm = SimpleNamespace(advantage_estimator="grpo", batch_norm_advantages=False,
                                loss_aggregation=aggregation,
                                overlong_penalty=SimpleNamespace(buffer_tokens=0, factor=1.0))
    samples, _ = samples_from_groups(groups, algorithm)
    per_response = [s.advantage * int(s.loss_mask.sum()) for s in samples]
    if aggregation == "token_mean":
        assert [s.advantage for s in samples] == pytest.approx([0.7071, -0.7071], abs=1e-4)
    else:  # 12 tokens over 2 responses: factors 3 and 0.6
        assert [s.advantage for s in samples] == pytest.approx([3 * 0.7071, -0.6 * 0.7071],
                                                               abs=1e-4)
        assert per_response[0] == pytest.approx(-per_response[1])


@pytest.mark.parametrize("minibatches", [1, 2])
def test_float32_compute_weights_make_the_plain_update(minibatches):
    """Copies of the weights for the passes, gradients summed into float32 by hooks
    (asyncrl.trainer.compute_weights), in float32: the plain update to 1e-6, several
    micro-batches, with and without the proximal pass of several minibatches."""
    samples = make_groups(3, 4)
    options = dict(micro_batch_max_tokens=40, ppo_minibatches=minibatches)
    *plain, plain_params, _ = two_sgd_steps(samples, True, compute_weights=False, **options)
    *copied, params, _ = two_sgd_steps(samples, True, compute_weights=True, **options)
    assert_same_steps(plain, copied, params, plain_params)


def test_bf16_compute_weights_keep_float32_masters_and_update_as_autocast_does():
    """bf16 weights for the passes (a GPU's default in bf16) against autocast over the float32
    weights: float32 parameters, gradients and AdamW state after each step, and one step's
    update in the same direction (the residual stream is bf16 now, so not the same bits)."""
    samples = make_samples(12)
    results = {}
    for kept in (False, True):  # autocast over float32 weights; bf16 copies
        model = tiny_model()
        before = [p.detach().clone() for p in model.parameters()]
        updater = PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                UpdateConfig(compute_dtype="bfloat16", compute_weights=kept,
                                             micro_batch_max_tokens=32))
        assert (updater._compute_weights is not None) == kept
        stats = updater.step(samples)
        assert stats["micro_batches"] > 1
        assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters())
        results[kept] = stats, torch.cat([(p.detach() - b).flatten()
                                          for p, b in zip(model.parameters(), before)])
    (autocast, autocast_update), (computed, computed_update) = results[False], results[True]
    assert computed["grad_norm"] == pytest.approx(autocast["grad_norm"], rel=0.05)
    cosine = torch.nn.functional.cosine_similarity(computed_update, autocast_update, dim=0)
    assert float(cosine) > 0.99

    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    PolicyUpdater(model, optimizer, UpdateConfig(compute_dtype="bfloat16",
                                                 compute_weights=True)).step(samples)
    assert all(state.dtype == torch.float32 for parameter in model.parameters()
               for state in optimizer.state[parameter].values() if state.dim())


def test_compute_weights_are_the_default_in_bf16_on_a_gpu_for_a_whole_model():
    bf16, gpu, cpu = (UpdateConfig(compute_dtype="bfloat16"), torch.device("cuda"),
                      torch.device("cpu"))
    model = tiny_model()
    assert _compute_weights(model, bf16, gpu) is not None
    assert _compute_weights(model, bf16, cpu) is None  # the CPU engine computes in float32
    assert _compute_weights(model, UpdateConfig(compute_dtype="float32"), gpu) is None
    for parameter in list(model.parameters())[:2]:
        parameter.requires_grad_(False)  # as a LoRA model's frozen base
    assert _compute_weights(model, bf16, gpu) is None
