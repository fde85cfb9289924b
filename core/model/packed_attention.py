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

On a GPU one SDPA call per sequence per layer is thousands of kernel launches a forward, more
host time than the GPU's work. There the row goes to PyTorch's variable-length flash attention
in one call a layer (`VarlenLayout`, built once per forward and given to every layer as
`packed_layout`): the row's own queries, keys and values, with no padding. Where that kernel
is missing or does not take the dtype, the row's sequences go as a few padded batches
(`BatchedLayout`): sequences of about one length in one batch, each row's queries its own
tokens, its keys those of the sequence it continues and its own, and a mask saying which it
sees; a few gathers and one SDPA call per batch a layer, padding costing a batch at most twice
its queries' work. The same result either way (tests compare both with the loop on a CPU).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from asyncrl.model.varlen_attention import FLASH_DTYPES, installed_kernel, varlen_call

log = logging.getLogger(__name__)

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
    layout = kwargs.get("packed_layout")
    if layout is not None:
        return layout.attend(query, key, value, dropout, scaling), None
    # The boundaries as numbers, given once per forward (asyncrl.model.policy), not read from
    # the device by every layer.
    edges = kwargs.get("sequence_edges") or bounds.tolist()
    continues = kwargs.get("continues") or [-1] * (len(edges) - 1)
    groups = query.shape[1] // key.shape[1]
    # One split per tensor, not a slice per sequence: a slice's backward fills a zero tensor
    # the size of the whole row and adds it up, per sequence and layer; a split's is one cat.
    lengths = [end - start for start, end in zip(edges[:-1], edges[1:])]
    queries, keys, values = (states.split(lengths, dim=2) for states in (query, key, value))
    masks: dict[tuple[int, int], torch.Tensor] = {}
    outputs = []
    for s, parent in enumerate(continues):
        if parent < 0:
            outputs.append(F.scaled_dot_product_attention(
                queries[s], keys[s], values[s],
                dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=True))
            continue
        # The whole sequence it continues, then itself causally: the last rows of a causal
        # mask over both. Keys and values have a head per query head here: SDPA's fused
        # kernels take a mask only without grouped-query attention.
        length, seen = lengths[s], lengths[parent]
        if (length, seen) not in masks:
            masks[length, seen] = torch.ones(
                length, seen + length, dtype=torch.bool, device=query.device,
            ).tril(seen)
        seen_keys, seen_values = (
            torch.cat((parts[parent], parts[s]), dim=2).repeat_interleave(groups, dim=1)
            for parts in (keys, values))
        outputs.append(F.scaled_dot_product_attention(
            queries[s], seen_keys, seen_values, attn_mask=masks[length, seen],
            dropout_p=dropout, scale=scaling))
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


@dataclass
class _Batch:
    queries: torch.Tensor  # [B, Lq]: the row positions of each batch row's queries (padding: 0)
    keys: torch.Tensor  # [B, Lk]: its keys' positions, the continued sequence's then its own
    mask: torch.Tensor  # [B, 1, Lq, Lk] bool: what each query sees


@dataclass
class BatchedLayout:
    """A packed row's sequences as a few padded batches (see the module doc)."""

    batches: list[_Batch]
    placed: torch.Tensor  # [L]: where each row position's output is in the batches' outputs

    @classmethod
    def build(cls, edges: list[int], continues: list[int] | None,
              device: torch.device | str) -> BatchedLayout:
        """The layout of a row whose sequence s is `edges[s]:edges[s + 1]`, continuing
        sequence `continues[s]` (-1 or None: none)."""
        count = len(edges) - 1
        continues = continues or [-1] * count
        lengths = [edges[s + 1] - edges[s] for s in range(count)]
        seen = [lengths[p] if p >= 0 else 0 for p in continues]
        # Longest first; a batch ends where a sequence is under half its first's length.
        order = sorted(range(count), key=lambda s: -lengths[s])
        groups: list[list[int]] = []
        for s in order:
            if groups and lengths[s] * 2 >= lengths[groups[-1][0]]:
                groups[-1].append(s)
            else:
                groups.append([s])
        placed = torch.empty(edges[-1], dtype=torch.long)
        batches, offset = [], 0
        for group in groups:
            width = lengths[group[0]]
            span = max(seen[s] + lengths[s] for s in group)
            queries = torch.zeros(len(group), width, dtype=torch.long)
            keys = torch.zeros(len(group), span, dtype=torch.long)
            mask = torch.zeros(len(group), 1, width, span, dtype=torch.bool)
            for row, s in enumerate(group):
                start, n, before = edges[s], lengths[s], seen[s]
                own = torch.arange(start, start + n)
                queries[row, :n] = own
                placed[own] = offset + row * width + torch.arange(n)
                if before:
                    parent = continues[s]
                    keys[row, :before] = torch.arange(edges[parent], edges[parent + 1])
                keys[row, before:before + n] = own
                # All of the continued sequence, then its own tokens causally.
                mask[row, 0, :n, :before + n] = torch.ones(n, before + n,
                                                           dtype=torch.bool).tril(before)
                mask[row, 0, n:, 0] = True  # padding queries see one key: no NaN, never read
            batches.append(_Batch(queries.to(device), keys.to(device), mask.to(device)))
            offset += len(group) * width
        return cls(batches, placed.to(device))

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               dropout: float, scaling: float | None) -> torch.Tensor:
        """query [1, heads, L, dim], key/value [1, kv_heads, L, dim] -> [1, L, heads, dim]."""
        heads, dim = query.shape[1], query.shape[3]
        groups = heads // key.shape[1]
        outputs = []
        for batch in self.batches:
            # [heads, B, Lq, dim] -> [B, heads, Lq, dim]; keys with a head per query head:
            # SDPA's fused kernels take a mask only without grouped-query attention.
            queries = query[0][:, batch.queries].transpose(0, 1)
            keys, values = (
                states[0][:, batch.keys].transpose(0, 1).repeat_interleave(groups, dim=1)
                for states in (key, value))
            attended = F.scaled_dot_product_attention(queries, keys, values,
                                                      attn_mask=batch.mask, dropout_p=dropout,
                                                      scale=scaling)
            outputs.append(attended.transpose(1, 2).reshape(-1, heads, dim))  # [B * Lq, ...]
        return torch.cat(outputs)[self.placed][None]


