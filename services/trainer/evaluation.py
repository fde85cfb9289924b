"""The trainer's held-out evaluation, on its leader: greedy accuracy on the job's held-out
prompts (trainer.evalPrompts of them), scored by the job's reward as rollouts are, so a run
can be compared with its starting point."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Awaitable, Callable

import torch

from asyncrl.algorithms.evaluation import accuracy_record
from asyncrl.clients.reward import PromptScorer, reward_scorer
from asyncrl.data.prompts import PromptSet, build_prompts, max_sequence_length
from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.engine.types import SamplingParams
from asyncrl.model.policy import load_policy, sharing_weights
from asyncrl.platform.settings import TrainerSettings

if TYPE_CHECKING:
    from asyncrl.trainer.service import Status


class Evaluator:
    """`trained_model`: the trainer's model where it is the whole transformers model, held by
    this one process, with no adapter (else None): the evaluation engine may then compute with
    its weights. `on_compute` runs work on the trainer's compute thread."""

    def __init__(self, settings: TrainerSettings, job, tokenizer, device: torch.device,
                 trained_model: torch.nn.Module | None,
                 on_compute: Callable[..., Awaitable], status: Status):
        self.spec, self.tokenizer, self.device = job.spec, tokenizer, device
        self.trained_model = trained_model
        self._on_compute = on_compute
        self.status = status
        _, held_out = build_prompts(self.spec, tokenizer)
        count = (self.spec.trainer.eval_prompts if settings.eval_prompts is None
                 else settings.eval_prompts)
        self.items = PromptSet.of(held_out.head(count))
        self.reward = reward_scorer(settings.reward_address, job.metadata.name, self.spec.reward)
        self.scorer = PromptScorer(self.reward, tokenizer,
                                   truncated_reward=self.spec.reward.truncated_reward)
        self._engine: TorchEngine | None = None  # built on the first evaluation

    async def evaluate(self, state: dict[str, torch.Tensor]) -> dict:
        """Greedy accuracy on held-out prompts, with the weights of `state` (the whole model),
        its standard error (asyncrl.algorithms.evaluation.accuracy_record) and the seconds it
        took; {} without held-out prompts.
        The evaluation engine takes the weights the way rollout workers do (a weight update)
        and runs on the compute thread (no thread of its own). Where the trainer's weights are
        the published ones (one process holds the whole transformers model, and snapshots are
        float32) it computes with them, sharing their memory (through the model's own layers:
        fused projections would copy them); else it keeps a copy in the model's dtype."""
        if not self.items:
            return {}
        if self._engine is None:
            shares = self.trained_model is not None and self.spec.model.dtype == "float32"
            if shares:
                model = await self._on_compute(sharing_weights, self.trained_model)
            else:
                model, _ = await self._on_compute(load_policy, self.spec.model,
                                                  device=self.device)
            self._engine = TorchEngine(
                model, max_running_requests=len(self.items),
                max_sequence_length=max_sequence_length(self.spec, self.items),
                eos_token_ids=(self.tokenizer.eos_token_id,), seed=0, fused_decode=not shares,
                lora=self.spec.model.lora,
            )
        engine = self._engine
        params = SamplingParams.from_spec(self.spec, greedy=True)

        def generate() -> list:
            engine.update_weights_from_state_dict(state, self.status.version)
            futures = [engine.submit(item.prompt_ids, params) for item in self.items]
            engine.run_until_idle()
            return [f.result() for f in futures]

        started = time.perf_counter()
        results = await self._on_compute(generate)
        scores = await asyncio.gather(*(
            self.scorer.score(item, [r.output_ids], cut=[r.finish_reason == "length"])
            for item, r in zip(self.items, results)
        ))
        # What the evaluation cost the run (training waits for it): a user weighs it against
        # the standard error it buys when choosing trainer.evalPrompts and evalEvery.
        evaluation = {**accuracy_record([score for (score,) in scores]),
                      "eval_seconds": time.perf_counter() - started}
        self.status.eval_accuracy = evaluation["eval_accuracy"]
        self.status.eval_stderr = evaluation["eval_stderr"]
        return evaluation

    async def close(self) -> None:
        """Stops the evaluation engine, if one was built, and closes the reward scorer."""
        if self._engine is not None:
            self._engine.stop()
        await self.reward.close()
