"""Shared pieces for the rollout and weight tests: a real torch engine on a tiny random model
(support.tiny_model), the log-probs a trainer would recompute for its tokens, and test doubles
of the workflow's prompt order and staleness gate."""

from __future__ import annotations

import asyncio
import itertools
import json

import torch

from asyncrl.data.prompts import PromptItem, PromptSet
from asyncrl.data.samples import Group, Slot
from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.engine.types import EngineStatus
from asyncrl.model.policy import packed_token_logprobs
from support.gate_oracle import rollout_capacity
from support.tiny_model import VOCAB, tiny_model

MAX_SEQUENCE_LENGTH = 256


def tiny_engine(seed: int = 0) -> TorchEngine:
    """A started torch engine on tiny_model(seed) (VOCAB tokens)."""
    return TorchEngine(tiny_model(seed, VOCAB), max_running_requests=8,
                       max_sequence_length=MAX_SEQUENCE_LENGTH, seed=0).start()


def recomputed_logprobs(models: dict, prompt_ids: list[int], output_ids: list[int],
                        output_versions: list[int]) -> torch.Tensor:
    """log p(token i | prompt + tokens before it) under the model of token i's version
    (`models`: version -> model), by the trainer's own forward, at temperature 1."""
    ids = torch.tensor(prompt_ids + output_ids)
    bounds = torch.tensor([0, len(ids)])
    with torch.no_grad():
        per_version = {v: packed_token_logprobs(m.eval(), ids, torch.arange(len(ids)), bounds)
                       [len(prompt_ids):] for v, m in models.items()}
    return torch.stack([per_version[v][i] for i, v in enumerate(output_versions)])


class WithoutPerTokenVersions:
    """ASGI middleware: removes our `output_token_versions` extension from /generate answers,
    so the server answers like SGLang (one `weight_version` per request). `weight_version`
    replaces the one reported: SGLang serving LoRA adapters reports its base's ("0")."""

    def __init__(self, app, weight_version: str | None = None):
        self.app = app
        self.weight_version = weight_version

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] != "/generate":
            return await self.app(scope, receive, send)
        messages = []

        async def capture(message):
            messages.append(message)

        await self.app(scope, receive, capture)
        start, *bodies = messages
        body = json.loads(b"".join(m.get("body", b"") for m in bodies))
        for output in body if isinstance(body, list) else [body]:
            if "meta_info" not in output:
                continue  # an error
            output["meta_info"].pop("output_token_versions", None)
            if self.weight_version is not None:
                output["meta_info"]["weight_version"] = self.weight_version
        data = json.dumps(body).encode()
        headers = [(k, v) for k, v in start["headers"] if k.lower() != b"content-length"]
        await send({**start, "headers": headers + [(b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})


def queued(engine) -> int:
    status: EngineStatus = engine.status()
    return status.waiting_requests + status.running_requests


class InOrder:
    """Prompts by cursor in the order given, every epoch alike: a test double of
    asyncrl.data.prompt_order.PromptOrder where a test needs to know which prompt comes when."""

    def __init__(self, items: list[PromptItem], max_prompt_tokens: int | None = None):
        self._set = PromptSet.of(items, max_prompt_tokens)

    def item(self, cursor: int) -> PromptItem:
        return self._set[cursor % len(self._set)]

    def fits(self, item: PromptItem) -> bool:
        return self._set.fits(item)


class InProcessGate:
    """The staleness gate in one process, a test double for the workflow's unit tests; the job
    uses the Redis-backed buffer service, which enforces the same rule across replicas. It
    hands out prompt cursors as the buffer does: `prompts` in all (None: no end), a lost
    slot's again first, and None once every one is used."""

    def __init__(self, *, max_staleness: int, batch_size: int, max_concurrent: int = 0,
                 prompts: int | None = None):
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.max_concurrent = max_concurrent
        self.prompts = prompts
        self.trainer_version = 0
        self.accepted = 0
        self.running = 0
        self.cursor = 0                      # the next new cursor
        self.reissue: list[int] = []         # lost slots' cursors
        self.holding: dict[str, int] = {}    # slot id -> its cursor
        self.groups: list[Group] = []
        self.released: list[str] = []  # the reasons given
        self.peak_in_flight = 0
        self._changed = asyncio.Condition()
        self._ids = itertools.count()

    def used_up(self) -> bool:
        return (self.prompts is not None and self.cursor >= self.prompts and not self.reissue
                and not self.holding)

    def _prompt_left(self) -> bool:
        return bool(self.reissue) or self.prompts is None or self.cursor < self.prompts

    def capacity(self) -> int:
        return rollout_capacity(
            max_staleness=self.max_staleness,
            trainer_version=self.trainer_version,
            batch_size=self.batch_size,
            accepted=self.accepted,
            running=self.running,
            max_concurrent=self.max_concurrent,
        )

    async def acquire(self) -> Slot | None:
        async with self._changed:
            await self._changed.wait_for(
                lambda: self.used_up() or (self._prompt_left() and self.capacity() > 0))
            if self.used_up():
                return None
            if self.reissue:
                cursor = self.reissue.pop(0)
            else:
                cursor, self.cursor = self.cursor, self.cursor + 1
            self.running += 1
            self.peak_in_flight = max(self.peak_in_flight, self.accepted + self.running)
            slot = Slot(f"slot-{next(self._ids)}", cursor)
            self.holding[slot.slot_id] = cursor
            return slot

    async def put(self, slot: Slot, group: Group) -> None:
        async with self._changed:
            del self.holding[slot.slot_id]
            self.running -= 1
            self.accepted += 1
            self.groups.append(group)
            self._changed.notify_all()

    async def release(self, slot: Slot, reason: str, *, prompt_used: bool = False) -> None:
        async with self._changed:
            cursor = self.holding.pop(slot.slot_id)
            if not prompt_used:
                self.reissue.append(cursor)
            self.running -= 1
            self.released.append(reason)
            self._changed.notify_all()

    async def skip(self, slot: Slot) -> None:
        await self.release(slot, "every reward equal", prompt_used=True)

    async def set_version(self, version: int) -> None:
        async with self._changed:
            self.trainer_version = version
            self._changed.notify_all()
