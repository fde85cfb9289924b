"""A slot-based key/value cache for continuous batching.

Each running request owns one row ("slot") of a preallocated tensor per layer, so requests of
different lengths decode together without copying caches every step. Rows are kept compact
(requests 0..n-1 occupy rows 0..n-1): when one finishes, the last row moves into its place, so
attention always reads a contiguous view.

The cache is handed to the Hugging Face decoder layers as `past_key_values`: they call
`update(key, value, layer_idx)` and attend over what it returns, so the layer code is exactly
the trainer's.
"""

from __future__ import annotations

import torch
from torch import Tensor


def head_dim(config) -> int:
    """A model config's attention head size: its own `head_dim` where it sets one, else the
    hidden size split over the heads."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def slot_bytes(config, max_length: int, dtype: torch.dtype) -> int:
    """Bytes of one slot of the cache for a model `config`: keys and values of every layer
    for `max_length` positions."""
    return (2 * config.num_hidden_layers * config.num_key_value_heads * max_length
            * head_dim(config) * dtype.itemsize)


def slots_that_fit(wanted: int, budget_bytes: int, per_slot: int) -> int:
    """`wanted` slots, or as many as `budget_bytes` holds; ValueError when not even one."""
    fitting = budget_bytes // per_slot
    if fitting < 1:
        raise ValueError(
            f"rollout.kvCacheMemoryFraction leaves {budget_bytes / 2**20:.0f} MiB for the KV "
            f"cache, less than one request needs ({per_slot / 2**20:.0f} MiB at the job's "
            "sequence length); raise the fraction, or lower rollout.maxNewTokens")
    return min(wanted, fitting)


class SlotKVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        max_length: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        shape = (num_slots, num_kv_heads, max_length, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.max_length = max_length
        self._rows = slice(0, 0)
        self._row_index: Tensor | None = None
        self._positions: Tensor | None = None
        self._prefill_length = 0
        self._read_length = 0

    def prepare(self, rows: slice, positions: Tensor, read_length: int) -> None:
        """Sets where the next forward pass writes (`positions[b, t]` for row `rows.start + b`)
        and how much of each row it attends over (`[:read_length]`). A decode pass writes one
        position per row; a prefill pass writes positions 0..T-1 of every row; an extending
        pass writes T positions of each row from where that row's cached tokens end."""
        self._rows = rows
        self._read_length = read_length
        row_index = torch.arange(rows.start, rows.stop, device=positions.device)
        if positions.shape[1] == 1:
            self._row_index, self._positions = row_index, positions[:, 0]
            self._prefill_length = 0
        elif bool((positions[:, 0] == 0).all()):
            self._row_index = self._positions = None
            self._prefill_length = positions.shape[1]
        else:
            self._row_index, self._positions = row_index[:, None], positions
            self._prefill_length = 0

    def update(self, key: Tensor, value: Tensor, layer_idx: int, *_, **__) -> tuple[Tensor, Tensor]:
        """Called by each attention layer with its new keys/values `[B, kv_heads, T, head_dim]`;
        returns the keys/values to attend over."""
        rows = self._rows
        for cache, new in ((self.keys[layer_idx], key), (self.values[layer_idx], value)):
            if self._row_index is not None:
                # An indexed write, not scatter_: scatter_ on bf16 CPU tensors copies whole rows.
                cache[self._row_index, :, self._positions] = (
                    new[:, :, 0] if self._positions.dim() == 1 else new.transpose(1, 2))
            else:
                cache[rows, :, : self._prefill_length] = new
        view = (rows, slice(None), slice(0, self._read_length))
        return self.keys[layer_idx][view], self.values[layer_idx][view]

    def move(self, source: int, target: int, length: int) -> None:
        """Copies the first `length` positions of row `source` into row `target`."""
        self.copy_prefix(source, slice(target, target + 1), length)

    def copy_prefix(self, source: int, targets: slice, length: int) -> None:
        """Copies the first `length` positions of row `source` into every row of `targets`."""
        for tensors in (self.keys, self.values):
            for layer in tensors:
                layer[targets, :, :length] = layer[source, :, :length]

    # Transformers asks a cache these questions; the engine always passes explicit positions
    # and a full 4-D mask, so the answers only need to be consistent.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._read_length

    @property
    def is_compileable(self) -> bool:
        return False
