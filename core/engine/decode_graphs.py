"""Decode steps replayed as CUDA graphs.

On a GPU a decode step of a small model is a few hundred small kernels, each costing more
to launch from Python than to run: measured on an H200, 76 ms of host time for 0.23 ms of
reading the weights. A CUDA graph records the step's kernels once and replays them with one
launch. A graph replays fixed shapes from fixed memory, so:

- the step reads its inputs (each row's token and position) from static buffers, written by
  one host-to-device copy per step;
- the batch is padded to a *batch bucket* (1, 2, 4, then multiples of 8, 32 and 64), one
  graph per bucket. Padding rows feed token 0 at position 0 of cache rows no request holds (running
  requests hold rows 0..n-1, and a bucket never passes the cache's slots), and their logits
  are dropped;
- attention reads a *length bucket* of every row (powers of two, up to the cache's length)
  with the mask built inside the graph from the positions, so the graph does not depend on
  how long the rows are today.

A graph is captured the first time its (batch, length) bucket is needed, with the step's
real inputs: capture only records, so the step is then replayed on those same inputs, and
what the warm-up runs before capture wrote into the cache (each row's key and value at its
own position) is written again with the same values. Graphs share one memory pool and one
logits buffer; the engine replays one at a time and reads its logits before the next replay,
which is what sharing them requires.

`DecodeGraphs(..., capture=False)` runs the same padded, bucketed step without graphs: the
bookkeeping above is then testable on a CPU (the engine itself decodes unpadded there).
"""

from __future__ import annotations

import bisect
import time
from typing import Callable

import torch
from torch import Tensor

from asyncrl.engine.kv_cache import SlotKVCache

#: Attention reads at least this many positions of each row (the smallest length bucket).
MIN_READ_LENGTH = 128


def batch_buckets(slots: int) -> list[int]:
    """The batch sizes graphs are captured for, up to (and always including) `slots`: 1, 2,
    4, then multiples of 8 to 64, of 32 to 256 and of 64 beyond, so that padding costs a
    small batch little and a large one (whose step time grows with it) at most a quarter."""
    sizes = [1, 2, 4] + list(range(8, 64, 8)) + list(range(64, 256, 32))
    sizes += list(range(256, slots, 64))
    return [size for size in sizes if size < slots] + [slots]


def length_buckets(max_length: int) -> list[int]:
    """The attention lengths graphs are captured for: powers of two from MIN_READ_LENGTH,
    up to (and always including) `max_length`."""
    sizes = []
    size = MIN_READ_LENGTH
    while size < max_length:
        sizes.append(size)
        size *= 2
    return sizes + [max_length]


def bucket(value: int, buckets: list[int]) -> int:
    """The smallest of the sorted `buckets` that holds `value`."""
    index = bisect.bisect_left(buckets, value)
    if index == len(buckets):
        raise ValueError(f"{value} is larger than the largest bucket, {buckets[-1]}")
    return buckets[index]


#: step(ids [b, 1], positions [b, 1], cache, read_length, mask [b, 1, 1, read_length])
#: -> logits [b, vocab]: FusedDecoder.logits.
DecodeStep = Callable[[Tensor, Tensor, SlotKVCache, int, Tensor], Tensor]


class DecodeGraphs:
    """Logits of one decode step for the first n cache rows, padded and bucketed, replayed
    from CUDA graphs (`capture=True`, a CUDA device) or run eagerly the same way."""

    def __init__(self, step: DecodeStep, cache: SlotKVCache, device: torch.device,
                 capture: bool = True):
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self._step = step
        self._cache = cache
        self._device = device
        self._capture = capture
        self._batches = batch_buckets(cache.num_slots)
        self._lengths = length_buckets(cache.max_length)
        slots = cache.num_slots
        # The step's inputs: tokens in row 0, positions in row 1, staged on the host (pinned
        # on a GPU, so the copy is asynchronous) and copied in one transfer.
        self._inputs = torch.zeros(2, slots, dtype=torch.long, device=device)
        self._staging = torch.zeros(2, slots, dtype=torch.long,
                                    pin_memory=device.type == "cuda")
        self._span = torch.arange(cache.max_length, device=device)
        self._staged = None  # on a GPU, the event after the last copy from staging
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        # Every graph leaves its logits here ([slots, vocab], made at the first capture), so
        # graphs keep one output buffer between them, not one each.
        self._logits: Tensor | None = None
        self.capture_seconds = 0.0

    @property
    def captured(self) -> list[tuple[int, int]]:
        """The (batch, length) buckets captured so far."""
        return sorted(self._graphs)

    def logits(self, tokens: list[int] | Tensor, positions: list[int]) -> Tensor:
        """Logits [n, vocab] of `tokens[i]` at `positions[i]` in cache row i, each row
        attending to its positions up to that one. `tokens` may be on the device already (an
        overlapped step's, which the host has not read). The result is only valid until the
        next call (it is the graphs' output buffer)."""
        n = len(positions)
        rows = bucket(n, self._batches)
        length = bucket(max(positions) + 1, self._lengths)
        if self._staged is not None:
            # The previous step's copy may still be queued behind the step before it: the
            # staging buffer is rewritten only once that copy has read it.
            self._staged.synchronize()
        # Padding rows: token 0 at position 0 (the staging buffer's rows past n are zeros).
        on_device = isinstance(tokens, Tensor)
        if on_device:
            self._staging[1, :n] = torch.tensor(positions, dtype=torch.long)
        else:
            self._staging[:, :n] = torch.tensor([tokens, positions], dtype=torch.long)
        self._staging[:, n:rows] = 0
        self._inputs.copy_(self._staging, non_blocking=True)
        if on_device:
            self._inputs[0, :n].copy_(tokens)
        if self._device.type == "cuda":
            self._staged = torch.cuda.Event()
            self._staged.record()
        if not self._capture:
            return self._run(rows, length)[:n]
        if (rows, length) not in self._graphs:
            self._graphs[rows, length] = self._record(rows, length)
        self._graphs[rows, length].replay()
        return self._logits[:n]

    def _run(self, rows: int, length: int) -> Tensor:
        ids = self._inputs[0, :rows, None]
        positions = self._inputs[1, :rows, None]
        mask = (self._span[None, :length] <= positions)[:, None, None, :]
        return self._step(ids, positions, self._cache, length, mask)

    def _record(self, rows: int, length: int) -> torch.cuda.CUDAGraph:
        started = time.perf_counter()
        # Warm-up on a side stream, as capture requires (lazy initialisations, cuBLAS
        # workspaces); it computes this step for real, which capture then records.
        side = torch.cuda.Stream(self._device)
        side.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(side):
            warm = self._run(rows, length)
        torch.cuda.current_stream(self._device).wait_stream(side)
        if self._logits is None:
            self._logits = torch.empty(self._cache.num_slots, warm.shape[-1], dtype=warm.dtype,
                                       device=self._device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the worker's other threads (weight transfers) may call CUDA meanwhile.
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._logits[:rows].copy_(self._run(rows, length))
        self._pool = graph.pool()
        self.capture_seconds += time.perf_counter() - started
        return graph
