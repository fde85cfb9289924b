"""Activation checkpointing: a training step keeps less and recomputes the rest in backward.

Without it, backward needs every activation of every decoder layer of a micro-batch (for
SmolLM2-135M about 2.5 MB a token in float32) and the [tokens x vocabulary] logits with their
log-softmax (49k floats a token). With it (`trainer.activationCheckpointing`):

- each decoder layer keeps only its input, and its forward runs again in backward
  (torch.utils.checkpoint, non-reentrant, which also replays the step's autocast);
- the log-probs are taken from the vocabulary projection LOGIT_ROWS positions at a time, each
  block's logits recomputed in backward, so at most one block's logits exist at once
  (asyncrl.model.policy.packed_token_logprobs; not under FSDP, see asyncrl.trainer.step).

The cost is about one more forward pass per step. transformers' own `gradient_checkpointing`
is not used: it checkpoints only modules in training mode, and the trainer keeps its model in
eval mode (no dropout: see asyncrl.trainer.step).
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

#: Positions whose logits are computed at once when they are recomputed: 512 x 49k float32
#: logits are 100 MB for SmolLM2's vocabulary.
LOGIT_ROWS = 512


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


def head_logprobs(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor,
                  temperature: float = 1.0, rows: int = LOGIT_ROWS) -> torch.Tensor:
    """log softmax(head(hidden[i]) / temperature)[targets[i]] for each row i of `hidden`
    ([positions, hidden size]), computed `rows` positions at a time; backward recomputes each
    block's logits instead of keeping them."""
    return torch.cat([
        checkpoint(_picked_logprobs, hidden[start:start + rows], head, targets[start:start + rows],
                   temperature, use_reentrant=False)
        for start in range(0, hidden.shape[0], rows)
    ]) if hidden.shape[0] else hidden.new_zeros(0, dtype=torch.float32)


def _picked_logprobs(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor,
                     temperature: float) -> torch.Tensor:
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
