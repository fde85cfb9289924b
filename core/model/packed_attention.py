"""Attention over a packed row that costs what its sequences cost.

The trainer packs a micro-batch's sequences into one row (see `packed_token_logprobs`).
transformers' SDPA path attends over that whole row with a block-diagonal mask: L² work for a
row of L tokens, most of it masked away (16 sequences of 125 tokens: 16 times the attention
needed; the largest part of a SmolLM2 training step on CPU before this).

Given the row's sequence boundaries, as `cu_seq_lens_q` (the keyword transformers' own
flash-attention path takes for packed rows), this implementation runs causal SDPA once per
sequence. Without them (generation, the rollout engine's explicit masks) it is transformers'
SDPA, unchanged, so a model can use it everywhere. With `continues` as well (a row packed
sharing prefixes, asyncrl.algorithms.packing), a sequence that continues another attends to
all of that one first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

PACKED_SDPA = "asyncrl_packed_sdpa"


def packed_sdpa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [1, heads, L, dim], key/value [1, kv_heads, L, dim] -> ([1, L, heads, dim], None)."""
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None or query.shape[0] != 1:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, **kwargs)
    # The boundaries as numbers, given once per forward (asyncrl.model.policy), not read from
    # the device by every layer.
    edges = kwargs.get("sequence_edges") or bounds.tolist()
    continues = kwargs.get("continues") or [-1] * (len(edges) - 1)
    groups = query.shape[1] // key.shape[1]
    masks: dict[tuple[int, int], torch.Tensor] = {}
    outputs = []
    for start, end, parent in zip(edges[:-1], edges[1:], continues):
        if parent < 0:
            outputs.append(F.scaled_dot_product_attention(
                query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
                dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=True))
            continue
        # The whole sequence it continues, then itself causally: the last rows of a causal
        # mask over both. Keys and values have a head per query head here: SDPA's fused
        # kernels take a mask only without grouped-query attention.
        before = slice(edges[parent], edges[parent + 1])
        seen = before.stop - before.start
        if (end - start, seen) not in masks:
            masks[end - start, seen] = torch.ones(
                end - start, seen + end - start, dtype=torch.bool, device=query.device,
            ).tril(seen)
        keys, values = (
            torch.cat((states[:, :, before], states[:, :, start:end]), dim=2)
            .repeat_interleave(groups, dim=1) for states in (key, value))
        outputs.append(F.scaled_dot_product_attention(
            query[:, :, start:end], keys, values, attn_mask=masks[end - start, seen],
            dropout_p=dropout, scale=scaling))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
# Calls without boundaries get the masks SDPA gets.
ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, sdpa_mask)


def use_packed_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Switches a transformers model to packed SDPA (same results, see the module doc)."""
    model.set_attn_implementation(PACKED_SDPA)
    return model
