"""Padding-free sequence packing and token-balanced micro-batches.

Responses to one prompt vary from a few tokens to thousands. Padding them to a common length
wastes compute on pad tokens, so the trainer concatenates sequences into one row and tells the
attention kernel where each one starts (``cu_seqlens``, as flash-attention's varlen API takes it).
Micro-batches are then formed by token count rather than by sequence count, so each forward pass
has a similar cost and fits in memory.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["PackedBatch", "balance_micro_batches", "pack_sequences", "unpack"]

MAX_TOKENS_FIELD = "trainer.microBatchMaxTokens"


@dataclass(frozen=True)
class PackedBatch:
    """Sequences concatenated along one token axis.

    ``input_ids`` and ``position_ids`` are ``[T]``; position ids restart at 0 for every sequence.
    ``cu_seqlens`` is int32 ``[N+1]``: sequence i is ``[cu_seqlens[i], cu_seqlens[i+1])``.
    ``fields`` holds further token-aligned tensors (``[T, ...]``), e.g. logprobs or loss masks.
    """

    input_ids: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    fields: dict[str, Tensor] = field(default_factory=dict)

    @property
    def num_sequences(self) -> int:
        return self.cu_seqlens.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()


def pack_sequences(
    sequences: Sequence[Tensor], fields: dict[str, Sequence[Tensor]] | None = None
) -> PackedBatch:
    """Concatenate 1-D token sequences (and their token-aligned fields) into a ``PackedBatch``."""
    lengths = [_sequence_length(i, seq) for i, seq in enumerate(sequences)]
    device = sequences[0].device if sequences else None
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
    input_ids = (
        torch.cat(list(sequences)) if sequences else torch.empty(0, dtype=torch.long, device=device)
    )
    packed_fields: dict[str, Tensor] = {}
    for name, values in (fields or {}).items():
        packed_fields[name] = _pack_field(name, values, lengths, device)
    return PackedBatch(
        input_ids=input_ids,
        position_ids=_position_ids(lengths, device),
        cu_seqlens=cu_seqlens,
        max_seqlen=max(lengths, default=0),
        fields=packed_fields,
    )


def unpack(packed_tensor: Tensor, cu_seqlens: Tensor) -> list[Tensor]:
    """Split a packed token-aligned tensor ``[T, ...]`` back into one tensor per sequence."""
    boundaries = [int(b) for b in cu_seqlens.tolist()]
    if not boundaries or boundaries[0] != 0:
        raise ValueError("cu_seqlens must start at 0")
    if packed_tensor.dim() == 0 or packed_tensor.shape[0] != boundaries[-1]:
        raise ValueError(
            f"packed_tensor has {packed_tensor.shape[0] if packed_tensor.dim() else 0} tokens, "
            f"cu_seqlens says {boundaries[-1]}"
        )
    lengths = [end - start for start, end in zip(boundaries, boundaries[1:])]
    if any(length < 0 for length in lengths):
        raise ValueError("cu_seqlens must be non-decreasing")
    return list(torch.split(packed_tensor, lengths))


def balance_micro_batches(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Partition sequence indices into few micro-batches of at most ``max_tokens`` tokens each.

    Fewer micro-batches means fewer forward passes, so k comes first: starting from the lower
    bound k = ceil(total / max_tokens), sequences are placed largest first into the least-loaded
    micro-batch. If one does not fit, first-fit (which packs tighter) is tried with the same k and
    then rebalanced; only if that fails too is k raised by one. Either way the loads end up
    within one sequence length of each other. Indices are ascending inside each micro-batch and
    micro-batches are ordered by their first index, so the result is deterministic.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    for index, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"sequence {index} has negative length {length}")
        if length > max_tokens:
            raise ValueError(
                f"sequence {index} has {length} tokens, more than the micro-batch budget of "
                f"{max_tokens}; raise {MAX_TOKENS_FIELD} to at least {length}"
            )
    if not lengths:
        return []
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    k = max(1, -(-sum(lengths) // max_tokens))  # integer ceil(total / max_tokens)
    while True:
        bins = _fill_least_loaded(order, lengths, max_tokens, k)
        if bins is None:
            bins = _fill_first_fit(order, lengths, max_tokens, k)
            if bins is not None:
                _rebalance(bins, lengths)
        if bins is not None:
            return sorted((sorted(b) for b in bins if b), key=lambda b: b[0])
        k += 1  # terminates: with k = len(lengths) every sequence gets a micro-batch of its own


def _fill_least_loaded(
    order: list[int], lengths: Sequence[int], max_tokens: int, k: int
) -> list[list[int]] | None:
    """Greedy placement into k bins, or None if a sequence fits nowhere.

    The least-loaded bin is the only candidate: if it cannot take the sequence, none can. Ties
    go to the bin with fewer sequences, so no bin stays empty while another holds zero-length ones.
    """
    heap = [(0, 0, b) for b in range(k)]  # (tokens, sequences, bin index)
    bins: list[list[int]] = [[] for _ in range(k)]
    for index in order:
        load, count, b = heapq.heappop(heap)
        if load + lengths[index] > max_tokens:
            return None
        bins[b].append(index)
        heapq.heappush(heap, (load + lengths[index], count + 1, b))
    return bins


def _fill_first_fit(
    order: list[int], lengths: Sequence[int], max_tokens: int, k: int
) -> list[list[int]] | None:
    """First-fit decreasing into k bins, or None if a sequence fits nowhere."""
    loads = [0] * k
    bins: list[list[int]] = [[] for _ in range(k)]
    for index in order:
        b = next((b for b in range(k) if loads[b] + lengths[index] <= max_tokens), None)
        if b is None:
            return None
        loads[b] += lengths[index]
        bins[b].append(index)
    return bins


def _rebalance(bins: list[list[int]], lengths: Sequence[int]) -> None:
    """Move sequences from the fullest to the emptiest bin while that narrows the gap.

    A move of x tokens with 0 < x < gap keeps both bins under the budget and strictly lowers the
    sum of squared loads, so this ends; when it does, every sequence in the fullest bin is at
    least the gap long, so max load - min load <= the longest sequence.
    """
    loads = [sum(lengths[i] for i in b) for b in bins]
    while True:
        full = max(range(len(bins)), key=loads.__getitem__)
        empty = min(range(len(bins)), key=loads.__getitem__)
        gap = loads[full] - loads[empty]
        movable = [i for i in bins[full] if 0 < lengths[i] < gap]
        if not movable:
            return
        # The move closest to half the gap narrows it most.
        index = min(movable, key=lambda i: (abs(gap - 2 * lengths[i]), i))
        bins[full].remove(index)
        bins[empty].append(index)
        loads[full] -= lengths[index]
        loads[empty] += lengths[index]


def _sequence_length(index: int, sequence: Tensor) -> int:
    if sequence.dim() != 1:
        raise ValueError(
            f"sequences[{index}] must be 1-D token ids, got shape {tuple(sequence.shape)}"
        )
    return sequence.shape[0]


def _pack_field(
    name: str, values: Sequence[Tensor], lengths: list[int], device: torch.device | None
) -> Tensor:
    if len(values) != len(lengths):
        raise ValueError(
            f"fields[{name!r}] has {len(values)} tensors for {len(lengths)} sequences"
        )
    for i, (value, length) in enumerate(zip(values, lengths)):
        if value.dim() == 0 or value.shape[0] != length:
            got = value.shape[0] if value.dim() else "a scalar"
            raise ValueError(
                f"fields[{name!r}][{i}] has {got} tokens, sequences[{i}] has {length}"
            )
    if not values:
        return torch.empty(0, device=device)
    return torch.cat(list(values))


def _position_ids(lengths: list[int], device: torch.device | None) -> Tensor:
    """0, 1, ..., L_i - 1 for every sequence, computed without a Python loop over tokens."""
    total = sum(lengths)
    lengths_t = torch.tensor(lengths, dtype=torch.long, device=device)
    starts = torch.cumsum(lengths_t, dim=0) - lengths_t
    return torch.arange(total, device=device) - torch.repeat_interleave(
        starts, lengths_t, output_size=total
    )

