"""The rollout workflow: slot -> its prompt -> a group of n scored samples -> the buffer (or,
with skip_uniform, dropped when every reward is equal: it carries no learning signal).

The group comes from a GroupSource: `SingleTurnGroups` (n responses to the prompt, scored) or,
for rollout.workflow.kind: episode, n runs of the job's episode function on the row
(asyncrl.rollout.episodes).

Each group runs as its own asyncio task, so many groups (and the n responses inside each) are
generated concurrently; the engine batches them. The staleness gate decides how many groups
may be in flight: a group starts only when the gate grants it a slot, and the slot names the
prompt (a cursor the buffer hands out once across every worker: asyncrl.data.prompt_order). The
workflow ends when the gate says every prompt of every epoch is used.

The workflow meets the rest of the system at four small interfaces, so the same loop drives
the torch engine or SGLang, scores in-process or through the reward service, and talks to the
Redis-backed buffer (the tests also drive it with an in-process gate, tests/support/rollout.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Callable, Protocol

from asyncrl.data.prompts import PromptItem
from asyncrl.engine.api import InferenceEngine
from asyncrl.engine.types import GenerationResult, SamplingParams
from asyncrl.data.samples import Group, Slot, Trajectory

log = logging.getLogger(__name__)

#: Skipped groups in a row after which the worker warns that the job may make no steps (and
#: again at twice as many, and so on). A run of 50 is all but impossible while the model
#: solves a real share of its prompts: it means the task is out of its reach, or fully in it.
SKIP_STREAK_WARNING = 50

#: Groups in a row whose row itself failed (RowFailed: an episode function that raised or
#: returned no reward) after which the workflow stops with the last error: a function that
#: fails on every row is broken, and running on would only use up the dataset.
ROW_FAILURES_TO_STOP = 20


class RowFailed(Exception):
    """Generation failed for a reason of the row's own (an episode function that raised on
    it), not the engine's: its prompt is not handed out again, or it would fail forever."""


class Generator(Protocol):
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult: ...


class Scorer(Protocol):
    async def score(self, item: PromptItem, responses: list[list[int]],
                    cut: list[bool] | None = None) -> list[float]: ...


class GroupSource(Protocol):
    async def samples(self, item: PromptItem, cursor: int) -> list[Trajectory]:
        """The scored samples of one group for `item`, handed out at prompt `cursor` (which
        hand-out of the prompt it is, across epochs and workers)."""


class Prompts(Protocol):
    """The training prompts by the cursors the gate hands out (asyncrl.data.prompt_order)."""

    def item(self, cursor: int) -> PromptItem: ...

    def fits(self, item: PromptItem) -> bool:
        """Whether the job runs `item` (dataset.maxPromptTokens)."""


class SlotGate(Protocol):
    """The buffer as the rollout side sees it."""

    async def acquire(self) -> Slot | None:
        """Waits until the staleness gate grants a slot; None once every prompt of every
        epoch is used (no slot will be granted again)."""

    async def put(self, slot: Slot, group: Group) -> Slot | None:
        """Stores the group and releases its slot (a next slot only when one is asked for)."""

    async def release(self, slot: Slot, reason: str, *, prompt_used: bool = False) -> None:
        """Gives the slot back without a group: its prompt is handed out again, unless
        `prompt_used`."""

    async def skip(self, slot: Slot) -> None:
        """Gives the slot back: its group was generated, and every response got the same
        reward (counted as skipped)."""


class EngineGenerator:
    """Generator over an InferenceEngine (torch or SGLang). With `metrics` (RolloutMetrics),
    every finished request is counted as the HTTP API counts it."""

    def __init__(self, engine: InferenceEngine, metrics=None):
        self._engine = engine
        self._metrics = metrics

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        started = time.perf_counter()
        result = await self._engine.generate(prompt_ids, params)
        if self._metrics is not None:
            self._metrics.observe_result(result, time.perf_counter() - started)
        return result


