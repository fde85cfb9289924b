"""The torch rollout engine: continuous batching over a slot KV cache, interruptible by
weight updates.

One background thread runs the loop: admit waiting requests (prefill each into a free slot),
then one decode step for every running request, each with its own sampling settings. Requests
join and leave at every step. Every generated token records its log-probability and the policy
version that produced it.

A weight update happens between two steps: the new weights are copied in, the KV cache is
dropped, and every unfinished request is prefilled again from prompt + tokens so far under the
new weights, then continues. Nothing is lost or duplicated.

All tensor work runs on the loop's thread, weight copies and aborts included (other threads
hand them over with `_on_loop`): on a CPU a second thread running parallel kernels would give
the process a second OpenMP pool, and slow every small kernel (see asyncrl.platform.openmp).

On a GPU the host must not be what a step waits for: decode steps replay CUDA graphs
(asyncrl.engine.decode_graphs), attention avoids cuDNN's kernels (which build a plan for each
new shape, milliseconds of host time a call), sampling settings are known on the host
(sampling.BatchShape), and a step reads its results back in one copy.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from asyncrl.platform.core_lending import CoreLending
from asyncrl.platform.devices import use_planless_attention
from asyncrl.platform.openmp import release_idle_thread_pools
from asyncrl.engine.decode_graphs import DecodeGraphs
from asyncrl.engine.fused_decode import FusedDecoder
from asyncrl.model.lora import AdapterError, MergedAdapter
from asyncrl.engine.kv_cache import SlotKVCache, head_dim
from asyncrl.engine.sampling import (
    BatchShape,
    apply_penalties,
    sample_tokens,
    seeded_uniforms,
)
from asyncrl.engine.types import (
    EngineStatus,
    GenerationResult,
    RequestError,
    SamplingParams,
    WeightUpdate,
)
from asyncrl.weights.disk import SnapshotError, check_snapshot, read_snapshot
from asyncrl.weights.distributed import TensorMeta, broadcast

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Request:
    result: GenerationResult
    params: SamplingParams
    stop_ids: frozenset[int]
    future: Future = field(default_factory=Future)
    cached: int = 0  # tokens whose keys/values are in the cache
    pending: int | None = None  # sampled token not yet fed to the model
    # With a frequency or presence penalty: how often each token occurs in the output so far
    # ([vocab], float32, on the engine's device), kept up to date by _append.
    counts: Tensor | None = None

    @property
    def tokens(self) -> list[int]:
        return self.result.prompt_ids + self.result.output_ids


@dataclass(eq=False)
class _Step:
    """A launched decode step: its requests in row order at launch, the buffer its tokens
    and log-probs are copied back into, and (on a GPU) the event recorded after that copy."""

    requests: list[_Request]
    readback: Tensor  # [2, slots] float64: tokens, log-probs
    done: Any = None  # torch.cuda.Event


@contextlib.contextmanager
def _refused():
    """A snapshot the engine cannot take is a request it refuses (RequestError, HTTP 400),
    with asyncrl.weights.disk's message."""
    try:
        yield
    except (SnapshotError, AdapterError) as exc:
        raise RequestError(str(exc)) from exc


#: The most (padded) tokens one prefill forward pass takes: admitted requests prefill
#: together up to this, so a burst of short prompts costs a few passes, not one each.
PREFILL_MAX_TOKENS = 8192
#: How long the loop has nothing to do before it lends its threads (`lending`).
LEND_AFTER_IDLE_SECONDS = 0.05
#: The fewest leading tokens that distinct prompts prefilled together must share (a chat
#: template's system turn) for one row to compute them once and the others to copy its cache:
#: below this the extra forward pass costs more than the tokens it saves.
SHARED_PREFIX_MIN_TOKENS = 16


def _shared_prefix_length(prompts: list[list[int]]) -> int:
    """How many leading tokens every prompt shares, when at least SHARED_PREFIX_MIN_TOKENS
    and two prompts or more, else 0; never a whole prompt, whose last token must go through
    the model in its own row for its logits."""
    if len(prompts) < 2:
        return 0
    shortest = min(len(prompt) for prompt in prompts) - 1
    length = 0
    while length < shortest and all(p[length] == prompts[0][length] for p in prompts):
        length += 1
    return length if length >= SHARED_PREFIX_MIN_TOKENS else 0


def _prefill_batches(running: list[_Request], max_tokens: int) -> list[slice]:
    """Runs of consecutive rows whose requests need a prefill (nothing cached), each cut
    where its padded size (rows x longest sequence) would pass `max_tokens`."""
    batches: list[slice] = []
    start, longest = None, 0
    for row, request in enumerate(running + [None]):
        needs = request is not None and request.cached == 0
        length = len(request.tokens) if needs else 0
        if start is not None and (
            not needs or (row - start + 1) * max(longest, length) > max_tokens
        ):
            batches.append(slice(start, row))
            start, longest = None, 0
        if needs:
            start = row if start is None else start
            longest = max(longest, length)
    return batches


