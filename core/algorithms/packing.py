"""Padding-free sequence packing and token-balanced micro-batches.

Responses to one prompt vary from a few tokens to thousands. Padding them to a common length
wastes compute on pad tokens, so the trainer concatenates sequences into one row and tells the
attention kernel where each one starts (``cu_seqlens``, as flash-attention's varlen API takes it).
Micro-batches are then formed by token count rather than by sequence count, so each forward pass
has a similar cost and fits in memory.

The responses of a group share their prompt. Packed sharing prefixes, the row holds that prompt
once and each response as a segment that continues it (attending to all of the prompt, then to
itself): a causal model's prompt activations do not depend on what follows, so every
response's log-probs are the same, and the prompt is computed once instead of once per response
(8 responses of 57 tokens to a 64-token prompt: 520 tokens through the model instead of 968).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["PackedBatch", "balance_micro_batches", "balance_shares", "balance_sharing_prefixes",
           "pack_sequences", "pack_sharing_prefixes", "unpack"]

MAX_TOKENS_FIELD = "trainer.microBatchMaxTokens"


@dataclass(frozen=True)
class PackedBatch:
    """Sequences concatenated along one token axis.

    ``input_ids`` and ``position_ids`` are ``[T]``; position ids restart at 0 for every sequence.
    ``cu_seqlens`` is int32 ``[N+1]``: sequence i is ``[cu_seqlens[i], cu_seqlens[i+1])``.
    ``fields`` holds further token-aligned tensors (``[T, ...]``), e.g. logprobs or loss masks.

    ``continues`` (packed sharing prefixes, else None) is int64 ``[N]``: the index of the
    sequence (segment) that segment i continues, or -1. A continuing segment attends to all of
    the one it continues, then to itself causally; its position ids go on from that one's end.
    """

    input_ids: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    fields: dict[str, Tensor] = field(default_factory=dict)
    continues: Tensor | None = None

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


def pack_sharing_prefixes(
    sequences: Sequence[Tensor], prefix_lengths: Sequence[int],
    fields: dict[str, Sequence[Tensor]] | None = None,
) -> PackedBatch:
    """``pack_sequences``, except that sequences starting with the same prefix (their first
    ``prefix_lengths[i]`` tokens, equal tokens) hold one copy of it: the prefix is a segment of
    its own, followed by each of those sequences' rest as a segment that continues it
    (``PackedBatch.continues``). A field's values on a shared prefix are those of the first
    sequence with it (the trainer's are unused there: prompts carry no loss). A prefix of 0
    tokens, one as long as its sequence or one that no other sequence starts with stays in its
    sequence. Segments come in the order of each prefix's first sequence."""
    for index, sequence in enumerate(sequences):
        _sequence_length(index, sequence)
    fields = fields or {}
    groups = _prefix_groups(sequences, prefix_lengths)
    if all(len(group) == 1 for group in groups):
        return pack_sequences(sequences, fields)
    pieces: list[tuple[int, int, int, int]] = []  # (sequence, start, end, continues)
    for group in groups:
        if len(group) == 1:
            pieces.append((group[0], 0, len(sequences[group[0]]), -1))
            continue
        prefix = prefix_lengths[group[0]]
        opened = len(pieces)
        pieces.append((group[0], 0, prefix, -1))
        pieces += [(index, prefix, len(sequences[index]), opened) for index in group]
    lengths = [end - start for _, start, end, _ in pieces]
    offsets = [0 if parent < 0 else lengths[parent] for *_, parent in pieces]
    device = sequences[0].device

    def cut(values: Sequence[Tensor]) -> Tensor:
        return torch.cat([values[index][start:end] for index, start, end, _ in pieces])

    for name, values in fields.items():
        _check_field(name, values, [len(sequence) for sequence in sequences])
    offsets_t = torch.tensor(offsets, dtype=torch.long, device=device)
    lengths_t = torch.tensor(lengths, dtype=torch.long, device=device)
    return PackedBatch(
        input_ids=cut(sequences),
        position_ids=_position_ids(lengths, device) + torch.repeat_interleave(
            offsets_t, lengths_t, output_size=sum(lengths)),
        cu_seqlens=torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32,
                                device=device),
        max_seqlen=max(len(sequence) for sequence in sequences),
        fields={name: cut(values) for name, values in fields.items()},
        continues=torch.tensor([parent for *_, parent in pieces], dtype=torch.long,
                               device=device),
    )