class SingleTurnGroups:
    """n responses to the prompt, each scored: the single-turn workflow's groups. With a seed
    in `params`, response i of the group at prompt cursor c samples with its own seed
    (`params.substream(c, i)`): which tokens a group gets then depends on the weights and the
    job, not on how the engine happened to batch it (so not on the machine's load)."""

    def __init__(self, *, generator: Generator, scorer: Scorer, group_size: int,
                 params: SamplingParams):
        self._generator = generator
        self._scorer = scorer
        self._group_size = group_size
        self._params = params

    async def samples(self, item: PromptItem, cursor: int) -> list[Trajectory]:
        began = time.perf_counter()
        results = await asyncio.gather(
            *(self._generator.generate(item.prompt_ids, self._params.substream(cursor, index))
              for index in range(self._group_size)))
        generated = time.perf_counter()
        rewards = await self._scorer.score(item, [r.output_ids for r in results],
                                           cut=[r.finish_reason == "length" for r in results])
        scored = time.perf_counter()
        return [
            Trajectory(
                prompt_ids=list(item.prompt_ids),
                response_ids=r.output_ids,
                behaviour_logprobs=r.output_logprobs,
                token_versions=r.output_versions,
                reward=float(reward),
                finish_reason=r.finish_reason,
                generate_seconds=generated - began,
                reward_seconds=scored - generated,
            )
            for r, reward in zip(results, rewards)
        ]


@dataclass
class WorkflowStats:
    groups_put: int = 0
    groups_failed: int = 0
    groups_skipped: int = 0  # every reward equal, with skip_uniform
    skipped_in_a_row: int = 0
    rows_failed_in_a_row: int = 0
    prompts_dropped: int = 0  # longer than dataset.maxPromptTokens
    samples: int = 0
    generated_tokens: int = 0
    rewards: list[float] = field(default_factory=list)


