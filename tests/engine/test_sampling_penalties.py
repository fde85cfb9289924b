"""Frequency and presence penalties, batched per row, against a token-by-token computation of
OpenAI's definition; and the log-probability sample_tokens reports for penalised logits."""

import pytest
import torch

from asyncrl.engine.sampling import apply_penalties, sample_tokens

VOCAB = 50


def naive_penalised(logits, outputs, frequency, presence):
    """OpenAI: mu[j] - c[j] * frequency - (c[j] > 0) * presence, c[j] counted in the output."""
    rows = []
    for row, output, f, p in zip(logits.tolist(), outputs, frequency, presence):
        for token in range(VOCAB):
            count = output.count(token)
            row[token] -= count * f + (count > 0) * p
        rows.append(row)
    return torch.tensor(rows)


def counts_of(outputs):
    counts = torch.zeros(len(outputs), VOCAB)
    for row, output in enumerate(outputs):
        for token in output:
            counts[row, token] += 1
    return counts


def test_penalties_match_the_definition_row_by_row():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, VOCAB, generator=generator)
    outputs = [[3, 3, 3, 7], [], [1, 2, 1, 49, 0], [5, 5]]
    frequency = [0.5, 1.0, -0.3, 0.0]
    presence = [0.25, 0.0, 1.5, 0.0]
    penalised = apply_penalties(
        logits, counts_of(outputs), torch.tensor(frequency), torch.tensor(presence)
    )
    torch.testing.assert_close(penalised, naive_penalised(logits, outputs, frequency, presence))
    # Token 3 of row 0 occurs three times: 3 x 0.5 + 0.25 lower. An empty output, or a row
    # with both penalties 0, is untouched.
    assert float(logits[0, 3] - penalised[0, 3]) == pytest.approx(1.75)
    torch.testing.assert_close(penalised[1], logits[1])
    torch.testing.assert_close(penalised[3], logits[3])


def test_logprob_is_under_the_penalised_distribution_it_was_sampled_from():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(3, VOCAB, generator=generator)
    outputs = [[0, 0, 1], [2, 2, 2, 2], [4]]
    frequency, presence = torch.tensor([2.0, 1.0, 0.5]), torch.tensor([0.5, 2.0, 0.0])
    penalised = apply_penalties(logits, counts_of(outputs), frequency, presence)
    temperature = torch.tensor([0.7, 1.3, 0.0])
    top_k, top_p = torch.tensor([-1, 10, -1]), torch.tensor([1.0, 0.8, 1.0])
    for _ in range(50):
        tokens, logprobs = sample_tokens(penalised, temperature, top_p, top_k, generator)
        # Row 0: the whole penalised vocabulary at temperature 0.7.
        expected = torch.log_softmax(penalised[0] / 0.7, -1)[tokens[0]]
        assert float(logprobs[0]) == pytest.approx(float(expected), abs=1e-5)
        # Row 1: top-10, then the 0.8 nucleus, renormalised.
        scaled = penalised[1] / 1.3
        order = scaled.argsort(descending=True)[:10]
        probs = torch.softmax(scaled[order], -1)
        kept = order[(probs.cumsum(-1) - probs) < 0.8]
        assert int(tokens[1]) in kept.tolist()
        expected = torch.log_softmax(scaled[kept], -1)[kept.tolist().index(int(tokens[1]))]
        assert float(logprobs[1]) == pytest.approx(float(expected), abs=1e-5)
        # Row 2, greedy: the penalised argmax, under the penalised unscaled distribution.
        assert int(tokens[2]) == int(penalised[2].argmax())
        expected = torch.log_softmax(penalised[2], -1)[tokens[2]]
        assert float(logprobs[2]) == pytest.approx(float(expected), abs=1e-5)
