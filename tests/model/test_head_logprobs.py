"""Log-probs a block of positions at a time (asyncrl.model.recompute.head_logprobs): the values
and gradients of the whole-vocabulary path, without its [positions x vocabulary] tensors."""

import pytest
import torch

import asyncrl.model.recompute as recompute
from asyncrl.model.recompute import block_rows, head_logprobs
from support.trainer import (
    assert_same_steps,
    make_groups,
    make_samples,
    tiny_model,
    two_sgd_steps,
)

VOCAB = 97


def _head_and_inputs(positions=23, hidden_size=16, bias=True, seed=0):
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = torch.nn.Linear(hidden_size, VOCAB, bias=bias)
    hidden = torch.randn(positions, hidden_size, generator=generator, requires_grad=True)
    targets = torch.randint(0, VOCAB, (positions,), generator=generator)
    weights = torch.randn(positions, generator=generator)
    return head, hidden, targets, weights


def _whole(hidden, head, targets, temperature):
    logits = head(hidden).float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None]).squeeze(-1)


def _grads(compute, head, hidden, targets, weights, temperature):
    for tensor in (hidden, *head.parameters()):
        tensor.grad = None
    logprobs = compute(hidden, head, targets, temperature)
    (logprobs * weights).sum().backward()
    return logprobs.detach(), [t.grad.clone() for t in (hidden, *head.parameters())]


@pytest.mark.parametrize("rows", [1, 5, 23, 100])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
def test_values_and_gradients_equal_the_whole_vocabularys(rows, temperature, bias):
    head, hidden, targets, weights = _head_and_inputs(bias=bias)
    expected, expected_grads = _grads(_whole, head, hidden, targets, weights, temperature)
    got, grads = _grads(lambda *args: head_logprobs(*args, rows=rows),
                        head, hidden, targets, weights, temperature)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    for name, grad, expected_grad in zip(("hidden", "weight", "bias"), grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=1e-6, msg=name)


def test_under_bf16_autocast_the_head_runs_in_bf16_and_the_softmax_in_float32():
    """The same numbers as the whole-vocabulary path under the same autocast (its matmul in
    bf16, then float32), within bf16's rounding; float32 parameters get float32 gradients."""
    head, hidden, targets, weights = _head_and_inputs(positions=40, hidden_size=32, bias=False)
    results = []
    for compute in (_whole, lambda *args: head_logprobs(*args, rows=7)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            results.append(_grads(compute, head, hidden, targets, weights, 0.7))
    (expected, expected_grads), (got, grads) = results
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)  # the same bf16 logits
    for grad, expected_grad in zip(grads, expected_grads):
        assert grad.dtype == torch.float32
        torch.testing.assert_close(grad, expected_grad, atol=2e-2, rtol=2e-2)
    # And not the float32 numbers: the matmul did run in bf16.
    assert not torch.allclose(got, _whole(hidden, head, targets, 0.7), atol=1e-5, rtol=0)


def test_no_positions_give_no_logprobs():
    head, hidden, targets, _ = _head_and_inputs()
    assert head_logprobs(hidden[:0], head, targets[:0]).shape == (0,)


def test_a_blocks_rows_come_from_its_bytes(monkeypatch):
    assert block_rows(151_936) == 440  # Qwen2.5: 441 positions in 256 MB, a multiple of 8
    assert block_rows(49_152) == 1360  # SmolLM2
    assert block_rows(10**9) == 1
    monkeypatch.setattr(recompute, "LOGIT_ROWS", 4)
    assert block_rows(151_936) == 4


@pytest.mark.parametrize("samples", [make_samples(12), make_groups(3, 4)],
                         ids=["own prompts", "shared prompts"])
def test_an_update_with_logits_in_blocks_is_the_update_with_whole_logits(samples, monkeypatch):
    """Float32, in blocks of 5 positions (blocks split sequences), several micro-batches: the
    same parameters to 1e-6 and the same stats, and no logits kept for backward."""
    monkeypatch.setattr(recompute, "LOGIT_ROWS", 5)
    *whole, whole_params, whole_kept = two_sgd_steps(samples, False, micro_batch_max_tokens=40)
    *blocks, params, kept = two_sgd_steps(samples, True, micro_batch_max_tokens=40)
    assert_same_steps(whole, blocks, params, whole_params)
    vocabulary = tiny_model().config.vocab_size
    assert any(shape[-1] == vocabulary for shape in whole_kept if shape)
    assert not any(shape[-1] == vocabulary for shape in kept if shape)