@dataclass
class VarlenLayout:
    """A packed row as the flash kernel's variable-length attention takes it
    (asyncrl.model.varlen_attention): queries are the row itself, with no gather or scatter;
    a sequence that continues another has for keys that one's tokens then its own (one gather
    of the keys and values, none without sharing). Causal from the last key, so each query sees
    all of the sequence it continues, then its own tokens up to itself. Dtypes or dropout the
    kernel does not take, and a kernel that fails, go to a BatchedLayout of the same row."""

    edges: list[int]
    continues: list[int] | None
    cu_seq_q: torch.Tensor  # int32 [N + 1]
    cu_seq_k: torch.Tensor  # int32 [N + 1]
    max_q: int
    max_k: int
    key_positions: torch.Tensor | None  # [Tk]: the row positions of the keys; None: the row
    kernel: Callable | None  # None: this PyTorch's varlen_attn
    _batched: BatchedLayout | None = None

    @classmethod
    def build(cls, edges: list[int], continues: list[int] | None, device: torch.device | str,
              kernel: Callable | None = None) -> VarlenLayout:
        count = len(edges) - 1
        parents = continues or [-1] * count
        lengths = [edges[s + 1] - edges[s] for s in range(count)]
        spans = [(lengths[p] if p >= 0 else 0) + lengths[s] for s, p in enumerate(parents)]
        cu_seq_q = torch.tensor(edges, dtype=torch.int32)
        key_positions = None
        cu_seq_k = cu_seq_q
        if any(p >= 0 for p in parents):
            key_positions = torch.cat([
                torch.cat((torch.arange(edges[p], edges[p + 1]) if p >= 0
                           else torch.arange(0), torch.arange(edges[s], edges[s + 1])))
                for s, p in enumerate(parents)])
            cu_seq_k = torch.tensor([0, *itertools.accumulate(spans)], dtype=torch.int32)
            key_positions = key_positions.to(device)
        return cls(edges, continues, cu_seq_q.to(device), cu_seq_k.to(device),
                   max(lengths, default=0), max(spans, default=0), key_positions, kernel)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               dropout: float, scaling: float | None) -> torch.Tensor:
        """query [1, heads, L, dim], key/value [1, kv_heads, L, dim] -> [1, L, heads, dim]."""
        global _varlen_failed
        kernel = self.kernel or installed_kernel()
        device = query.device.type
        if torch.is_autocast_enabled(device):
            # As autocast would have given SDPA: the flash kernel takes no float32.
            dtype = torch.get_autocast_dtype(device)
            query, key, value = (t.to(dtype) for t in (query, key, value))
        takes = self.kernel is not None or query.dtype in FLASH_DTYPES
        if dropout or not takes or kernel is None or _varlen_failed:
            return self.batched().attend(query, key, value, dropout, scaling)
        # [1, heads, L, dim] -> [L, heads, dim]: the projections' own layout, a view.
        queries, keys, values = (t[0].transpose(0, 1) for t in (query, key, value))
        if self.key_positions is not None:
            keys, values = (t.index_select(0, self.key_positions) for t in (keys, values))
        try:
            attended = varlen_call(kernel, queries, keys, values, self.cu_seq_q,
                                   self.cu_seq_k, self.max_q, self.max_k, scaling)
        except RuntimeError as error:
            if self.kernel is not None:
                raise
            _varlen_failed = True
            log.warning("variable-length attention failed (%s): attending in padded batches "
                        "from now on", error)
            return self.batched().attend(query, key, value, dropout, scaling)
        return attended[None]

    def batched(self) -> BatchedLayout:
        if self._batched is None:
            self._batched = BatchedLayout.build(self.edges, self.continues,
                                                self.cu_seq_q.device)
        return self._batched


#: Set when this PyTorch's varlen kernel failed once: the process then attends in batches.
_varlen_failed = False

#: Devices whose packed forwards attend by variable-length attention (VarlenLayout), where
#: PyTorch has the kernel; `VARLEN_KERNEL` None is that kernel (tests give a reference).
VARLEN_DEVICES = ("cuda",)
VARLEN_KERNEL: Callable | None = None

#: Devices whose packed forwards attend in batches (BatchedLayout) otherwise: where a kernel
#: launch costs more than its work. On a CPU the loop over sequences is faster (no padding).
BATCHED_DEVICES = ("cuda",)


def packed_layout(edges: list[int], continues: list[int] | None,
                  device: torch.device) -> VarlenLayout | BatchedLayout | None:
    """The layout a packed forward on `device` gives its layers, or None (the loop)."""
    if device.type in VARLEN_DEVICES and (VARLEN_KERNEL or installed_kernel()) is not None \
            and not _varlen_failed:
        return VarlenLayout.build(edges, continues, device, VARLEN_KERNEL)
    if device.type in BATCHED_DEVICES:
        return BatchedLayout.build(edges, continues, device)
    return None


AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
# Calls without boundaries get the masks SDPA gets.
ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, sdpa_mask)


def use_packed_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Switches a transformers model to packed SDPA (same results, see the module doc)."""
    model.set_attn_implementation(PACKED_SDPA)
    return model
