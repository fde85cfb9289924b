"""A synchronous RL loop in one process: generate, score, update, repeat.

This is the classic alternation that asynchronous RL improves on, and the quickest way to see
the trainer step learn on a real model. It uses the same update code as the trainer service.
Generation here is plain `transformers` sampling; the rollout service replaces it.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass
from typing import Callable

import torch

from asyncrl.data import arith
from asyncrl.algorithms.advantages import aggregation_weights, compute_advantages
from asyncrl.engine.types import SamplingParams
from asyncrl.model.policy import load_policy, packed_token_logprobs
from asyncrl.scoring.scorer import RewardScorer
from asyncrl.scoring.types import MathReference, ScoreTask
from asyncrl.trainer.step import PolicyUpdater, TrainSample, reference_policy


@dataclass(frozen=True)
class DemoStep:
    step: int
    reward_mean: float
    generate_seconds: float
    stats: dict[str, float]


def run_demo(spec, steps: int, on_step: Callable[[DemoStep], None] = lambda _: None) -> list[DemoStep]:
    """Runs `steps` synchronous RL steps of an `arith` job and returns what each did."""
    if spec.dataset.kind != "arith":
        raise ValueError(
            f"train-demo supports dataset.kind arith, not {spec.dataset.kind!r}; "
            "use examples/arith.yaml or examples/tiny.yaml"
        )
    torch.manual_seed(spec.dataset.seed)
    # float32 master weights, as in the trainer service (bf16 is autocast in the update).
    model, tokenizer = load_policy(spec.model, dtype="float32")
    algorithm = spec.algorithm
    updater = PolicyUpdater.from_spec(spec, model, reference_policy(spec))

    problems = arith.generate(spec.dataset.num_prompts, spec.dataset.seed, spec.dataset.difficulty)
    train, _ = arith.split(problems, spec.dataset.eval_fraction)
    stream = itertools.cycle(train)
    results = []
    # The reward service's scorer, in this process (its math-verify worker runs beside it).
    scorer = RewardScorer.from_spec(spec.reward, workers=1)
    loop = asyncio.new_event_loop()
    try:
        for step in range(1, steps + 1):
            batch = list(itertools.islice(stream, algorithm.batch_size))
            started = time.perf_counter()
            samples, texts = _rollout(model, tokenizer, batch, spec)
            generate_seconds = time.perf_counter() - started
            rewards = torch.tensor([
                [r.score for r in loop.run_until_complete(scorer.score(ScoreTask.for_group(
                    MathReference(str(problem.answer)), texts[i], problem.prompt_id)))]
                for i, problem in enumerate(batch)])
            lengths = torch.tensor([int(s.loss_mask.sum()) for s in samples])
            advantages = (compute_advantages(
                rewards, algorithm.advantage_estimator, algorithm.batch_norm_advantages
            ) * aggregation_weights(lengths.view(rewards.shape), algorithm.loss_aggregation)
            ).flatten()
            # Synchronous: the weights of step k (updated k - 1 times) generated every sample.
            samples = [
                TrainSample(s.input_ids, s.loss_mask, s.behaviour_logprobs, float(a), step - 1)
                for s, a in zip(samples, advantages)
            ]
            stats = updater.step(samples, step - 1, step - 1)
            result = DemoStep(step, float(rewards.mean()), generate_seconds, stats)
            results.append(result)
            on_step(result)
    finally:
        loop.run_until_complete(scorer.close())
        loop.close()
    return results


def _rollout(model, tokenizer, problems, spec) -> tuple[list[TrainSample], list[list[str]]]:
    """n sampled responses per problem: samples with their behaviour log-probs, and the n
    response texts of each problem."""
    n, params = spec.algorithm.group_size, SamplingParams.from_spec(spec)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": p.prompt}], add_generation_prompt=True, tokenize=False
        )
        for p in problems
    ]
    tokenizer.padding_side = "left"
    encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    model.eval()
    with torch.no_grad():
        # The rollout workers' sampling settings, in transformers' terms.
        output = model.generate(
            input_ids=encoded.input_ids.repeat_interleave(n, 0),
            attention_mask=encoded.attention_mask.repeat_interleave(n, 0),
            do_sample=True,
            temperature=max(params.temperature, 1e-5),
            top_p=params.top_p,
            top_k=params.top_k if params.top_k > 0 else None,
            max_new_tokens=params.max_new_tokens,
            pad_token_id=tokenizer.pad_token_id,
        )
    width = encoded.input_ids.shape[1]
    samples, texts = [], [[] for _ in problems]
    for row, sequence in enumerate(output):
        prompt_ids = encoded.input_ids[row // n][encoded.attention_mask[row // n].bool()]
        response = sequence[width:]
        ends = (response == tokenizer.eos_token_id).nonzero()
        response = response[: int(ends[0]) + 1] if len(ends) else response
        ids = torch.cat([prompt_ids, response])
        mask = torch.zeros(ids.numel(), dtype=torch.bool)
        mask[prompt_ids.numel():] = True
        with torch.no_grad():
            behaviour = packed_token_logprobs(
                model, ids, torch.arange(ids.numel()), torch.tensor([0, ids.numel()]),
                params.temperature,
            )
        samples.append(TrainSample(ids, mask, behaviour * mask, 0.0))
        texts[row // n].append(tokenizer.decode(response, skip_special_tokens=True))
    return samples, texts