class RolloutWorkflow:
    def __init__(
        self,
        prompts: Prompts,
        *,
        source: GroupSource,
        gate: SlotGate,
        on_group: Callable[[Group], None] = lambda _: None,
        skip_uniform: bool = False,
        on_skipped: Callable[[Group], None] = lambda _: None,
        on_dropped: Callable[[PromptItem], None] = lambda _: None,
        max_in_flight: int | None = None,
    ):
        self._prompts = prompts
        # This worker's share of the job-wide limit the gate enforces (None: no share): a
        # worker asks for no slot while it runs that many groups, so the other replicas find
        # free slots rather than the first to ask holding them all.
        self._max_in_flight = max_in_flight
        self._source = source
        self._gate = gate
        self._on_group = on_group
        self._skip_uniform = skip_uniform
        self._on_skipped = on_skipped
        self._on_dropped = on_dropped
        # Group ids name this workflow too: every worker, and every restart of one, counts
        # from 0 over the same prompts.
        self._worker = uuid.uuid4().hex[:8]
        self._ids = itertools.count()
        self._last_row_failure: Exception | None = None
        self.stats = WorkflowStats()

    async def run(self, max_groups: int | None = None) -> WorkflowStats:
        """Starts a group whenever the gate grants a slot and fewer than `max_in_flight` run,
        until `max_groups` groups were started (or every prompt is used); cancelling it abandons in-flight groups' slots
        cleanly, their prompts handed out again."""
        tasks: set[asyncio.Task] = set()
        started = 0
        try:
            while max_groups is None or started < max_groups:
                while self._max_in_flight is not None and len(tasks) >= self._max_in_flight:
                    await asyncio.wait(set(tasks), return_when=asyncio.FIRST_COMPLETED)
                slot = await self._gate.acquire()
                self._stop_if_broken()
                if slot is None:
                    break
                item = self._prompts.item(slot.prompt_cursor)
                if not self._prompts.fits(item):
                    await self._drop(slot, item)
                    continue
                started += 1
                task = asyncio.create_task(self._run_group(slot, item))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            if tasks:
                await asyncio.gather(*tasks)
            self._stop_if_broken()
        finally:
            for task in tasks:
                task.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
        return self.stats

    def _stop_if_broken(self) -> None:
        streak = self.stats.rows_failed_in_a_row
        if streak >= ROW_FAILURES_TO_STOP:
            raise RuntimeError(
                f"the last {streak} groups all failed, the last one with: "
                f"{self._last_row_failure}; fix the episode function (its traceback is "
                f"logged above) and start the job again") from self._last_row_failure

    async def _drop(self, slot: Slot, item: PromptItem) -> None:
        """A prompt too long for the job: never truncated (a cut prompt asks another question),
        its slot given back with the prompt used, counted and logged."""
        await self._gate.release(slot, "prompt too long", prompt_used=True)
        self.stats.prompts_dropped += 1
        self._on_dropped(item)
        log.warning("prompt %s has %d tokens, more than dataset.maxPromptTokens: dropped, not "
                    "truncated (%d dropped by this worker so far)", item.prompt_id,
                    len(item.prompt_ids), self.stats.prompts_dropped)

    async def _run_group(self, slot: Slot, item: PromptItem) -> None:
        started_ms = int(time.time() * 1000)
        try:
            group = await self._generate_group(item, slot.prompt_cursor, started_ms)
        except BaseException as exc:
            self.stats.groups_failed += 1
            row_failed = isinstance(exc, RowFailed)
            # Its prompt is handed out again, to this worker or another (unless the row
            # itself failed).
            await asyncio.shield(self._gate.release(slot, "generation failed",
                                                    prompt_used=row_failed))
            if not isinstance(exc, Exception):  # cancelled: the workflow is stopping
                raise
            if row_failed:
                self.stats.rows_failed_in_a_row += 1
                self._last_row_failure = exc
                log.warning("the group for prompt %s failed, and is not retried: %s",
                            item.prompt_id, exc, exc_info=exc.__cause__ is not None)
            else:
                log.warning("generating for prompt %s failed; its prompt is handed out again",
                            item.prompt_id, exc_info=True)
            return
        if self._skip_uniform and len(set(group.episode_rewards)) == 1:
            # Never accepted, so the staleness gate's budget is whole again for the next one.
            await self._gate.skip(slot)
            self._count_skipped(group)
            return
        try:
            await self._gate.put(slot, group)
        except Exception:  # e.g. the slot's lease expired: the buffer hands its prompt out again
            self.stats.groups_failed += 1
            log.warning("group %s was not accepted by the buffer", group.group_id, exc_info=True)
            return
        self.stats.groups_put += 1
        self.stats.skipped_in_a_row = self.stats.rows_failed_in_a_row = 0
        self.stats.samples += len(group.samples)
        self.stats.generated_tokens += sum(s.model_tokens for s in group.samples)
        self.stats.rewards.extend(group.episode_rewards)
        self._on_group(group)

    def _count_skipped(self, group: Group) -> None:
        stats = self.stats
        stats.groups_skipped += 1
        stats.skipped_in_a_row += 1
        stats.rows_failed_in_a_row = 0
        self._on_skipped(group)
        streak = stats.skipped_in_a_row
        multiple, rest = divmod(streak, SKIP_STREAK_WARNING)
        if rest == 0 and multiple & (multiple - 1) == 0:  # at 1, 2, 4, ... times the threshold
            log.warning(
                "the last %d groups each got one reward for all their responses (the last one: "
                "%g), and algorithm.skipUniformGroups drops such groups: while this goes on the "
                "trainer gets no batch. Give the model prompts it solves sometimes but not "
                "always (e.g. dataset.difficulty), raise rollout.temperature, or set "
                "algorithm.skipUniformGroups: false", streak, group.samples[0].reward)

    async def _generate_group(self, item: PromptItem, cursor: int, started_ms: int) -> Group:
        samples = await self._source.samples(item, cursor)
        return Group(f"{item.prompt_id}#{self._worker}-{next(self._ids)}", item.prompt_id,
                     samples, started_ms)
