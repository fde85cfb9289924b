"""`asyncrl serve trainer`: GetBatch -> update -> Ack -> publish weights -> SetVersion, forever
(until algorithm.maxSteps).

The update runs in a worker thread so the gRPC status server and the buffer client stay
responsive. A batch is acknowledged only after its update is applied, so a trainer killed mid-
step gets the same batch again from the buffer when it restarts; checkpoints hold the model,
the optimizer and the step/version, and a restart resumes from the newest one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import torch
from pydantic import Field

from asyncrl.algorithms.advantages import compute_advantages
from asyncrl.algorithms.staleness import staleness
from asyncrl.buffer.client import BufferClient
from asyncrl.models import load_policy
from asyncrl.prompts import ArithScorer, build_prompts
from asyncrl.reward.client import PromptScorer, RewardClient
from asyncrl.rollout.engine import TorchEngine
from asyncrl.rollout.types import SamplingParams
from asyncrl.settings import ServiceSettings
from asyncrl.spec import load_manifest
from asyncrl.trainer.checkpoints import (
    TrainerState,
    load_latest_checkpoint,
    publish_weights,
    save_checkpoint,
)
from asyncrl.trainer.metrics import TrainerMetrics
from asyncrl.trainer.step import PolicyUpdater, TrainSample, UpdateConfig
from asyncrl.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc

log = logging.getLogger(__name__)


class TrainerSettings(ServiceSettings):
    buffer_address: str = Field(description="host:port of the buffer service.")
    run_dir: Path = Field(description="Run folder: checkpoints, weights, metrics.jsonl.")
    grpc_port: int = Field(default=50071, ge=1, le=65535, description="Trainer status gRPC.")
    metrics_port: int = Field(default=0, ge=0, le=65535, description="Prometheus; 0 = off.")
    consumer: str = Field(default="trainer-0", description="Stable name (the pod's name).")
    eval_prompts: int = Field(default=32, ge=0, description="Held-out prompts per evaluation.")
    reward_address: str | None = Field(
        default=None, description="Reward service for evaluations (default: in-process "
        "integer check, arithmetic only)."
    )


@dataclass
class Status:
    version: int = 0
    step: int = 0
    max_steps: int = 0
    phase: str = "starting"
    last_step_seconds: float = 0.0
    trained_tokens_per_second: float = 0.0
    loss: float = 0.0
    reward_mean: float = 0.0
    staleness_mean: float = 0.0
    eval_accuracy: float = -1.0
    history: list[dict] = field(default_factory=list)


def samples_from_groups(groups, algorithm) -> tuple[list[TrainSample], torch.Tensor]:
    """Token-aligned training samples and the [groups, n] reward matrix of a batch."""
    rewards = torch.tensor([[s.reward for s in g.samples] for g in groups], dtype=torch.float32)
    advantages = compute_advantages(
        rewards, algorithm.advantage_estimator, algorithm.batch_norm_advantages
    )
    samples = []
    for group, group_advantages in zip(groups, advantages):
        for sample, advantage in zip(group.samples, group_advantages):
            prompt, response = list(sample.prompt_ids), list(sample.response_ids)
            ids = torch.tensor(prompt + response)
            mask = torch.zeros(len(ids), dtype=torch.bool)
            mask[len(prompt):] = True
            behaviour = torch.zeros(len(ids))
            behaviour[len(prompt):] = torch.tensor(list(sample.behaviour_logprobs))
            samples.append(TrainSample(ids, mask, behaviour, float(advantage)))
    return samples, rewards


class Trainer:
    def __init__(self, settings: TrainerSettings):
        self.settings = settings
        self.job = load_manifest(settings.job_file)
        spec = self.job.spec
        self.spec = spec
        self.model, self.tokenizer = load_policy(spec.model)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=spec.algorithm.learning_rate,
            weight_decay=spec.algorithm.weight_decay,
        )
        reference = None
        if spec.algorithm.kl.coef > 0:
            reference, _ = load_policy(spec.model)
            reference.eval().requires_grad_(False)
        self.updater = PolicyUpdater(self.model, self.optimizer, UpdateConfig.from_spec(spec), reference)
        self.status = Status(max_steps=spec.algorithm.max_steps)
        self.metrics = TrainerMetrics(self.job.metadata.name)
        _, held_out = build_prompts(spec, self.tokenizer)
        self.eval_items = held_out[: settings.eval_prompts]
        self.reward = RewardClient(settings.reward_address, self.job.metadata.name) if (
            settings.reward_address) else None
        self.scorer = PromptScorer(self.reward, self.tokenizer) if self.reward else ArithScorer(
            self.tokenizer, spec.reward.math.extract)
        self.metrics_file = settings.run_dir / "metrics.jsonl"
        self._evaluator: TorchEngine | None = None

    async def run(self) -> None:
        settings, spec = self.settings, self.spec
        client = BufferClient(settings.buffer_address, self.job.metadata.name)
        restored = load_latest_checkpoint(self.model, self.optimizer, settings.run_dir)
        step = restored.step if restored else 0
        version = restored.version if restored else 0
        announced = (await client.stats()).trainer_version
        if announced > version:
            # Crashed after announcing a version newer than the last checkpoint: keep versions
            # moving forward and republish the restored weights under a new one.
            version = announced + 1
            await self._publish(client, version)
        self.status.version, self.status.step = version, step
        self.metrics.observe_version(version)
        log.info("trainer starts at step %d, version %d", step, version)
        if restored is None and self.eval_items:
            # The starting point every later evaluation is compared with.
            self.status.phase = "evaluating"
            self.status.eval_accuracy = await self.evaluate()
            self.metrics.observe_eval(self.status.eval_accuracy)
            self._write({"kind": "eval", "step": 0, "version": version, "time": time.time(),
                         "elapsed": 0.0, "eval_accuracy": self.status.eval_accuracy})
        started = time.perf_counter()  # wall time of training, after the baseline evaluation
        trained_tokens = 0.0
        try:
            while step < spec.algorithm.max_steps:
                self.status.phase = "waiting_for_batch"
                waiting = time.perf_counter()
                batch = await client.get_batch(settings.consumer, spec.algorithm.batch_size, wait_ms=2000)
                while not batch.batch_id:
                    batch = await client.get_batch(settings.consumer, spec.algorithm.batch_size,
                                                   wait_ms=2000)
                wait_seconds = time.perf_counter() - waiting
                self.status.phase = "training"
                samples, rewards = samples_from_groups(batch.groups, spec.algorithm)
                stale = [staleness(version, _versions(g)) for g in batch.groups]
                stats = await asyncio.to_thread(self.updater.step, samples)
                await client.ack(batch.batch_id)
                step += 1
                version += 1
                self.status.phase = "publishing"
                await self._publish(client, version)
                trained_tokens += stats["trained_tokens"]
                record = {
                    "kind": "train", "step": step, "version": version, "time": time.time(),
                    "elapsed": time.perf_counter() - started,
                    "reward_mean": float(rewards.mean()), "staleness": stale,
                    "staleness_mean": sum(stale) / len(stale), "dropped_stale": batch.dropped_stale,
                    "redelivered": batch.redelivered, "wait_seconds": wait_seconds,
                    "trained_samples": len(samples), **stats,
                }
                if step % spec.trainer.eval_every == 0 or step == spec.algorithm.max_steps:
                    self.status.phase = "evaluating"
                    record["eval_accuracy"] = await self.evaluate()
                    self.status.eval_accuracy = record["eval_accuracy"]
                if step % spec.trainer.checkpoint_every == 0 or step == spec.algorithm.max_steps:
                    await asyncio.to_thread(save_checkpoint, self.model, self.optimizer,
                                            settings.run_dir, TrainerState(step, version))
                self._record(record)
            self.status.phase = "done"
        except BaseException:
            self.status.phase = "failed"
            raise
        finally:
            await client.close()
            if self._evaluator is not None:
                self._evaluator.stop()
            if self.reward:
                await self.reward.close()

    async def _publish(self, client: BufferClient, version: int) -> None:
        path = await asyncio.to_thread(publish_weights, self.model, self.settings.run_dir, version)
        await client.set_version(version, str(path.resolve()))
        self.status.version = version

    async def evaluate(self) -> float:
        """Greedy accuracy on held-out prompts. The evaluation engine keeps its own copy of the
        model and takes the current weights the way rollout workers do (a weight update)."""
        if not self.eval_items:
            return -1.0
        if self._evaluator is None:
            model, _ = load_policy(self.spec.model)
            longest = max(len(item.prompt_ids) for item in self.eval_items)
            self._evaluator = TorchEngine(
                model, max_running_requests=len(self.eval_items),
                max_sequence_length=longest + self.spec.rollout.max_new_tokens,
                eos_token_ids=(self.tokenizer.eos_token_id,), seed=0,
            ).start()
        engine = self._evaluator
        await asyncio.to_thread(engine.update_weights_from_state_dict, self.model.state_dict(),
                                self.status.version)
        params = SamplingParams(max_new_tokens=self.spec.rollout.max_new_tokens, temperature=0)
        futures = [engine.submit(item.prompt_ids, params) for item in self.eval_items]
        results = [await asyncio.wrap_future(f) for f in futures]
        scores = await asyncio.gather(*(
            self.scorer.score(item, [r.output_ids]) for item, r in zip(self.eval_items, results)
        ))
        return sum(score for (score,) in scores) / len(scores)

    def _record(self, record: dict) -> None:
        status = self.status
        status.step, status.last_step_seconds = record["step"], record["step_seconds"]
        status.trained_tokens_per_second = record["trained_tokens"] / max(record["step_seconds"], 1e-9)
        status.loss, status.reward_mean = record["loss"], record["reward_mean"]
        status.staleness_mean = record["staleness_mean"]
        self.metrics.observe_step(record)
        self._write(record)

    def _write(self, record: dict) -> None:
        with self.metrics_file.open("a") as out:
            out.write(json.dumps(record) + "\n")


def _versions(group) -> list[int]:
    return [v for sample in group.samples for v in sample.token_versions] or [0]


class StatusServicer(trainer_pb2_grpc.TrainerStatusServiceServicer):
    def __init__(self, status: Status):
        self._status = status

    async def GetStatus(self, request, context):
        s = self._status
        return trainer_pb2.TrainerStatus(
            version=s.version, step=s.step, max_steps=s.max_steps, phase=s.phase,
            last_step_seconds=s.last_step_seconds,
            trained_tokens_per_second=s.trained_tokens_per_second, loss=s.loss,
            reward_mean=s.reward_mean, staleness_mean=s.staleness_mean,
            eval_accuracy=s.eval_accuracy,
        )

    async def Health(self, request, context):
        return common_pb2.HealthResponse(serving=self._status.phase != "failed",
                                         detail=self._status.phase)


def serve(settings: TrainerSettings) -> None:
    if settings.threads:
        torch.set_num_threads(settings.threads)
    settings.run_dir.mkdir(parents=True, exist_ok=True)

    async def run() -> None:
        trainer = Trainer(settings)
        server = grpc.aio.server()
        trainer_pb2_grpc.add_TrainerStatusServiceServicer_to_server(StatusServicer(trainer.status), server)
        server.add_insecure_port(f"{settings.host}:{settings.grpc_port}")
        await server.start()
        if settings.metrics_port:
            trainer.metrics.serve(settings.metrics_port, settings.host)
        try:
            await trainer.run()
            await asyncio.sleep(1.0)  # let a watcher read the final status
        finally:
            await server.stop(grace=1)

    asyncio.run(run())