def balance_sharing_prefixes(
    sequences: Sequence[Tensor], prefix_lengths: Sequence[int], max_tokens: int,
) -> list[list[int]]:
    """``balance_micro_batches`` for sequences packed sharing prefixes
    (``pack_sharing_prefixes``): the sequences that share a prefix are kept together, in as few
    micro-batches as their packed size allows (the prefix counted once in each), so the
    prefix is computed as few times as it can be; never more micro-batches than
    ``balance_micro_batches`` makes of the whole sequences."""
    lengths = [_sequence_length(i, sequence) for i, sequence in enumerate(sequences)]
    _check_lengths(lengths, max_tokens)
    units: list[list[int]] = []
    for group in _prefix_groups(sequences, prefix_lengths):
        units += _fill_units(group, lengths, prefix_lengths[group[0]], max_tokens)
    sizes = [_packed_size(unit, lengths, prefix_lengths) for unit in units]
    shared = sorted((sorted(i for unit_index in bin_ for i in units[unit_index])
                     for bin_ in balance_micro_batches(sizes, max_tokens)), key=lambda b: b[0])
    # Kept together, a group's units can fit worse than whole sequences placed one by one:
    # then those, still packed sharing what each micro-batch's sequences share.
    plain = balance_micro_batches(lengths, max_tokens)
    return shared if len(shared) <= len(plain) else plain


def _prefix_groups(sequences: Sequence[Tensor], prefix_lengths: Sequence[int]
                   ) -> list[list[int]]:
    """Indices of the sequences that start with the same (non-empty, shorter than each)
    prefix, together; every other sequence alone. In order of each group's first index."""
    if len(prefix_lengths) != len(sequences):
        raise ValueError(f"{len(prefix_lengths)} prefix lengths for {len(sequences)} sequences")
    groups: dict[object, list[int]] = {}
    for index, (sequence, prefix) in enumerate(zip(sequences, prefix_lengths)):
        if not 0 <= prefix <= len(sequence):
            raise ValueError(f"prefix_lengths[{index}] is {prefix}; sequences[{index}] has "
                             f"{len(sequence)} tokens")
        shared = 0 < prefix < len(sequence)
        groups.setdefault(tuple(sequence[:prefix].tolist()) if shared else index, []).append(index)
    return list(groups.values())


def _fill_units(group: list[int], lengths: list[int], prefix: int, max_tokens: int
                ) -> list[list[int]]:
    """`group` (sequences sharing a `prefix`-token prefix) in units whose packed size (the
    prefix once, then each sequence's rest) is at most max_tokens, largest sequences first."""
    if len(group) == 1:
        return [group]
    units: list[list[int]] = []
    loads: list[int] = []
    for index in sorted(group, key=lambda i: (-lengths[i], i)):
        rest = lengths[index] - prefix
        fit = next((u for u, load in enumerate(loads) if load + rest <= max_tokens), None)
        if fit is None:
            units.append([index])
            loads.append(prefix + rest)
        else:
            units[fit].append(index)
            loads[fit] += rest
    return units


def _packed_size(unit: list[int], lengths: list[int], prefix_lengths: Sequence[int]) -> int:
    if len(unit) == 1:
        return lengths[unit[0]]
    prefix = prefix_lengths[unit[0]]
    return prefix + sum(lengths[i] - prefix for i in unit)


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
    _check_lengths(lengths, max_tokens)
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


def balance_shares(lengths: Sequence[int], shares: int) -> list[list[int]]:
    """Partition sequence indices into exactly ``shares`` shares (one per data-parallel rank)
    with token counts as even as the greedy of `balance_micro_batches` makes them: longest
    first, each into the least-loaded share. There is no budget, so every sequence is placed;
    a share may be empty. Indices are ascending inside each share; shares keep their order."""
    if shares < 1:
        raise ValueError(f"shares must be >= 1, got {shares}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    # The budget is the whole batch, so every placement fits and the result is never None.
    bins = _fill_least_loaded(order, lengths, max(sum(lengths), 1), shares)
    return [sorted(b) for b in bins]


def _check_lengths(lengths: Sequence[int], max_tokens: int) -> None:
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
    _check_field(name, values, lengths)
    if not values:
        return torch.empty(0, device=device)
    return torch.cat(list(values))


def _check_field(name: str, values: Sequence[Tensor], lengths: list[int]) -> None:
    """A field has one token-aligned tensor per sequence."""
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


def _position_ids(lengths: list[int], device: torch.device | None) -> Tensor:
    """0, 1, ..., L_i - 1 for every sequence, computed without a Python loop over tokens."""
    total = sum(lengths)
    lengths_t = torch.tensor(lengths, dtype=torch.long, device=device)
    starts = torch.cumsum(lengths_t, dim=0) - lengths_t
    return torch.arange(total, device=device) - torch.repeat_interleave(
        starts, lengths_t, output_size=total
    )

