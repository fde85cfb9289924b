"""Decoupled PPO loss and KL estimators against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.algorithms.ppo import decoupled_ppo_loss, kl_penalty, loglinear_proximal_logprobs

F64 = torch.float64


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def logprobs_with_ratios(proximal: list[float], ratios: list[float]) -> torch.Tensor:
    """Leaf tensor whose ratio to `proximal` is exactly `ratios`."""
    return torch.tensor(
        [p + math.log(r) for p, r in zip(proximal, ratios)], dtype=F64, requires_grad=True
    )


# Five tokens, ratio π_θ/π_prox and advantage chosen to hit every branch of the clip:
#   r=1.5, A=+1: -1.5 vs clipped -1.2  -> -1.2 (clipped above, gradient 0)
#   r=0.5, A=-1: +0.5 vs clipped +0.8  -> +0.8 (clipped below, gradient 0)
#   r=1.1, A=+2: inside the range      -> -2.2
#   r=0.7, A=+1: -0.7 vs clipped -0.8  -> -0.7 (pessimistic: unclipped term wins)
#   r=1.5, A=-1: +1.5 vs clipped +1.2  -> +1.5 (pessimistic: unclipped term wins)
PROX = [-1.0, -2.0, -0.5, -3.0, -1.5]
RATIOS = [1.5, 0.5, 1.1, 0.7, 1.5]
ADV = [1.0, -1.0, 2.0, 1.0, -1.0]


def basic_case():
    logprobs = logprobs_with_ratios(PROX, RATIOS)
    prox = t(PROX)
    return logprobs, prox, prox.clone(), t(ADV), torch.ones(5, dtype=torch.bool)


def test_clipping_on_both_sides_with_positive_and_negative_advantages():
    logprobs, prox, behav, adv, mask = basic_case()
    loss, stats = decoupled_ppo_loss(logprobs, prox, behav, adv, mask, clip_eps=0.2)
    expected = (-1.2 + 0.8 - 2.2 - 0.7 + 1.5) / 5
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert stats["clip_fraction"].item() == pytest.approx(2 / 5)

    loss.backward()
    # d/d logprob of -A * r is -A * r on unclipped tokens, 0 where the clipped term is active.
    expected_grad = [0.0, 0.0, -2.2 / 5, -0.7 / 5, 1.5 / 5]
    assert logprobs.grad.tolist() == pytest.approx(expected_grad, abs=1e-12)


def test_asymmetric_clip_uses_clip_eps_high_above_one():
    logprobs, prox, behav, adv, mask = basic_case()
    loss, _ = decoupled_ppo_loss(logprobs, prox, behav, adv, mask, clip_eps=0.2, clip_eps_high=0.28)
    # Only the first token changes: clipped at 1.28 instead of 1.2.
    expected = (-1.28 + 0.8 - 2.2 - 0.7 + 1.5) / 5
    assert loss.item() == pytest.approx(expected, abs=1e-12)


def test_stats_values():
    logprobs, prox, behav, adv, mask = basic_case()
    _, stats = decoupled_ppo_loss(logprobs, prox, behav, adv, mask)
    k3 = sum(r - 1 - math.log(r) for r in RATIOS) / 5
    assert stats["approx_kl"].item() == pytest.approx(k3, abs=1e-12)
    assert stats["ratio_mean"].item() == pytest.approx(sum(RATIOS) / 5, abs=1e-12)
    assert stats["behaviour_weight_mean"].item() == pytest.approx(1.0)
    assert stats["behaviour_weight_max"].item() == pytest.approx(1.0)
    assert stats["behaviour_capped_fraction"].item() == 0.0
    assert stats["dual_clip_fraction"].item() == 0.0
    assert stats["num_tokens"].item() == 5
    for name, value in stats.items():
        assert not value.requires_grad, name
        assert value.dim() == 0, name


def test_dual_clip_bounds_negative_advantage_tokens_only():
    prox = [-1.0, -1.0, -1.0]
    logprobs = logprobs_with_ratios(prox, [5.0, 2.0, 5.0])
    adv = t([-1.0, -1.0, 1.0])
    mask = torch.ones(3)
    loss, stats = decoupled_ppo_loss(logprobs, t(prox), t(prox), adv, mask, dual_clip=3.0)
    # r=5, A=-1: max(5, 1.2) = 5 -> min(5, 3) = 3 (dual clipped)
    # r=2, A=-1: max(2, 1.2) = 2 < 3, unchanged
    # r=5, A=+1: max(-5, -1.2) = -1.2, A > 0 so no dual clip
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3, abs=1e-12)
    assert stats["dual_clip_fraction"].item() == pytest.approx(1 / 3)
    assert stats["clip_fraction"].item() == pytest.approx(1 / 3)
    loss.backward()
    assert logprobs.grad.tolist() == pytest.approx([0.0, 2.0 / 3, 0.0], abs=1e-12)

    without, _ = decoupled_ppo_loss(logprobs, t(prox), t(prox), adv, mask)
    assert without.item() == pytest.approx((5.0 + 2.0 - 1.2) / 3, abs=1e-12)


BEHAVIOUR_WEIGHTS = [0.5, 2.0, 8.0]


def behaviour_case():
    prox = t([-1.0, -2.0, -3.0])
    behav = prox - t([math.log(w) for w in BEHAVIOUR_WEIGHTS])
    logprobs = prox.clone().requires_grad_(True)  # ratio 1: pg = -A = -1 on every token
    return logprobs, prox, behav, torch.ones(3, dtype=F64), torch.ones(3, dtype=torch.bool)


@pytest.mark.parametrize(
    ("cap", "mode", "weights"),
    [
        (5.0, "mask", [0.5, 2.0, 0.0]),  # w=8 > 5: dropped, but still in the denominator
        (5.0, "clamp", [0.5, 2.0, 5.0]),
        (None, "mask", [0.5, 2.0, 8.0]),
    ],
)
def test_behaviour_weight_cap(cap, mode, weights):
    logprobs, prox, behav, adv, mask = behaviour_case()
    loss, stats = decoupled_ppo_loss(
        logprobs, prox, behav, adv, mask, behaviour_weight_cap=cap, behaviour_cap_mode=mode
    )
    assert loss.item() == pytest.approx(-sum(weights) / 3, abs=1e-12)
    loss.backward()
    assert logprobs.grad.tolist() == pytest.approx([-w / 3 for w in weights], abs=1e-12)
    # Weight stats describe the raw weights, before the cap.
    assert stats["behaviour_weight_mean"].item() == pytest.approx(10.5 / 3)
    assert stats["behaviour_weight_max"].item() == pytest.approx(8.0)
    assert stats["behaviour_capped_fraction"].item() == pytest.approx(0.0 if cap is None else 1 / 3)


def test_no_gradient_through_proximal_behaviour_or_advantages():
    logprobs, prox, behav, adv, mask = behaviour_case()
    for tensor in (prox, behav, adv):
        tensor.requires_grad_(True)
    loss, _ = decoupled_ppo_loss(logprobs, prox, behav, adv, mask)
    loss.backward()
    assert logprobs.grad is not None
    assert prox.grad is None and behav.grad is None and adv.grad is None


def test_not_decoupled_is_standard_ppo_around_the_behaviour_policy():
    behav = t([-1.0, -2.0])
    logprobs = logprobs_with_ratios([-1.0, -2.0], [1.5, 0.5])
    adv = t([1.0, -1.0])
    mask = torch.ones(2)
    garbage_prox = logprobs.detach().clone()  # ratio 1 if it were used: no clipping, loss 0
    loss, stats = decoupled_ppo_loss(logprobs, garbage_prox, behav, adv, mask, decoupled=False)
    assert loss.item() == pytest.approx((-1.2 + 0.8) / 2, abs=1e-12)
    assert stats["behaviour_weight_mean"].item() == 1.0

    same, _ = decoupled_ppo_loss(logprobs, behav, behav, adv, mask, decoupled=True)
    assert loss.item() == pytest.approx(same.item(), abs=1e-12)
    decoupled, _ = decoupled_ppo_loss(logprobs, garbage_prox, behav, adv, mask)
    assert decoupled.item() != pytest.approx(loss.item())


def random_inputs(shape, seed=0, mask_p=0.7):
    gen = torch.Generator().manual_seed(seed)
    behav = -torch.rand(shape, generator=gen, dtype=F64) * 3
    prox = behav + 0.3 * torch.randn(shape, generator=gen, dtype=F64)
    logprobs = (prox + 0.3 * torch.randn(shape, generator=gen, dtype=F64)).requires_grad_(True)
    adv = torch.randn(shape, generator=gen, dtype=F64)
    mask = torch.rand(shape, generator=gen) < mask_p
    return logprobs, prox, behav, adv, mask


def test_micro_batch_losses_with_global_count_sum_to_full_batch_loss():
    logprobs, prox, behav, adv, mask = random_inputs(12, seed=1)
    full, _ = decoupled_ppo_loss(logprobs, prox, behav, adv, mask, dual_clip=3.0)
    (full_grad,) = torch.autograd.grad(full, logprobs)

    n_global = int(mask.sum())
    parts = []
    for sl in (slice(0, 5), slice(5, 12)):
        loss, stats = decoupled_ppo_loss(
            logprobs[sl], prox[sl], behav[sl], adv[sl], mask[sl],
            dual_clip=3.0, num_global_tokens=n_global,
        )
        assert stats["num_tokens"].item() == int(mask[sl].sum())
        parts.append(loss)
    (split_grad,) = torch.autograd.grad(sum(parts), logprobs)
    assert sum(parts).item() == pytest.approx(full.item(), abs=1e-12)
    torch.testing.assert_close(split_grad, full_grad)

    # A tensor count (as an all-reduce would produce) gives the same result.
    as_tensor, _ = decoupled_ppo_loss(
        logprobs, prox, behav, adv, mask, dual_clip=3.0, num_global_tokens=torch.tensor(n_global)
    )
    assert as_tensor.item() == pytest.approx(full.item(), abs=1e-12)


def test_global_count_scales_the_loss():
    logprobs, prox, behav, adv, mask = basic_case()
    local, _ = decoupled_ppo_loss(logprobs, prox, behav, adv, mask)
    scaled, _ = decoupled_ppo_loss(logprobs, prox, behav, adv, mask, num_global_tokens=20)
    assert scaled.item() == pytest.approx(local.item() * 5 / 20, abs=1e-12)


def test_masked_prompt_tokens_change_neither_loss_nor_gradient():
    logprobs, prox, behav, adv, mask = basic_case()
    ref_loss, ref_stats = decoupled_ppo_loss(logprobs, prox, behav, adv, mask)
    (ref_grad,) = torch.autograd.grad(ref_loss, logprobs)

    # Two prompt tokens in front holding extreme values (exp() would overflow) and a NaN advantage.
    lp = torch.cat([t([50.0, -0.1]), logprobs.detach()]).requires_grad_(True)
    px = torch.cat([t([-800.0, -0.2]), prox])
    bh = torch.cat([t([900.0, -5.0]), behav])
    ad = torch.cat([t([float("nan"), 1e6]), adv])
    mk = torch.cat([torch.zeros(2, dtype=torch.bool), mask])
    loss, stats = decoupled_ppo_loss(lp, px, bh, ad, mk, dual_clip=3.0)
    (grad,) = torch.autograd.grad(loss, lp)

    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-12)
    assert grad[:2].tolist() == [0.0, 0.0]
    torch.testing.assert_close(grad[2:], ref_grad)
    for name in ("clip_fraction", "approx_kl", "ratio_mean", "behaviour_weight_max", "num_tokens"):
        assert stats[name].item() == pytest.approx(ref_stats[name].item()), name


def test_zero_tokens_give_zero_loss_and_finite_gradients():
    logprobs, prox, behav, adv, _ = random_inputs(6, seed=2)
    mask = torch.zeros(6, dtype=torch.bool)
    loss, stats = decoupled_ppo_loss(logprobs, prox, behav, adv, mask)
    assert loss.item() == 0.0
    assert loss.requires_grad
    loss.backward()
    assert logprobs.grad.tolist() == [0.0] * 6
    for name, value in stats.items():
        assert value.item() == 0.0, name

    empty = torch.zeros(0, dtype=F64, requires_grad=True)
    loss, stats = decoupled_ppo_loss(empty, empty.detach(), empty.detach(), empty.detach(), empty.detach())
    assert loss.item() == 0.0 and stats["behaviour_weight_max"].item() == 0.0
    loss.backward()


def test_padded_and_packed_forms_give_the_same_loss_and_gradient():
    lengths = [5, 2, 4]
    logprobs, prox, behav, adv, mask = random_inputs(sum(lengths), seed=3)
    packed_loss, packed_stats = decoupled_ppo_loss(logprobs, prox, behav, adv, mask, dual_clip=2.0)
    (packed_grad,) = torch.autograd.grad(packed_loss, logprobs)

    def pad(x, fill):
        rows = torch.split(x.detach(), lengths)
        out = torch.full((len(lengths), max(lengths)), fill, dtype=x.dtype)
        for i, row in enumerate(rows):
            out[i, : len(row)] = row
        return out

    padded_lp = pad(logprobs, 0.0).requires_grad_(True)
    padded_loss, padded_stats = decoupled_ppo_loss(
        padded_lp, pad(prox, 0.0), pad(behav, 0.0), pad(adv, 0.0), pad(mask, False), dual_clip=2.0
    )
    (padded_grad,) = torch.autograd.grad(padded_loss, padded_lp)

    assert padded_loss.item() == pytest.approx(packed_loss.item(), abs=1e-12)
    unpadded = torch.cat([padded_grad[i, :n] for i, n in enumerate(lengths)])
    torch.testing.assert_close(unpadded, packed_grad)
    for name in packed_stats:
        assert padded_stats[name].item() == pytest.approx(packed_stats[name].item()), name


def test_float_mask_and_dtype_are_respected():
    logprobs, prox, behav, adv, mask = random_inputs(8, seed=4)
    as_bool, _ = decoupled_ppo_loss(logprobs, prox, behav, adv, mask)
    as_float, _ = decoupled_ppo_loss(logprobs, prox, behav, adv, mask.to(F64))
    assert as_float.item() == pytest.approx(as_bool.item(), abs=1e-12)

    f32 = [x.detach().float() for x in (logprobs, prox, behav, adv)]
    loss, stats = decoupled_ppo_loss(*f32, mask)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(as_bool.item(), rel=1e-5)
    assert all(v.device == logprobs.device for v in stats.values())


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"clip_eps": 0.0}, "clip_eps"),
        ({"clip_eps": -0.1}, "clip_eps"),
        ({"clip_eps_high": 0.0}, "clip_eps_high"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"dual_clip": 0.5}, "dual_clip"),
        ({"behaviour_weight_cap": 0.0}, "behaviour_weight_cap"),
        ({"behaviour_cap_mode": "clip"}, "behaviour_cap_mode"),
        ({"num_global_tokens": -1}, "num_global_tokens"),
    ],
)
def test_invalid_arguments_are_named(kwargs, name):
    logprobs, prox, behav, adv, mask = basic_case()
    with pytest.raises(ValueError, match=name):
        decoupled_ppo_loss(logprobs, prox, behav, adv, mask, **kwargs)


@pytest.mark.parametrize("position", range(4))
def test_shape_mismatch_is_named(position):
    names = ["proximal_logprobs", "behaviour_logprobs", "advantages", "loss_mask"]
    args = list(basic_case())
    args[position + 1] = args[position + 1][:4]
    with pytest.raises(ValueError, match=names[position]):
        decoupled_ppo_loss(*args)


def test_kl_estimators():
    logp = t([math.log(0.5), math.log(0.3)])
    ref = t([math.log(0.25), math.log(0.3)])
    ln2 = math.log(2.0)
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([ln2, 0.0], abs=1e-12)
    assert kl_penalty(logp, ref, "k2").tolist() == pytest.approx([0.5 * ln2**2, 0.0], abs=1e-12)
    # k3 = exp(ref - logp) - (ref - logp) - 1 = 0.5 + ln 2 - 1
    assert kl_penalty(logp, ref, "k3").tolist() == pytest.approx([ln2 - 0.5, 0.0], abs=1e-12)
    assert kl_penalty(logp, ref).tolist() == kl_penalty(logp, ref, "k3").tolist()
    # k3 stays non-negative where k1 goes negative.
    assert kl_penalty(ref, logp, "k1")[0].item() < 0 < kl_penalty(ref, logp, "k3")[0].item()


def test_kl_estimator_errors():
    with pytest.raises(ValueError, match="estimator"):
        kl_penalty(t([0.0]), t([0.0]), "k4")
    with pytest.raises(ValueError, match="reference_logprobs"):
        kl_penalty(t([0.0]), t([0.0, 1.0]))


# --------------------------------------------------------------------------- loglinear proximal


def test_loglinear_proximal_end_points():
    behaviour, current = t([-1.0, -2.0, -3.0]), t([-1.5, -0.5, -2.0])
    # A token of the proximal version, one of the current version (newer than the proximal
    # policy) and a prompt token (no version) keep their behaviour log-probs.
    kept = loglinear_proximal_logprobs(behaviour, current, torch.tensor([4, 5, -1]),
                                       proximal_version=4, current_version=5)
    assert kept.tolist() == behaviour.tolist()
    # When the proximal policy is the current one, every older token takes the current
    # log-prob, and a token it generated keeps the behaviour one (alpha would be 0 / 0).
    same = loglinear_proximal_logprobs(behaviour, current, torch.tensor([0, 4, 5]),
                                       proximal_version=5, current_version=5)
    assert same.tolist() == [-1.5, -0.5, -3.0]
    # The older the token, the closer to the current log-prob: alpha = 1e6 / (1e6 + 1).
    old = loglinear_proximal_logprobs(t([-1.0]), t([-2.0]), torch.tensor([0]),
                                      proximal_version=10**6, current_version=10**6 + 1)
    assert old.item() == pytest.approx(-2.0, abs=1e-5)


def test_loglinear_proximal_hand_computed_values():
    # alpha = (v_prox - v) / (v_cur - v):
    #   v=0, v_prox=1, v_cur=2 -> 1/2: -1.0 + 0.5 * (-2.0 - -1.0)  = -1.5
    #   v=1, v_prox=4, v_cur=5 -> 3/4: -2.0 + 0.75 * (-0.4 - -2.0) = -0.8
    #   v=2, v_prox=4, v_cur=5 -> 2/3: -3.0 + 2/3 * (0.0 - -3.0)   = -1.0
    behaviour, current = t([-1.0, -2.0, -3.0]), t([-2.0, -0.4, 0.0])
    first = loglinear_proximal_logprobs(behaviour[:1], current[:1], torch.tensor([0]),
                                        proximal_version=1, current_version=2)
    rest = loglinear_proximal_logprobs(behaviour[1:], current[1:], torch.tensor([1, 2]),
                                       proximal_version=4, current_version=5)
    assert first.tolist() == pytest.approx([-1.5], abs=1e-12)
    assert rest.tolist() == pytest.approx([-0.8, -1.0], abs=1e-12)


def test_loglinear_proximal_is_a_constant_of_the_loss():
    current = t([-2.0, -0.4]).requires_grad_()
    approx = loglinear_proximal_logprobs(t([-1.0, -2.0]), current, torch.tensor([0, 1]),
                                         proximal_version=2, current_version=3)
    assert not approx.requires_grad


def test_loglinear_proximal_argument_errors():
    two = t([-1.0, -2.0])
    with pytest.raises(ValueError, match="proximal_version 3 is newer than current_version 2"):
        loglinear_proximal_logprobs(two, two, torch.tensor([0, 1]),
                                    proximal_version=3, current_version=2)
    with pytest.raises(ValueError, match="token_versions"):
        loglinear_proximal_logprobs(two, two, torch.tensor([0]),
                                    proximal_version=1, current_version=2)
    with pytest.raises(ValueError, match="behaviour_logprobs"):
        loglinear_proximal_logprobs(two[:1], two, torch.tensor([0, 1]),
                                    proximal_version=1, current_version=2)


@pytest.mark.parametrize("clip_eps", [0.2, 1e-3])  # the second clips most tokens
def test_sequence_mean_weights_make_the_token_mean_loss_a_mean_over_responses(clip_eps):
    """The trainer's loss is the batch's token mean; with aggregation_weights' factors on the
    advantages it equals the mean over responses of each response's own token mean (GRPO's
    form), gradients included. token_mean's factors are all 1."""
    from asyncrl.algorithms.advantages import aggregation_weights

    generator = torch.Generator().manual_seed(0)
    lengths = [2, 9, 31]
    advantages = torch.tensor([1.5, -0.4, -1.1])
    behaviour = [-torch.rand(n, generator=generator) for n in lengths]
    logprobs = [(b + 0.3 * torch.randn(n, generator=generator)).requires_grad_()
                for b, n in zip(behaviour, lengths)]

    def ppo(index, advantage):
        n = lengths[index]
        return decoupled_ppo_loss(logprobs[index], behaviour[index], behaviour[index],
                                  torch.full((n,), float(advantage)), torch.ones(n),
                                  clip_eps=clip_eps)[0]

    per_response = torch.stack([ppo(i, a) for i, a in enumerate(advantages)]).mean()
    expected = torch.autograd.grad(per_response, logprobs)

    weighted = advantages * aggregation_weights(torch.tensor(lengths), "sequence_mean")
    packed = decoupled_ppo_loss(
        torch.cat(logprobs), torch.cat(behaviour), torch.cat(behaviour),
        torch.cat([torch.full((n,), float(a)) for n, a in zip(lengths, weighted)]),
        torch.ones(sum(lengths)), clip_eps=clip_eps)[0]
    assert torch.allclose(packed, per_response, atol=1e-6)
    for got, want in zip(torch.autograd.grad(packed, logprobs), expected):
        assert torch.allclose(got, want, atol=1e-6)

    assert torch.equal(aggregation_weights(torch.tensor(lengths), "token_mean"), torch.ones(3))
    with pytest.raises(ValueError, match="token_mean, sequence_mean"):
        aggregation_weights(torch.tensor(lengths), "sum")