def _extend_runs(rows: list[tuple[int, int]]) -> list[slice]:
    """Runs of consecutive rows to extend together, from (row, tokens to cache) in row order:
    a run ends where the rows stop being consecutive, where a row is longer than the run's
    first, or where it is under half of it, so a run padded to its longest is at most about
    twice its tokens."""
    runs: list[slice] = []
    start = longest = previous = None
    for row, length in rows:
        if start is None or row != previous + 1 or not longest / 2 <= length <= longest:
            if start is not None:
                runs.append(slice(start, previous + 1))
            start, longest = row, length
        previous = row
    if start is not None:
        runs.append(slice(start, previous + 1))
    return runs


class TorchEngine:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        max_running_requests: int = 32,
        max_sequence_length: int = 1024,
        eos_token_ids: tuple[int, ...] = (),
        version: int = 0,
        seed: int | None = None,
        fused_decode: bool = True,
        cuda_graphs: bool | None = None,
        overlap: bool | None = None,
        lora=None,
        lending: CoreLending | None = None,
    ):
        """`lending`: cores shared with another process (asyncrl.platform.core_lending): the
        loop lends this process's threads while it has nothing to do and computes each step
        with its own and those lent to it. `lora`: the job's model.lora section, when versions
        are a LoRA adapter's tensors (asyncrl.model.lora.MergedAdapter applies them); None:
        every version is the whole model's. `overlap`: launch each decode step before the
        previous one's tokens are read back (None: on a GPU, where the device then works while
        the host reads and prepares; see _decode_overlapped)."""
        config = model.config
        self._model = model.eval().requires_grad_(False)
        self._adapter = MergedAdapter(self._model, lora) if lora is not None else None
        parameter = next(model.parameters())
        self._device = parameter.device
        if self._device.type == "cuda":
            # Also where no service chose the device (select_device does it too): a bench's
            # or a test's engine.
            use_planless_attention()
        self._cache = SlotKVCache(
            num_layers=config.num_hidden_layers,
            num_slots=max_running_requests,
            num_kv_heads=config.num_key_value_heads,
            max_length=max_sequence_length,
            head_dim=head_dim(config),
            dtype=parameter.dtype,
            device=self._device,
        )
        # transformers 5.24 renamed the decoder's `past_key_values` to `cache` (the old name
        # warns, and goes in 5.40); the project allows 5.x, so the model's own name is used.
        forward = inspect.signature(type(model.model).forward).parameters
        self._cache_keyword = "cache" if "cache" in forward else "past_key_values"
        self._eos = frozenset(eos_token_ids)
        # Decode steps through fused projections where the architecture allows (fused_decode.py;
        # the model's weights stay where they are, as views): prefill keeps the model's layers.
        self._fused = FusedDecoder.for_model(self._model) if fused_decode else None
        # On a GPU, fused decode steps replay CUDA graphs (None: wherever they can).
        if cuda_graphs and (self._device.type != "cuda" or self._fused is None):
            raise ValueError("cuda_graphs needs a CUDA device and fused decode steps (a Llama-"
                             f"family model); this engine has {self._device} and "
                             f"{'fused' if self._fused else 'the model own'} decode steps")
        if cuda_graphs is None:
            cuda_graphs = self._device.type == "cuda" and self._fused is not None
        self._graphs = DecodeGraphs(self._fused.logits, self._cache, self._device) \
            if cuda_graphs else None
        log.info("decode steps run %s%s", "fused Llama-family layers" if self._fused
                 else "the model's own layers", " as CUDA graphs" if self._graphs else "")
        self._overlap = self._device.type == "cuda" if overlap is None else overlap
        slots = max_running_requests
        # Each row's newest sampled token, on the device: an overlapped step reads its input
        # here before the host has seen it.
        self._tokens = torch.zeros(slots, dtype=torch.long, device=self._device)
        # Two read-back buffers (tokens and log-probs of a step), so that a step's copy never
        # overwrites the one the host is reading; pinned on a GPU, so the copy is asynchronous.
        self._readback = [torch.zeros(2, slots, dtype=torch.float64,
                                      pin_memory=self._device.type == "cuda")
                          for _ in range(2)]
        self._readback_turn = 0
        self._version = version
        self._lending = lending
        self._lent = False  # this engine's threads are lent now
        self._generator = torch.Generator(device=self._device)
        self._generator.manual_seed(seed if seed is not None else torch.seed())

        # _wake guards the queues and flags; _step_lock is held while the model runs and while
        # a handed-over call (`_on_loop`) runs, so a weight update lands between two steps.
        self._wake = threading.Condition()
        self._step_lock = threading.Lock()
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._loop_done = False
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []  # request i lives in cache row i
        self._requests: dict[str, _Request] = {}
        self._paused = False
        self._weights_incomplete = False
        self._idle = True
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._generated_total = 0
        self._interrupted_total = 0
        self._decode_steps = 0
        self._decode_rows = 0
        self._busy_seconds = 0.0
        self._swap_seconds = 0.0
        self._resume_prefill_seconds = 0.0

    # ------------------------------------------------------------------ public API

    @property
    def version(self) -> int:
        return self._version

    @property
    def has_adapter(self) -> bool:
        """Whether versions are a LoRA adapter's tensors (model.lora), merged as they come."""
        return self._adapter is not None

    @property
    def fused_decode(self) -> bool:
        """Whether decode steps run fused projections (FusedDecoder)."""
        return self._fused is not None

    @property
    def cuda_graphs(self) -> DecodeGraphs | None:
        """The decode steps' CUDA graphs (captured per batch and length bucket), if used."""
        return self._graphs

    @property
    def vocab_size(self) -> int:
        return self._model.config.vocab_size

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> TorchEngine:
        """Starts the loop's thread. Call it from the thread that loaded the model: that
        thread's idle OpenMP workers are let go here, so the loop's are the only ones."""
        release_idle_thread_pools()
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="torch-engine", daemon=True)
            self._thread.start()
        return self

    def run_until_idle(self) -> None:
        """Serves every submitted request to its end in the calling thread, for an engine
        whose loop thread is not started: an evaluator that shares its process's one compute
        thread (see asyncrl.platform.openmp) rather than adding a thread of its own."""
        if self._thread is not None:
            raise RuntimeError("this engine's loop runs on its own thread; wait on the futures")
        with torch.no_grad():
            while self._waiting or self._running:
                if self._lending is not None:
                    self._lending.fit()
                with self._step_lock:
                    try:
                        self._step()
                    except Exception as exc:
                        self._fail_all(exc)
                        raise

    def stop(self) -> None:
        with self._wake:
            self._stopping = True
            self._wake.notify_all()
        if self._thread is not None:
            self._thread.join()
        if self._lent:  # a stopped engine lends nothing
            self._lending.reclaim()
            self._lent = False
        self.abort()

    def submit(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None
    ) -> Future:
        """Queues a request; its future resolves to a GenerationResult. Bad input raises
        RequestError here, before anything is queued."""
        params.check()
        prompt_ids = self._check_prompt(prompt_ids, params)
        request_id = request_id or uuid.uuid4().hex
        # ignore_eos turns off every token stop, as in SGLang (Req._check_token_based_finish
        # returns early): neither the EOS tokens nor stop_token_ids end the request.
        stop_ids = frozenset()
        if not params.ignore_eos:
            stop_ids = frozenset(params.stop_token_ids) | self._eos
        request = _Request(GenerationResult(request_id, prompt_ids), params, stop_ids)
        with self._wake:
            if request_id in self._requests:
                raise RequestError(f"rid {request_id!r} is already running; use a unique rid")
            self._requests[request_id] = request
            if params.max_new_tokens == 0:
                self._finish(request, "length")
            else:
                self._waiting.append(request)
                self._wake.notify_all()
        return request.future

    def pause(self) -> None:
        """Stops decoding at the next step boundary; returns once the engine is there."""
        with self._wake:
            self._paused = True
            self._wake.notify_all()
            while not self._idle and self.alive:
                self._wake.wait()

    def resume(self) -> None:
        with self._wake:
            self._paused = False
            self._wake.notify_all()

    def abort(self, request_ids: list[str] | None = None) -> list[str]:
        """Ends the named requests (all when None) with finish reason "abort" and the tokens
        generated so far. Unknown ids are ignored; the ids actually aborted are returned."""

        def abort() -> list[str]:
            with self._wake:
                chosen = [
                    r for r in list(self._waiting) + self._running
                    if request_ids is None or r.result.request_id in request_ids
                ]
                for request in chosen:
                    if request in self._waiting:
                        self._waiting.remove(request)
                    else:
                        self._release_row(self._running.index(request))
                    self._finish(request, "abort")
                return [r.result.request_id for r in chosen]

        return self._on_loop(abort)

    def update_weights(self, path: str | Path, version: int) -> WeightUpdate:
        """Loads a safetensors snapshot (a file; a directory with a sharded Hugging Face
        checkpoint, model.safetensors or *.safetensors files; read and checked by
        asyncrl.weights.disk) as policy `version`. On any error the engine keeps serving with
        its current weights."""
        started = time.perf_counter()
        self._check_version(version)
        path = Path(path)
        with _refused():
            state = read_snapshot(path, self._device)
        return self._swap_weights(self._check_tensors(state, f"snapshot {str(path)!r}"),
                                  version, started)

    def update_weights_from_state_dict(self, state: dict[str, Tensor], version: int) -> WeightUpdate:
        started = time.perf_counter()
        self._check_version(version)
        return self._swap_weights(self._check_tensors(state, f"state dict for version {version}"),
                                  version, started)

    def update_weights_from_distributed(
        self, group, tensors: list[TensorMeta], version: int | None,
    ) -> WeightUpdate:
        """Receives `tensors` (the transfer's manifest, or one part of it) broadcast by rank 0
        of `group` (asyncrl.weights.distributed) straight into the weights, then serves policy
        `version` (None: more parts follow; the caller keeps generation paused meanwhile)."""
        started = time.perf_counter()
        if version is not None:
            self._check_version(version)
        if self._adapter is not None:
            with _refused():
                self._adapter.check({m.name: torch.empty(m.shape, device="meta")
                                     for m in tensors}, "weight transfer", complete=False)

            def receive_adapter(current: dict[str, Tensor]) -> None:
                received = {}
                for meta in tensors:
                    received[meta.name] = torch.empty(meta.shape, dtype=meta.dtype,
                                                      device=self._device)
                    broadcast(group, received[meta.name])
                self._adapter.write(current, received)

            return self._on_loop(lambda: self._install(receive_adapter, version, started))
        current = self._model.state_dict()
        for meta in tensors:
            if meta.name not in current or tuple(current[meta.name].shape) != meta.shape:
                shape = tuple(current[meta.name].shape) if meta.name in current else None
                raise RequestError(
                    f"weight transfer: {meta.name!r} {meta.shape} does not match the model "
                    f"({'no such tensor' if shape is None else shape})")

        def receive(current: dict[str, Tensor]) -> None:
            for meta in tensors:
                target = current[meta.name]
                if target.dtype == meta.dtype and target.is_contiguous():
                    broadcast(group, target)  # in place: no copy at all
                else:
                    incoming = torch.empty(meta.shape, dtype=meta.dtype, device=target.device)
                    broadcast(group, incoming)
                    target.copy_(incoming)

        return self._on_loop(lambda: self._install(receive, version, started))

    def status(self) -> EngineStatus:
        with self._wake:
            return EngineStatus(
                version=self._version,
                paused=self._paused,
                running_requests=len(self._running),
                waiting_requests=len(self._waiting),
                generated_tokens_total=self._generated_total,
                interrupted_requests_total=self._interrupted_total,
                max_running_requests=self._cache.num_slots,
                max_sequence_length=self._cache.max_length,
                stale_requests=sum(
                    1 for r in self._running
                    if r.result.output_versions and r.result.output_versions[-1] < self._version
                ),
                decode_steps_total=self._decode_steps,
                decode_rows_total=self._decode_rows,
                busy_seconds_total=self._busy_seconds,
                weight_swap_seconds_total=self._swap_seconds,
                resume_prefill_seconds_total=self._resume_prefill_seconds,
            )

    # ------------------------------------------------------------------ input checks

    def _check_prompt(self, prompt_ids, params: SamplingParams) -> list[int]:
        if not isinstance(prompt_ids, (list, tuple)) or not prompt_ids:
            raise RequestError("input_ids must be a non-empty list of token ids")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_ids):
            raise RequestError("input_ids must contain only integers")
        bad = next((t for t in prompt_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise RequestError(
                f"input_ids contains token id {bad}, outside the vocabulary [0, {self.vocab_size})"
            )
        if len(prompt_ids) + params.max_new_tokens > self._cache.max_length:
            raise RequestError(
                f"input_ids ({len(prompt_ids)} tokens) + sampling_params.max_new_tokens "
                f"({params.max_new_tokens}) exceeds the engine's max sequence length "
                f"{self._cache.max_length}; shorten the prompt or lower max_new_tokens"
            )
        return list(prompt_ids)

    def _check_version(self, version: int) -> None:
        if version < self._version:
            raise RequestError(
                f"weight version {version} is older than the serving version {self._version}; "
                "versions only move forward"
            )

    def _check_tensors(self, state: dict[str, Tensor], what: str) -> dict[str, Tensor]:
        """Every parameter must be present (tied weights may appear once) with its shape;
        with an adapter, every adapter tensor."""
        with _refused():
            if self._adapter is not None:
                return self._adapter.check(state, what)
            return check_snapshot(state, self._model.state_dict(), what)

    def _swap_weights(self, state: dict[str, Tensor], version: int, started: float) -> WeightUpdate:
        return self._on_loop(lambda: self._swap_now(state, version, started))

    def _swap_now(self, state: dict[str, Tensor], version: int, started: float) -> WeightUpdate:
        def copy_in(current: dict[str, Tensor]) -> None:
            if self._adapter is not None:
                self._adapter.write(current, state)
                return
            for name, tensor in state.items():
                current[name].copy_(tensor)

        return self._install(copy_in, version, started)

    def _install(self, write: Callable[[dict[str, Tensor]], None], version: int | None,
                 started: float) -> WeightUpdate:
        """`write(state dict)` puts new weights in place; then policy `version` is served
        (None: a part of an update whose last part names the version). If `write` fails part
        way, the weights are a mix of two versions: nothing is generated until a whole update
        lands."""
        current = self._model.state_dict()
        swap_started = time.perf_counter()
        if version is not None:
            self._check_version(version)
        self._weights_incomplete = True
        with torch.no_grad():
            write(current)
        if version is None:
            self._swap_seconds += time.perf_counter() - swap_started
            return WeightUpdate(self._version, 0, time.perf_counter() - started)
        with self._wake:
            self._weights_incomplete = False
            self._version = version
            # The cache holds keys/values of the old weights: drop it, and let every
            # unfinished request prefill prompt + tokens so far under the new ones.
            for request in self._running:
                request.cached = 0
                request.result.interruptions += 1
            self._interrupted_total += len(self._running)
            interrupted = len(self._running)
            self._swap_seconds += time.perf_counter() - swap_started
        return WeightUpdate(version, interrupted, time.perf_counter() - started)

    # ------------------------------------------------------------------ the loop

    def _on_loop(self, work: Callable[[], Any]) -> Any:
        """`work()`, run on the loop's thread between two steps (inline when no loop runs),
        and its result or exception."""
        with self._wake:
            inline = (self._thread is None or self._loop_done
                      or threading.current_thread() is self._thread)
            if not inline:
                future: Future = Future()
                self._calls.append((work, future))
                self._wake.notify_all()
        if inline:
            with self._step_lock:
                return work()
        return future.result()

    def _run_calls(self) -> None:
        while True:
            with self._wake:
                if not self._calls:
                    return
                work, future = self._calls.popleft()
            with self._step_lock:
                try:
                    future.set_result(work())
                except BaseException as exc:  # the caller re-raises it
                    future.set_exception(exc)

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            self._run_calls()
            with self._wake:
                while not self._stopping and not self._calls and (
                    self._paused or self._weights_incomplete
                    or not (self._waiting or self._running)
                ):
                    self._idle = True
                    self._wake.notify_all()
                    if self._lending is not None and not self._lent:
                        # Lent once idle for a moment, not in every gap between two groups:
                        # each change of thread count costs both processes a little.
                        if self._wake.wait(LEND_AFTER_IDLE_SECONDS):
                            continue  # woken: look again
                        self._lending.lend()
                        self._lent = True
                    self._wake.wait()
                if self._calls:
                    continue
                if self._stopping:
                    self._loop_done = True
                    self._idle = True
                    self._wake.notify_all()
                    break
                if self._lent:
                    self._lending.reclaim()
                    self._lent = False
                self._idle = False
            if self._lending is not None:
                self._lending.fit()
            with self._step_lock:
                started = time.perf_counter()
                try:
                    self._step()
                except Exception as exc:  # a bug must fail the requests, not hang them
                    self._fail_all(exc)
                self._busy_seconds += time.perf_counter() - started
        self._run_calls()  # handed over before the loop knew it was stopping

    def _step(self) -> None:
        with self._wake:
            while self._waiting and len(self._running) < self._cache.num_slots:
                request = self._waiting.popleft()
                if request.params.penalized and request.counts is None:
                    request.counts = torch.zeros(self.vocab_size, device=self._device)
                self._running.append(request)
        for rows in _prefill_batches(self._running, PREFILL_MAX_TOKENS):
            self._prefill(rows)
        self._finish_done()
        if self._running:
            if self._overlap and self._may_overlap():
                self._decode_overlapped()
            else:
                self._complete(self._launch_decode(from_device=False))

    def _prefill(self, rows: slice) -> None:
        """Fills the cache rows of the requests in `rows` from their tokens. A fresh request
        samples its first token here; a resumed one (after a weight update) keeps its last
        sampled token pending for the next decode.

        Requests with the same prompt (the n responses to one prompt) share one forward row
        for it: the rows are ordered distinct prompts first, only those go through the model
        (one pass, right-padded to the longest), the others get a copy of their twin's cache
        row and, if fresh, sample from the same logits. The resumed requests' generated tokens
        then go through the model, each row continuing its prompt's cache, rows of about one
        length in one pass (`_extend`). Distinct prompts that begin alike (a chat template's
        system turn) compute those tokens once, in one row (`_prefill_shared_prefix`)."""
        started = time.perf_counter()
        entries = []  # (request, its prompt, its generated tokens to cache after the prompt)
        for request in self._running[rows]:
            generated = request.result.output_ids
            if generated:  # resumed after a weight update
                request.pending = generated[-1]
            entries.append((request, request.result.prompt_ids, generated[:-1]))
        seen: set[tuple[int, ...]] = set()  # the prompts a row computes
        distinct, copies = [], []
        for index, (_, prompt, _) in enumerate(entries):
            (copies if tuple(prompt) in seen else distinct).append(index)
            seen.add(tuple(prompt))

        def resumed(index: int) -> bool:
            return bool(entries[index][0].result.output_ids)

        def longest_first(index: int) -> int:
            return -len(entries[index][2])

        # The resumed rows in one run (computed fresh, computed resumed, copied resumed, copied
        # fresh), longest first within each part, so that `_extend` pads little.
        distinct.sort(key=lambda index: (resumed(index), longest_first(index)))
        copies.sort(key=lambda index: (not resumed(index), longest_first(index)))
        order = distinct + copies
        self._running[rows] = [entries[index][0] for index in order]
        computed = slice(rows.start, rows.start + len(distinct))
        row_of = {tuple(entries[index][1]): offset for offset, index in enumerate(distinct)}

        prompts = [entries[index][1] for index in distinct]
        shared = _shared_prefix_length(prompts)
        if shared:
            self._prefill_shared_prefix(prompts[0][:shared], computed)
        logits = self._prefill_prompts(prompts, computed, cached=shared)
        for row, index in enumerate(copies, start=computed.stop):
            prompt = entries[index][1]
            self._cache.move(rows.start + row_of[tuple(prompt)], row, len(prompt))
        extending = [(row, len(entries[index][2]))
                     for row, index in enumerate(order, start=rows.start) if entries[index][2]]
        for run in _extend_runs(extending):
            self._extend(run)
        for request, prompt, generated in entries:
            request.cached = len(prompt) + len(generated)
        # (request, the row of logits it samples from), fresh requests only
        fresh = [(entries[index][0], row_of[tuple(entries[index][1])])
                 for index in order if not resumed(index)]
        if fresh:
            drawn = self._sample([r for r, _ in fresh], logits[[i for _, i in fresh]])
            for (request, _), (token, logprob) in zip(fresh, drawn):
                self._append(request, token, logprob)
        if len(fresh) < len(entries):
            self._resume_prefill_seconds += time.perf_counter() - started

    def _prefill_shared_prefix(self, prefix: list[int], rows: slice) -> None:
        """Caches `prefix`, the leading tokens of every prompt in `rows`, in the first row (one
        pass of one row) and copies it into the others: a causal model's keys and values of a
        prefix do not depend on what follows it."""
        length = len(prefix)
        span = torch.arange(length, device=self._device)
        mask = (span[None, :] <= span[:, None])[None, None]
        first = slice(rows.start, rows.start + 1)
        self._hidden(torch.tensor([prefix], device=self._device), span[None], first, length, mask)
        self._cache.copy_prefix(rows.start, slice(rows.start + 1, rows.stop), length)

    def _prefill_prompts(self, prompts: list[list[int]], rows: slice, cached: int) -> Tensor:
        """Caches `prompts` in `rows` from position `cached` on (what is before it is cached
        already) in one pass, right-padded to the longest, and returns the logits at each
        prompt's last token."""
        width = max(len(prompt) for prompt in prompts) - cached
        ids = torch.tensor([prompt[cached:] + [0] * (width - len(prompt) + cached)
                            for prompt in prompts], device=self._device)
        lengths = torch.tensor([len(prompt) for prompt in prompts], device=self._device)
        keys = torch.arange(cached + width, device=self._device)
        queries = keys[cached:]
        # Causal, and no row attends to its padding; a padded position attends to real tokens
        # only (never to nothing, which would give NaNs), and its output is never read.
        mask = (keys[None, :] <= queries[:, None])[None] & (keys[None, None, :] < lengths[:, None, None])
        return self._forward(ids, queries[None].expand(len(prompts), -1), rows, cached + width,
                             mask[:, None], last=lengths - cached - 1)

    def _extend(self, rows: slice) -> None:
        """Caches the generated tokens (but the pending last one) of the resumed requests in
        `rows`, whose prompts are cached: one pass, each row's tokens right-padded to the
        longest and placed after its prompt. A padded position writes past its row's tokens
        (at most at the cache's last position, which a request's tokens never reach before
        their pending one), where the next decode steps write before they read."""
        requests = self._running[rows]
        generated = [r.result.output_ids[:-1] for r in requests]
        width = max(len(tokens) for tokens in generated)
        starts = [len(r.result.prompt_ids) for r in requests]
        ids = torch.tensor([tokens + [0] * (width - len(tokens)) for tokens in generated],
                           device=self._device)
        last = self._cache.max_length - 1
        positions = (torch.tensor(starts, device=self._device)[:, None]
                     + torch.arange(width, device=self._device)[None]).clamp_(max=last)
        read_length = min(max(start + width for start in starts), last + 1)
        # A position attends to every cached one up to itself (its prompt included).
        span = torch.arange(read_length, device=self._device)
        mask = span[None, None, :] <= positions[:, :, None]
        self._hidden(ids, positions, rows, read_length, mask[:, None])

    def _may_overlap(self) -> bool:
        """Whether the next decode step may start before this one's tokens are read back:
        only while nothing else is due between two steps (a handed-over call, a pause, a stop,
        a request that could be admitted) and no running request has a penalty (its counts
        need every token on the host first). Read without the lock: a change seen one step
        late costs that step only."""
        return not (self._calls or self._paused or self._stopping or self._weights_incomplete
                    or (self._waiting and len(self._running) < self._cache.num_slots)
                    or any(r.counts is not None for r in self._running))

    def _decode_overlapped(self) -> None:
        """Decode steps, each launched before the previous one's tokens are read back: the
        next step's input tokens are on the device already (`_tokens`), and its positions
        are known, so the host prepares and launches step n + 1 while the device runs step n,
        then reads step n's tokens. A request that stops at step n is in step n + 1 too; its
        token there is dropped (one row-step). Ends, with nothing in flight, when there is
        something else to do (`_may_overlap`) or nothing running."""
        in_flight = self._launch_decode(from_device=False)
        while True:
            following = (self._launch_decode(from_device=True)
                         if self._running and self._may_overlap() else None)
            self._complete(in_flight)
            if following is None:
                return
            in_flight = following

    def _launch_decode(self, from_device: bool) -> _Step:
        """Queues one decode step for every running request: its input tokens are their
        pending ones (`from_device`: the previous step's, on the device), its sampled tokens
        go to `_tokens` and to a read-back buffer. Positions advance here, so a row moved
        while the step is in flight moves what the step writes too."""
        running = list(self._running)
        n = len(running)
        positions = [r.cached for r in running]
        tokens = self._tokens[:n] if from_device else [r.pending for r in running]
        logits = None
        if self._graphs is not None:
            try:
                logits = self._graphs.logits(tokens, positions)
            except RuntimeError:  # a graph that cannot be captured must not stop generation
                log.exception("a decode step could not be captured as a CUDA graph; decode "
                              "steps run eagerly from now on")
                self._graphs = None
        if logits is None:
            ids = (tokens[:, None] if from_device
                   else torch.tensor([[token] for token in tokens], device=self._device))
            position_ids = torch.tensor([[p] for p in positions], device=self._device)
            read_length = max(positions) + 1
            span = torch.arange(read_length, device=self._device)[None, :]
            mask = (span <= position_ids)[:, None, None, :]  # [n, 1, 1, read_length]
            if self._fused is not None:
                logits = self._fused.logits(ids, position_ids, self._cache, read_length, mask)
            else:
                logits = self._forward(ids, position_ids, slice(0, n), read_length, mask)
        # Each row draws its output token after the pending one (the one fed in now).
        sampled, logprobs = self._draw(
            running, logits, [r.cached + 1 - len(r.result.prompt_ids) for r in running])
        self._tokens[:n].copy_(sampled)
        readback = self._readback[self._readback_turn]
        self._readback_turn ^= 1
        readback[:, :n].copy_(torch.stack([sampled.double(), logprobs.double()]),
                              non_blocking=True)
        done = None
        if self._device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        for request in running:
            request.cached += 1
        self._decode_steps += 1
        self._decode_rows += n
        return _Step(running, readback, done)

    def _complete(self, step: _Step) -> None:
        """Reads a launched step's tokens back and appends each to its request (but to one
        that finished at the step before), then retires the requests that are done."""
        if step.done is not None:
            step.done.synchronize()
        tokens, logprobs = step.readback[:, :len(step.requests)].tolist()
        for request, token, logprob in zip(step.requests, tokens, logprobs):
            if not request.future.done():
                self._append(request, int(token), logprob)
        self._finish_done()

    def _forward(
        self, ids: Tensor, positions: Tensor, rows: slice, read_length: int, mask: Tensor,
        last: Tensor | None = None,
    ) -> Tensor:
        """Logits at position `last[b]` of each row (the last one by default), through the
        model's own decoder layers."""
        hidden = self._hidden(ids, positions, rows, read_length, mask)
        if last is None:
            return self._model.lm_head(hidden[:, -1])
        return self._model.lm_head(hidden[torch.arange(len(last), device=hidden.device), last])

    def _hidden(self, ids: Tensor, positions: Tensor, rows: slice, read_length: int,
                mask: Tensor) -> Tensor:
        """The last hidden states of `ids` at `positions` in the cache's `rows` (written there
        as they go), through the model's own decoder layers."""
        self._cache.prepare(rows, positions, read_length)
        return self._model.model(
            input_ids=ids,
            position_ids=positions,
            attention_mask=mask,
            use_cache=True,
            **{self._cache_keyword: self._cache},
        ).last_hidden_state

    def _sample(self, requests: list[_Request], logits: Tensor) -> list[tuple[int, float]]:
        """One token per request (row of `logits`) and its log-probability (`_draw`), read
        back in one copy."""
        tokens, logprobs = self._draw(requests, logits,
                                      [len(r.result.output_ids) for r in requests])
        drawn = torch.stack([tokens.double(), logprobs.double()]).tolist()
        return [(int(token), logprob) for token, logprob in zip(*drawn)]

    def _draw(self, requests: list[_Request], logits: Tensor,
              indices: list[int]) -> tuple[Tensor, Tensor]:
        """One token per request (row of `logits`) and its log-probability under the
        distribution it was drawn from, on the device: penalties, then temperature, top-k and
        top-p. The settings go to the device in one copy. `indices`: the index in its
        output of the token each request draws (its seeded stream's position)."""

        def column(values, dtype):
            return torch.tensor(values, dtype=dtype).to(self._device, non_blocking=True)

        penalized = [i for i, r in enumerate(requests) if r.counts is not None]
        if penalized:
            logits = logits.float()
            rows = column(penalized, torch.long)
            chosen = [requests[i] for i in penalized]
            logits[rows] = apply_penalties(
                logits[rows],
                torch.stack([r.counts for r in chosen]),
                column([r.params.frequency_penalty for r in chosen], torch.float32),
                column([r.params.presence_penalty for r in chosen], torch.float32),
            )
        params = [r.params for r in requests]
        temperatures = [p.temperature for p in params]
        top_ps = [p.top_p for p in params]
        top_ks = [p.top_k for p in params]
        # float64 holds every top-k (and token id) exactly.
        settings = column([temperatures, top_ps, top_ks], torch.float64)
        return sample_tokens(
            logits, settings[0].float(), settings[1].float(), settings[2].long(),
            self._generator, BatchShape.of(temperatures, top_ps, top_ks, self.vocab_size),
            self._uniforms(requests, indices, column))

    def _uniforms(self, requests: list[_Request], indices: list[int],
                  column) -> Tensor | None:
        """Each row's draw where a request has a seed of its own (None where none has): its
        stream at the output index of the token it draws, so that a request interrupted by a
        weight update resumes the same stream. Unseeded rows take the engine's generator."""
        seeded = [i for i, r in enumerate(requests) if r.params.seed is not None]
        if not seeded:
            return None
        pairs = column([[requests[i].params.seed for i in seeded],
                        [indices[i] for i in seeded]], torch.long)
        drawn = seeded_uniforms(pairs[0], pairs[1])
        if len(seeded) == len(requests):  # a rollout's batch: every response seeded
            return drawn
        uniforms = torch.rand(len(requests), generator=self._generator, device=self._device)
        return uniforms.index_copy_(0, column(seeded, torch.long), drawn)

    def _append(self, request: _Request, token_id: int, logprob: float) -> None:
        result = request.result
        result.output_ids.append(token_id)
        result.output_logprobs.append(logprob)
        result.output_versions.append(self._version)
        if request.counts is not None:
            request.counts[token_id] += 1
        request.pending = token_id
        self._generated_total += 1

    def _finish_done(self) -> None:
        """Retires requests that hit a stop token, their token budget or the cache length."""
        for row in reversed(range(len(self._running))):
            request = self._running[row]
            result = request.result
            if result.output_ids and result.output_ids[-1] in request.stop_ids:
                result.matched_stop = result.output_ids[-1]
                reason = "stop"
            elif len(result.output_ids) >= request.params.max_new_tokens:
                reason = "length"
            elif len(request.tokens) >= self._cache.max_length:
                reason = "length"
            else:
                continue
            self._release_row(row)
            with self._wake:
                self._finish(request, reason)

    def _release_row(self, row: int) -> None:
        """Removes the request in `row`, moving the last running request into its place."""
        last = len(self._running) - 1
        if row != last:
            moved = self._running[last]
            if moved.cached:
                self._cache.move(last, row, moved.cached)
            self._tokens[row] = self._tokens[last]  # its newest token, maybe not yet read back
            self._running[row] = moved
        self._running.pop()

    def _finish(self, request: _Request, reason: str) -> None:
        request.result.finish_reason = reason
        self._requests.pop(request.result.request_id, None)
        if not request.future.done():
            request.future.set_result(request.result)

    def _fail_all(self, exc: Exception) -> None:
        with self._wake:
            for request in itertools.chain(self._waiting, self._running):
                self._requests.pop(request.result.request_id, None)
                if not request.future.done():
                    request.future.set_exception(exc)
            self._waiting.clear()
            self._running.clear()
