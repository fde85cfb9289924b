"""The trainer's held-out evaluation, on its leader: greedy accuracy on the job's held-out
prompts (trainer.evalPrompts of them), scored by the job's reward as rollouts are, so a run
can be compared with its starting point. Generating and scoring are asyncrl.evaluation's,
which `asyncrl eval` runs too."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Awaitable, Callable

import torch

from asyncrl.algorithms.evaluation import accuracy_record
from asyncrl.clients.reward import reward_scorer
from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.evaluation import (
    evaluation_dtype,
    evaluation_engine,
    generate,
    held_out_prompts,
    job_scorer,
    response_record,
    shares_trained_weights,
)
from asyncrl.evaluation import sampling, score
from asyncrl.model.policy import load_policy, sharing_weights
from asyncrl.platform.core_lending import CoreLending
from asyncrl.platform.settings import TrainerSettings

if TYPE_CHECKING:
    from asyncrl.trainer.service import Status


class Evaluator:
    """`trained_model`: the trainer's model where it is the whole transformers model, held by
    this one process, with no adapter (else None): the evaluation engine may then compute with
    its weights. `on_compute` runs work on the trainer's compute thread; `lending`: the cores
    the trainer shares with its rollout worker (asyncrl.platform.core_lending)."""

    def __init__(self, settings: TrainerSettings, job, tokenizer, device: torch.device,
                 trained_model: torch.nn.Module | None,
                 on_compute: Callable[..., Awaitable], status: Status,
                 lending: CoreLending | None = None):
        self.spec, self.tokenizer, self.device = job.spec, tokenizer, device
        self._lending = lending
        self.trained_model = trained_model
        self._on_compute = on_compute
        self.status = status
        self.items = held_out_prompts(self.spec, tokenizer, settings.eval_prompts)
        self.reward = reward_scorer(settings.reward_address, job.metadata.name, self.spec.reward)
        self.scorer = job_scorer(self.reward, self.spec, tokenizer)
        self._engine: TorchEngine | None = None  # built on the first evaluation

    async def evaluate(self, state: dict[str, torch.Tensor]) -> dict:
        """Greedy accuracy on held-out prompts, with the weights of `state` (the whole model),
        its standard error (asyncrl.algorithms.evaluation.accuracy_record) and the seconds it
        took; {} without held-out prompts.
        The evaluation engine takes the weights the way rollout workers do (a weight update)
        and runs on the compute thread (no thread of its own). Where the trainer's weights are
        the published ones (one process holds the whole transformers model, and snapshots are
        float32, and so is the evaluation) it computes with them, sharing their memory (through
        the model's own layers: fused projections would copy them); else it keeps a copy in the
        rollout engines' dtype (asyncrl.evaluation.evaluation_dtype)."""
        if not self.items:
            return {}
        if self._engine is None:
            dtype = evaluation_dtype(self.spec, self.device)
            if self.trained_model is not None and shares_trained_weights(self.spec, dtype):
                model = await self._on_compute(sharing_weights, self.trained_model)
            else:
                model, _ = await self._on_compute(load_policy, self.spec.model, dtype=dtype,
                                                  device=self.device)
            # Sharing implies no fused decoding (asyncrl.evaluation.fused_decode).
            self._engine = evaluation_engine(model, self.spec, self.items, self.tokenizer,
                                             lending=self._lending)
        engine = self._engine

        def generated() -> list:
            engine.update_weights_from_state_dict(state, self.status.version)
            return generate(engine, self.items, sampling(self.spec, 1))

        started = time.perf_counter()
        results = await self._on_compute(generated)
        scores = await score(self.scorer, self.items, results)
        # What the evaluation cost the run (training waits for it): a user weighs it against
        # the standard error it buys when choosing trainer.evalPrompts and evalEvery.
        evaluation = {**accuracy_record([score for (score,) in scores]),
                      **response_record(results),
                      "eval_seconds": time.perf_counter() - started}
        self.status.eval_accuracy = evaluation["eval_accuracy"]
        self.status.eval_stderr = evaluation["eval_stderr"]
        return evaluation

    async def close(self) -> None:
        """Stops the evaluation engine, if one was built, and closes the reward scorer."""
        if self._engine is not None:
            self._engine.stop()
        await self.reward.close()
