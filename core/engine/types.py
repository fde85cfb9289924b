"""What the rollout engine takes and returns; shared by the engine, its HTTP and gRPC fronts,
the SGLang client and the rollout workflow."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


class RequestError(ValueError):
    """A request the engine refuses; the message names the field and the fix (HTTP 400)."""


class UnknownRequestError(KeyError):
    """A request id the engine does not know (HTTP 404)."""


def stream_seed(*keys: int) -> int:
    """A request's seed made from several integers (a job's seed, a prompt's hand-out, a
    response's index in its group): a 63-bit hash of them, the same in every process."""
    digest = hashlib.blake2b("/".join(map(str, keys)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (SGLang's names and meanings). temperature 0 means greedy.

    `ignore_eos`: the engine's EOS tokens do not end the request (`stop_token_ids` still do).
    `frequency_penalty` / `presence_penalty` (OpenAI's definition, as SGLang applies them):
    before temperature, top-k and top-p, each token's logit is lowered by
    `frequency_penalty × (times it occurs in the output so far)` and by `presence_penalty` if
    it occurs there at all; the prompt does not count. Negative values favour repetition.
    Reported log-probabilities are under the penalised distribution a token was drawn from
    (the behaviour policy), so with penalties they differ from the model's own.
    `seed` (SGLang's `sampling_seed`): the request draws from a stream of its own, so the
    same weights, prompt and seed give the same tokens whatever else the engine runs beside
    it, up to the rounding of batched logits (asyncrl.engine.sampling.seeded_uniforms);
    None: the engine's shared generator. `substream(*keys)` gives each of several requests
    (a group's responses, a completion's choices) a stream of its own under one seed.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None

    @classmethod
    def from_spec(cls, spec, *, greedy: bool = False) -> SamplingParams:
        """A job's sampling settings (`spec.rollout` of an RLJobSpec): the one place they are
        read, for the rollout workers, the synchronous demo and the trainer's evaluation.
        `greedy` (evaluation): the same response budget, decoded greedily (temperature 0;
        top-p and top-k off)."""
        rollout = spec.rollout
        if greedy:
            return cls(max_new_tokens=rollout.max_new_tokens, temperature=0)
        return cls(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                   top_p=rollout.top_p, top_k=rollout.top_k)

    def substream(self, *keys: int) -> SamplingParams:
        """These settings with the seed `stream_seed(seed, *keys)`; as they are without a
        seed (the engine's shared generator)."""
        if self.seed is None:
            return self
        return replace(self, seed=stream_seed(self.seed, *keys))

    @property
    def penalized(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0

    def check(self) -> None:
        if self.max_new_tokens < 0:
            raise RequestError(
                f"sampling_params.max_new_tokens must be >= 0, got {self.max_new_tokens}"
            )
        if self.temperature < 0:
            raise RequestError(
                f"sampling_params.temperature must be >= 0 (0 is greedy), got {self.temperature}"
            )
        if not 0 < self.top_p <= 1:
            raise RequestError(f"sampling_params.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise RequestError(
                f"sampling_params.top_k must be -1 (off) or >= 1, got {self.top_k}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise RequestError(
                f"sampling_params.ignore_eos must be true or false, got {self.ignore_eos!r}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise RequestError(f"sampling_params.{name} must be in [-2, 2], got {value}")
        if self.seed is not None and not -(1 << 63) <= self.seed < 1 << 63:
            raise RequestError(f"sampling_params.sampling_seed must fit in 64 signed bits, "
                               f"got {self.seed}")


@dataclass
class GenerationResult:
    """A finished (or aborted) request.

    `output_logprobs[i]` is the log-probability of `output_ids[i]` under the distribution it
    was sampled from (temperature-scaled, renormalised after top-k/top-p); for greedy
    requests, under the unscaled distribution. `output_versions[i]` is the policy version of
    the weights that generated token i.
    """

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    finish_reason: FinishReason = "length"
    matched_stop: int | None = None
    # How many times a weight update interrupted this request (each resumed by a prefill).
    interruptions: int = 0


@dataclass(frozen=True)
class EngineStatus:
    version: int
    paused: bool
    running_requests: int
    waiting_requests: int
    generated_tokens_total: int
    interrupted_requests_total: int
    max_running_requests: int
    max_sequence_length: int
    # Running requests whose newest token came from an older version (resuming after an
    # update); 0 once every running request generates with the current weights.
    stale_requests: int = 0
    # Occupancy: decode steps run, requests decoded over all of them (rows / steps is the mean
    # batch), and seconds spent in steps (the rest of the engine's life it was idle).
    decode_steps_total: int = 0
    decode_rows_total: int = 0
    busy_seconds_total: float = 0.0
    # Cost of interruptions: swapping weights, and re-prefilling resumed requests.
    weight_swap_seconds_total: float = 0.0
    resume_prefill_seconds_total: float = 0.0


@dataclass(frozen=True)
class WeightUpdate:
    """What one weight update did."""

    version: int
    interrupted_requests: int
    seconds: float
