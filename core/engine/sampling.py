"""Per-row sampling for a continuous batch: every request keeps its own penalties,
temperature, top-k and top-p, and gets the log-probability of the token under the
distribution it was actually drawn from.

The order is SGLang's: frequency/presence penalties on the raw logits (`apply_penalties`),
then temperature, top-k, top-p, renormalisation and the draw (`sample_tokens`). The reported
log-probability is taken at the very end, from the penalised, scaled, truncated and
renormalised distribution: that is the behaviour policy the trainer's importance ratios need.

A request with a seed of its own draws its token at output position t from
`seeded_uniforms(seed, t)`, a counter-based stream (splitmix64 of the pair), not from the
engine's generator: its draws then depend on its seed alone, not on which other requests share
the batch or when it was scheduled. Its tokens follow the weights, its prompt and its seed, up
to the rounding of logits computed in batches of other shapes (a draw within that rounding
of a boundary between two tokens may fall either side).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class BatchShape:
    """What a batch's settings ask of the sampler, known on the host: each step below runs
    only when some row needs it. Given to `sample_tokens`, it spares reading these answers
    back from the device (a synchronisation each on a GPU)."""

    scaled: bool  # some row's temperature is neither 0 nor 1
    truncated: bool  # some row has a top-k or a top-p below 1
    greedy: bool  # some row has temperature 0

    @classmethod
    def of(cls, temperatures: list[float], top_ps: list[float], top_ks: list[int],
           vocab: int) -> BatchShape:
        return cls(
            scaled=any(t > 0 and t != 1 for t in temperatures),
            truncated=any(t > 0 and (0 < k < vocab or p < 1)
                          for t, p, k in zip(temperatures, top_ps, top_ks)),
            greedy=any(t <= 0 for t in temperatures),
        )


def sample_tokens(
    logits: Tensor,
    temperature: Tensor,
    top_p: Tensor,
    top_k: Tensor,
    generator: torch.Generator | None = None,
    shape: BatchShape | None = None,
    uniforms: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """(tokens [n], logprobs [n]) for logits [n, V] and per-row settings [n].

    `logits` are final apart from sampling settings: penalties, if any, are already applied
    (`apply_penalties`). temperature 0 is greedy: the argmax, with its log-probability under
    the unscaled logits. Otherwise logits are divided by the temperature, cut to the top-k
    tokens and the top-p nucleus, renormalised, and sampled; the log-probability is taken from
    that distribution. `shape` (from the same settings on the host) saves reading back which
    steps apply. `uniforms` [n] in [0, 1): each row's draw (`seeded_uniforms`), instead of
    drawing from `generator`.
    """
    greedy = temperature <= 0
    divisor = torch.where(greedy, torch.ones_like(temperature), temperature)
    # A float32 copy that the steps below overwrite in place: each pass over [n, V] that
    # allocates a tensor of its own costs as much again in fresh pages.
    scaled = logits.to(torch.float32, copy=True)
    if shape.scaled if shape else bool((divisor != 1).any()):
        scaled.div_(divisor[:, None])
    vocab = logits.shape[-1]
    k = torch.where((top_k > 0) & ~greedy, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    p = torch.where(greedy, torch.ones_like(top_p), top_p)
    if shape.truncated if shape else bool((k < vocab).any()) or bool((p < 1).any()):
        scaled = _truncate(scaled, k, p)
    # The row maximum, the exponentials, their sum (the softmax's normaliser) and running sum
    # (the sampling CDF): no full log-softmax for the one log-probability per row that is kept.
    top = scaled.amax(dim=-1, keepdim=True)
    exps = scaled.sub_(top).exp_()
    total = exps.sum(dim=-1, keepdim=True)
    cumulative = exps.cumsum_(dim=-1)
    draw = (uniforms.to(torch.float32)[:, None] if uniforms is not None else
            torch.rand(scaled.shape[0], 1, generator=generator, device=scaled.device))
    # Above 0, so that the first token with any mass is the least one drawn (at 0, a leading
    # token that top-k, top-p or underflow left at 0 would be chosen).
    target = (draw * cumulative[:, -1:]).clamp_(min=torch.finfo(torch.float32).tiny)
    tokens = torch.searchsorted(cumulative, target).squeeze(-1)
    tokens = tokens.clamp_(max=vocab - 1)
    if shape.greedy if shape else bool(greedy.any()):  # an argmax only when a row asks
        tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    # The chosen token's scaled logit, computed again from its logit exactly as above (a
    # sampled token is never one that top-k or top-p masked).
    chosen = logits.gather(-1, tokens[:, None]).float() / divisor[:, None]
    return tokens, (chosen - top - total.log()).squeeze(-1)


def _signed(constant: int) -> int:
    """A 64-bit constant as the int64 it is stored as (multiplication wraps the same)."""
    return constant - (1 << 64) if constant >= 1 << 63 else constant


_GOLDEN = _signed(0x9E3779B97F4A7C15)
_MIX1 = _signed(0xBF58476D1CE4E5B9)
_MIX2 = _signed(0x94D049BB133111EB)


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """A logical right shift of int64 values (torch's `>>` keeps the sign bit)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def seeded_uniforms(seeds: Tensor, positions: Tensor) -> Tensor:
    """float32 uniforms in [0, 1) [n], one per (seed, position) pair of int64 tensors [n]:
    splitmix64's output for the position-th step of a stream started at `seed`, its top 24
    bits. The same pair gives the same number on any device and in any batch."""
    z = seeds + (positions + 1) * _GOLDEN
    z = (z ^ _shift_right(z, 30)) * _MIX1
    z = (z ^ _shift_right(z, 27)) * _MIX2
    z = z ^ _shift_right(z, 31)
    return _shift_right(z, 40).to(torch.float32) * (1.0 / (1 << 24))


def _truncate(scaled: Tensor, k: Tensor, p: Tensor) -> Tensor:
    """Masks (to -inf) tokens outside each row's top-k and top-p nucleus."""
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    drop = ranks >= k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep a token while the mass before it is below top_p (so the top token always stays).
    drop |= (probs.cumsum(dim=-1) - probs) >= p[:, None]
    return scaled.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))


def apply_penalties(
    logits: Tensor, counts: Tensor, frequency_penalty: Tensor, presence_penalty: Tensor
) -> Tensor:
    """Logits [n, V] lowered by OpenAI's (and SGLang's) frequency and presence penalties:
    `logit[t] - frequency_penalty × counts[t] - presence_penalty × (counts[t] > 0)`, where
    `counts` [n, V] is how often each token occurs in the row's output so far and the
    penalties are per row [n]. One batched expression, whatever the vocabulary size."""
    counts = counts.to(logits.dtype)
    return (
        logits
        - frequency_penalty[:, None].to(logits.dtype) * counts
        - presence_penalty[:, None].to(logits.dtype) * (counts > 0).to(logits.dtype)
    )
