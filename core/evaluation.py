"""Generating a model's responses to evaluation prompts and scoring them with the job's reward:
the one code path of the trainer's held-out evaluation (asyncrl.trainer.evaluation) and of
`asyncrl eval` (asyncrl.local.evaluate), so a number from either is the other's on the same
weights and prompts. Its own layer, between the services and the clients, so both import it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from asyncrl.clients.reward import PromptScorer
from asyncrl.data.prompts import PromptItem, PromptSet, build_prompts, max_sequence_length
from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.engine.types import GenerationResult, SamplingParams
from asyncrl.platform.core_lending import CoreLending
from asyncrl.platform.devices import resolve_dtype


def held_out_prompts(spec, tokenizer, count: int | None = None) -> list[PromptItem]:
    """The first `count` (default trainer.evalPrompts) held-out prompts of the job that fit."""
    _, held_out = build_prompts(spec, tokenizer)
    return held_out.head(spec.trainer.eval_prompts if count is None else count)


def job_scorer(reward, spec, tokenizer, *, training: bool = False) -> PromptScorer:
    """A PromptScorer with the job's reward settings over `reward` (asyncrl.clients.reward's
    reward_scorer): cut responses score reward.truncatedReward where it is set. `training`
    (the rollout's scorer): a wrong stated answer earns reward.math.formatScore; an evaluation
    counts right answers only, whatever the training reward."""
    format_score = (spec.reward.math.format_score
                    if training and spec.reward.kind == "math" else 0.0)
    return PromptScorer(reward, tokenizer, truncated_reward=spec.reward.truncated_reward,
                        format_score=format_score)


def evaluation_dtype(spec, device) -> str:
    """What an evaluation computes in: the rollout engines' dtype (rollout.computeDtype, else
    model.dtype; auto resolved on `device`), so a held-out accuracy is the policy's as it
    samples. One rule for the trainer and `asyncrl eval`."""
    return resolve_dtype(spec.rollout_compute_dtype, device)


def shares_trained_weights(spec, dtype: str) -> bool:
    """Whether the trainer's evaluation computes with its own float32 weights in place: a
    float32 model without an adapter, evaluated in float32."""
    return dtype == spec.model.dtype == "float32" and spec.model.lora is None


def fused_decode(spec, dtype: str) -> bool:
    """Whether an evaluation engine in `dtype` decodes through fused projections: not where it
    shares the trainer's weights (fusing would copy them). One rule for the trainer and
    `asyncrl eval`: fused and unfused kernels round differently, which may change a greedy
    token."""
    return not shares_trained_weights(spec, dtype)


def evaluation_engine(model, spec, items: Sequence[PromptItem], tokenizer, *,
                      samples: int = 1, lending: CoreLending | None = None) -> TorchEngine:
    """A torch engine that runs every response to `items` (`samples` each) in one batch;
    `lending`: the cores its process shares (each step computes with those lent too)."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return TorchEngine(
        model, max_running_requests=len(items) * samples,
        max_sequence_length=max_sequence_length(spec, PromptSet.of(items)),
        eos_token_ids=(tokenizer.eos_token_id,), seed=0, fused_decode=fused_decode(spec, dtype),
        lora=spec.model.lora, lending=lending,
    )


def sampling(spec, samples: int) -> SamplingParams:
    """Greedy for one response per prompt, else the job's own sampling settings."""
    return SamplingParams.from_spec(spec, greedy=samples == 1)


def generate(engine: TorchEngine, items: Sequence[PromptItem], params: SamplingParams, *,
             samples: int = 1, on_done: Callable[[], None] | None = None,
             ) -> list[list[GenerationResult]]:
    """`samples` responses to each item, all submitted at once, in item order; `on_done`
    runs as each finishes (a progress bar)."""
    futures = [[engine.submit(item.prompt_ids, params) for _ in range(samples)]
               for item in items]
    if on_done is not None:
        for future in (f for group in futures for f in group):
            future.add_done_callback(lambda _: on_done())
    engine.run_until_idle()
    return [[future.result() for future in group] for group in futures]


async def score(scorer: PromptScorer, items: Sequence[PromptItem],
                results: Sequence[Sequence[GenerationResult]]) -> list[list[float]]:
    """The reward of each response, per item (a cut response is one that ran to
    maxNewTokens)."""
    return list(await asyncio.gather(*(
        scorer.score(item, [r.output_ids for r in group],
                     cut=[r.finish_reason == "length" for r in group])
        for item, group in zip(items, results, strict=True))))


def response_record(results: Sequence[Sequence[GenerationResult]]) -> dict:
    """{eval_response_length_mean, eval_truncated_fraction} of an evaluation's responses: a
    greedy response that loops until maxNewTokens scores 0, so a fall in accuracy with the
    cut share rising is the decoding's, not the answers'."""
    responses = [r for group in results for r in group]
    if not responses:
        return {}
    return {"eval_response_length_mean": sum(len(r.output_ids) for r in responses)
            / len(responses),
            "eval_truncated_fraction": sum(r.finish_reason == "length" for r in responses)
            / len(responses)}
