"""Keeping less for backward and recomputing the rest: the log-probs' vocabulary projection
(always, for models whose logits are their head's output) and the decoder layers (with
activation checkpointing).

**Log-probs a block of positions at a time** (`head_logprobs`). The trainer needs one number per
token, log softmax(logits)[token], but the logits are [tokens x vocabulary]: for Qwen2.5's
151,936-word vocabulary 0.6 MB of float32 a token, 21 GB for a 35k-token step, more than the
model, its gradients and AdamW together. `head_logprobs` projects LOGIT_BLOCK_BYTES' worth of
positions at a time, keeps only each position's log-sum-exp, and recomputes each block's logits
in backward, where the gradient of a picked log-prob is g * (onehot - softmax) / temperature.
No [tokens x vocabulary] tensor outlives one block. The cost is one more head matmul per token
(of the head's three in a plain forward and backward). Under autocast the head's matmuls run in
the autocast dtype and the softmax in float32, as a plain forward under autocast does.

**Activation checkpointing** (`trainer.activationCheckpointing`, `checkpoint_decoder_layers`):
each decoder layer keeps only its input, and its forward runs again in backward
(torch.utils.checkpoint, non-reentrant, which also replays the step's autocast). Without it,
backward needs every activation of every decoder layer of a micro-batch (for SmolLM2-135M about
2.5 MB a token in float32). The cost is about one more forward pass per step. transformers' own
`gradient_checkpointing` is not used: it checkpoints only modules in training mode, and the
trainer keeps its model in eval mode (no dropout: see asyncrl.trainer.step).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

#: The float32 logits one block of positions may hold: 441 positions of Qwen2.5's vocabulary,
#: 1,365 of SmolLM2's. Large enough that each block's matmuls keep a GPU busy, small beside
#: the model's own memory.
LOGIT_BLOCK_BYTES = 256 * 2**20
#: Positions per block when set (tests set a few, so blocks split sequences); None: as many
#: as LOGIT_BLOCK_BYTES holds.
LOGIT_ROWS: int | None = None


def checkpoint_decoder_layers(model: torch.nn.Module) -> int:
    """Makes each of `model`'s decoder layers (the blocks transformers marks as checkpointable)
    keep only its inputs for backward; returns how many there are. Module hooks (FSDP2's) stay
    outside the recomputed forward, as transformers arranges it."""
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no layers that can be checkpointed")
    for layer in layers:
        if not getattr(layer, "_asyncrl_checkpointed", False):
            layer.forward = functools.partial(checkpoint, layer.forward, use_reentrant=False)
            layer._asyncrl_checkpointed = True
    return len(layers)


def block_rows(vocab_size: int) -> int:
    """Positions per block of logits: LOGIT_ROWS if set, else LOGIT_BLOCK_BYTES of float32
    logits (a multiple of 8 where it can be, for the matmul's tiles)."""
    if LOGIT_ROWS is not None:
        return LOGIT_ROWS
    rows = max(1, LOGIT_BLOCK_BYTES // (4 * vocab_size))
    return rows - rows % 8 if rows >= 8 else rows


def head_logprobs(hidden: torch.Tensor, head: torch.nn.Linear, targets: torch.Tensor,
                  temperature: float = 1.0, rows: int | None = None, entropy: bool = False):
    """log softmax(head(hidden[i]) / temperature)[targets[i]] for each row i of `hidden`
    ([positions, hidden size]), float32, computed `rows` positions at a time (None:
    block_rows); backward recomputes each block's logits instead of keeping them.

    `entropy`: also each row's entropy of that distribution (detached, from the same blocks),
    returned as a second tensor."""
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return (empty, empty.clone()) if entropy else empty
    device = hidden.device.type
    compute_dtype = (torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device)
                     else torch.promote_types(hidden.dtype, head.weight.dtype))
    return _HeadLogprobs.apply(hidden, head.weight, head.bias, targets, float(temperature),
                               rows or block_rows(head.weight.shape[0]), compute_dtype,
                               entropy)


class _HeadLogprobs(torch.autograd.Function):
    """head_logprobs' forward and backward, a block of positions at a time. Saves the hidden
    states, the targets and each position's log-sum-exp: no logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, rows, compute_dtype, entropy):
        head = _Head(weight, bias, temperature, compute_dtype)
        picked = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        logsumexp = torch.empty_like(picked)
        entropies = torch.empty_like(picked) if entropy else None
        with torch.autocast(hidden.device.type, enabled=False):
            for block in _blocks(hidden.shape[0], rows):
                logits = head.logits(hidden[block])
                logsumexp[block] = torch.logsumexp(logits, dim=-1)
                picked[block] = logits.gather(-1, targets[block, None]).squeeze(-1)
                if entropies is not None:
                    entropies[block] = entropy_of_logits(logits, logsumexp[block])
        ctx.save_for_backward(hidden, weight, bias, targets, logsumexp)
        ctx.settings = temperature, rows, compute_dtype
        if entropies is None:
            return picked - logsumexp
        ctx.mark_non_differentiable(entropies)
        return picked - logsumexp, entropies

    @staticmethod
    def backward(ctx, grad_output, *_entropy_grad):
        hidden, weight, bias, targets, logsumexp = ctx.saved_tensors
        temperature, rows, compute_dtype = ctx.settings
        head = _Head(weight, bias, temperature, compute_dtype)
        needs_hidden, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        # Summed over blocks in float32 whatever the compute dtype.
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if needs_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if needs_bias else None
        grad_output = grad_output.float()
        with torch.autocast(hidden.device.type, enabled=False):
            for block in _blocks(hidden.shape[0], rows):
                # d(picked - logsumexp)/d logits = onehot(target) - softmax, times g / T.
                grad_logits = head.logits(hidden[block])
                grad_logits.sub_(logsumexp[block, None]).exp_()
                grad_logits.mul_(-grad_output[block, None])
                grad_logits.scatter_add_(-1, targets[block, None], grad_output[block, None])
                if temperature != 1.0:
                    grad_logits.div_(temperature)
                grad_logits = grad_logits.to(compute_dtype)
                if needs_hidden:
                    grad_hidden[block] = grad_logits @ head.weight
                if needs_weight:
                    grad_weight += grad_logits.T @ hidden[block].to(compute_dtype)
                if needs_bias:
                    grad_bias += grad_logits.sum(0)
        return (grad_hidden,
                None if grad_weight is None else grad_weight.to(weight.dtype),
                None if grad_bias is None else grad_bias.to(bias.dtype),
                None, None, None, None, None)


def entropy_of_logits(logits: torch.Tensor, logsumexp: torch.Tensor | None = None) -> torch.Tensor:
    """The entropy of softmax(logits) along the last dimension, without gradients:
    log Z - sum(p * logits)."""
    with torch.no_grad():
        if logsumexp is None:
            logsumexp = torch.logsumexp(logits, dim=-1)
        if logits.dim() == 2 and logits.shape[0] > (rows := block_rows(logits.shape[-1])):
            # A block of rows at a time: one temporary of the logits' size would double the
            # largest tensor of the step.
            return torch.cat([entropy_of_logits(logits[block], logsumexp[block])
                              for block in _blocks(logits.shape[0], rows)])
        probabilities = (logits - logsumexp[..., None]).exp_()
        # A logit of -inf (a masked token) has probability 0 and adds 0, not 0 x -inf = NaN.
        return logsumexp - torch.where(probabilities > 0, probabilities.mul_(logits), 0.0).sum(-1)


class _Head:
    """The vocabulary projection in the compute dtype, with float32 logits out."""

    def __init__(self, weight, bias, temperature, compute_dtype):
        self.weight = weight.to(compute_dtype)
        self.bias = None if bias is None else bias.to(compute_dtype)
        self.temperature = temperature
        self.compute_dtype = compute_dtype

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden.to(self.compute_dtype), self.weight, self.bias).float()
        return logits.div_(self.temperature) if self.temperature != 1.0 else logits


def _blocks(positions: int, rows: int):
    return (slice(start, start + rows) for start in range(0, positions, rows))
