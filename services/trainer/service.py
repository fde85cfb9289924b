"""`asyncrl serve trainer`: GetBatch -> update -> Ack -> publish weights -> SetVersion, until
algorithm.maxSteps, or until the dataset is used up (dataset.epochs) and too few groups are left
for a full batch: every full batch is trained, a last partial one is not.

The update runs in a worker thread so the gRPC status server and the buffer client stay
responsive. A batch is acknowledged only after its update is applied, so a trainer killed mid-
step gets the same batch again from the buffer when it restarts; checkpoints hold the model,
the optimizer and the step/version, and a restart resumes from the newest one. metrics.jsonl
has one record per step: on a restart the records after the restored checkpoint are dropped,
since those steps are trained and recorded again.

Under torchrun (trainer.replicas x processesPerReplica > 1) every process runs this command:
rank 0 talks to the buffer, splits each batch across the ranks by tokens and publishes; the
others follow its commands (asyncrl.trainer.distributed). Any rank that dies takes the group
down (torchrun stops the rest), and the restart resumes as above.

This module owns the loop; rank 0 hands each version to asyncrl.trainer.publication (which
path, and its announcements) and each held-out evaluation to asyncrl.trainer.evaluation.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from asyncrl.algorithms.advantages import aggregation_weights, episode_advantages
from asyncrl.algorithms.shaping import overlong_penalties
from asyncrl.algorithms.staleness import staleness
from asyncrl.clients.buffer import BufferClient
from asyncrl.platform.core_lending import lending_from
from asyncrl.platform.devices import auto_compute_dtype, local_rank, select_device
from asyncrl.platform.grpc_service import start_server
from asyncrl.model.lora import (
    adapter_state,
    load_adapter_state,
    trained_model,
    with_adapter,
)
from asyncrl.model.policy import load_policy, model_skeleton
from asyncrl.platform.heap import trim_heap
from asyncrl.platform.openmp import release_idle_thread_pools
from asyncrl.platform.outage import OutageTooLong
from asyncrl.data.samples import episode_of_each, episode_rewards, loss_mask
from asyncrl.platform.settings import TrainerSettings
from asyncrl.spec import RLJob, load_manifest
from asyncrl.trainer.checkpoints import (
    TrainerState,
    latest_checkpoint,
    read_checkpoint,
    save_checkpoint,
)
from asyncrl.trainer.distributed import (
    Command,
    TrainerGroup,
    full_model_state,
    full_optimizer_state,
    heartbeat_seconds,
    load_full_state,
    shard_model,
    shares_per_rank,
    under_torchrun,
)
from asyncrl.trainer.evaluation import Evaluator
from asyncrl.trainer.metrics import TrainerMetrics
from asyncrl.trainer.model_files import ModelFiles
from asyncrl.trainer.publication import Publisher
from asyncrl.trainer.step import PolicyUpdater, TrainSample, reference_policy
from asyncrl.trainer.tracking import Tracking
from asyncrl.v1 import trainer_pb2, trainer_pb2_grpc
from asyncrl.weights.distributed import version_manifest
from asyncrl.weights.paths import with_transfer_path

log = logging.getLogger(__name__)

STATE, STOP, WAIT = Command("state"), Command("stop"), Command("wait")


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
    eval_stderr: float = -1.0
    waited_seconds_total: float = 0.0
    history: list[dict] = field(default_factory=list)


def samples_from_groups(groups, algorithm, max_new_tokens: int = 0,
                        ) -> tuple[list[TrainSample], torch.Tensor]:
    """Token-aligned training samples and the [groups, groupSize] episode-reward matrix of a
    batch of groups (common_pb2.Group, or asyncrl.data.samples.Group). An episode is one
    sample, or several when its turns did not merge (continues_episode), so groups may hold
    different numbers of samples; an episode's reward is its last sample's.
    With algorithm.overlongPenalty (single-turn jobs: one sample an episode) the advantages
    are those of the rewards less each response's penalty against `max_new_tokens`
    (rollout.maxNewTokens); the matrix returned holds the rewards as scored."""
    flat = [sample for group in groups for sample in group.samples]
    episode_of_sample, episode_rewards = _episodes(groups)
    masks = [torch.tensor(loss_mask(sample), dtype=torch.bool) for sample in flat]
    rewards, shaped_episodes = torch.tensor([s.reward for s in flat]), episode_rewards
    if algorithm.overlong_penalty.buffer_tokens:
        # A response's penalty becomes its episode's reward: only whole single-turn episodes
        # have one response to judge (the spec refuses the penalty for episode workflows).
        if len(flat) != episode_rewards.numel():
            raise ValueError("algorithm.overlongPenalty shapes single-turn jobs only, and this "
                             "batch holds episodes of several samples: turn it off "
                             "(overlongPenalty.bufferTokens: 0) for episode workflows")
        rewards = rewards - length_penalties(flat, algorithm, max_new_tokens)
        shaped_episodes = episode_rewards.flatten().index_put(
            (episode_of_sample,), rewards).view_as(episode_rewards)
    advantages = episode_advantages(
        rewards, episode_of_sample, shaped_episodes, algorithm.advantage_estimator,
        algorithm.batch_norm_advantages,
    ) * aggregation_weights(torch.tensor([int(m.sum()) for m in masks]),
                            algorithm.loss_aggregation)
    samples = []
    for sample, mask, advantage in zip(flat, masks, advantages):
        prompt, response = list(sample.prompt_ids), list(sample.response_ids)
        ids = torch.tensor(prompt + response)
        behaviour = torch.zeros(len(ids))
        behaviour[len(prompt):] = torch.tensor(list(sample.behaviour_logprobs))
        versions = set(sample.token_versions)
        token_versions = None
        if len(sample.token_versions) == len(response):
            token_versions = torch.full((len(ids),), -1)
            token_versions[len(prompt):] = torch.tensor(list(sample.token_versions),
                                                        dtype=torch.long)
        samples.append(TrainSample(ids, mask, behaviour, float(advantage),
                                   versions.pop() if len(versions) == 1 else None,
                                   token_versions))
    return samples, episode_rewards


def length_penalties(samples, algorithm, max_new_tokens: int) -> torch.Tensor:
    """Each response's algorithm.overlongPenalty (asyncrl.algorithms.shaping)."""
    shaping = algorithm.overlong_penalty
    return overlong_penalties(torch.tensor([len(s.response_ids) for s in samples]),
                              max_new_tokens, shaping.buffer_tokens, shaping.factor)


def _episodes(groups) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's episode (its flat index group * groupSize + episode) and the [groups,
    groupSize] matrix of episode rewards, each its last sample's reward."""
    rewards = [episode_rewards(group.samples) for group in groups]
    if len({len(episodes) for episodes in rewards}) > 1:
        raise ValueError(f"the batch's groups hold different numbers of episodes "
                         f"({[len(episodes) for episodes in rewards]}): the buffer accepts "
                         f"algorithm.groupSize episodes per group")
    group_size = len(rewards[0]) if rewards else 0
    places = [index * group_size + episode for index, group in enumerate(groups)
              for episode in episode_of_each(group.samples)]
    return torch.tensor(places, dtype=torch.long), torch.tensor(rewards, dtype=torch.float32)


class Trainer:
    """One trainer process. Rank 0 (the leader, the only process outside torchrun) runs the
    loop with the buffer; the other ranks follow its commands (asyncrl.trainer.distributed)."""

    def __init__(self, settings: TrainerSettings, job: RLJob, group: TrainerGroup | None = None,
                 device: torch.device | None = None):
        """`job`: the manifest of `settings.job_file`, loaded once by the caller."""
        self.settings = settings
        self.group = group or TrainerGroup()
        self.device = device or select_device(job.spec.trainer.placement.gpus,
                                              self.group.local_rank)
        # The runner and the operator write the path taken; a job file written by hand may
        # still say auto (disk: the rollout is not known here), and ipc on a trainer without
        # a GPU is disk.
        job, reason = with_transfer_path(job, trainer_device=str(self.device))
        if reason and self.group.leader:
            log.warning("trainer.weightTransfer is ipc but %s: versions go to disk", reason)
        self.job, self.spec = job, job.spec
        spec = self.spec
        # float32 master weights whatever model.dtype says; bf16 is autocast (see step.py).
        self.model, self.tokenizer = load_policy(spec.model, dtype="float32", device=self.device)
        # With model.lora: peft's wrapper, whose adapter is all that is trained, saved and
        # published; its base is frozen in the compute dtype (no float32 copy, no casts).
        self.adapted = None
        if spec.model.lora is not None:
            compute = spec.trainer_compute_dtype
            if compute == "auto":
                compute = auto_compute_dtype(self.device)
            self.adapted = with_adapter(self.model, spec.model.lora, getattr(torch, compute))
            self.model = trained_model(self.adapted)
        # The Hugging Face model whose config and parameter names every snapshot and
        # checkpoint is written with, whichever backend trains (both read and write its
        # state dicts).
        self.hf_model = self.model
        self.tensor_parallel = 1  # ranks that compute on the same samples
        if spec.trainer.backend == "megatron":
            self.tensor_parallel = spec.trainer.megatron.tensor_parallel
            from asyncrl.trainer.megatron.policy import megatron_policy

            self.model = megatron_policy(spec, self.hf_model, self.device)
            self.hf_model = model_skeleton(self.hf_model.config)  # the weights are Megatron's now
        reference = reference_policy(spec, self.device)
        self.status = Status(max_steps=spec.algorithm.max_steps,
                             phase="starting" if self.group.leader else "following")
        self.metrics = TrainerMetrics(self.job.metadata.name)
        # Rank 0's experiment trackers (the job's tracking), each on its own thread.
        self.tracking = Tracking(self.job, settings.run_dir, self.metrics.observe_tracking_failure,
                                 uid=settings.job_uid) if self.group.leader else None
        # What each version moves to every engine (the adapter's tensors with model.lora),
        # listed from the whole model, before any sharding.
        self.version_tensors = version_manifest(self.hf_model, spec.model)
        self.version_bytes = sum(t.bytes for t in self.version_tensors)
        # Rank 0's alone, like the evaluator. Made early: the weight transfer group starts
        # forming in the background while the rest loads (asyncrl.trainer.weights_broadcast).
        self.publisher = Publisher(
            settings, spec, self.hf_model, self.device, self.version_tensors, self._on_compute,
            self.metrics, self.status) if self.group.leader else None
        self.sharded = spec.trainer.sharding == "fsdp" and self.group.distributed
        if self.sharded:
            for model in filter(None, (self.model, reference)):
                shard_model(model, self.device, self.group.world_size)
        elif spec.trainer.sharding == "fsdp":
            log.info("trainer.sharding fsdp with one process: nothing to shard")
        # The cores this process shares with its rollout worker (asyncrl run): lent while it
        # waits for a batch, borrowed back before each pass.
        self.lending = lending_from(settings.lend_cores_file, "trainer", settings.threads)
        self.updater = PolicyUpdater.from_spec(
            spec, self.model, reference,
            reference_off=self.adapted.disable_adapter if self.adapted is not None else None,
            before_pass=self.lending.fit if self.lending else None)
        self.optimizer = self.updater.optimizer
        self.metrics_file = settings.run_dir / "metrics.jsonl"
        self.heartbeat = heartbeat_seconds(settings.collective_timeout)
        # Every tensor operation of this process after loading runs on this one thread:
        # on a CPU a second thread doing tensor work would slow every small kernel (see
        # asyncrl.platform.openmp), so the loading thread's OpenMP workers go now.
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-compute")
        release_idle_thread_pools()
        # A whole transformers model in this one process: the evaluation may compute with it.
        whole = self.model is self.hf_model and not self.sharded and self.adapted is None
        self.evaluator = Evaluator(
            settings, self.job, self.tokenizer, self.device, self.model if whole else None,
            self._on_compute, self.status, self.lending) if self.group.leader else None

    async def run(self) -> None:
        if self.group.leader:
            await self._lead()
        else:
            await self._on_compute(self.follow)

    # ------------------------------------------------------------------ every rank

    def execute(self, command: Command):
        """Does one command of the leader's; every rank executes the same ones in order."""
        if command.kind == "restore":
            if command.path is None:
                return None
            checkpoint = read_checkpoint(Path(command.path), self.hf_model)
            if self.adapted is not None:
                load_adapter_state(self.adapted, checkpoint.model)
                load_full_state(self.model, self.optimizer, None, checkpoint.optimizer)
            else:
                load_full_state(self.model, self.optimizer, checkpoint.model,
                                checkpoint.optimizer)
            return checkpoint.state
        if command.kind == "step":
            stats = self.updater.step(command.samples, command.version, command.step)
            trim_heap()  # the step's activations, back to the system (see asyncrl.platform.heap)
            return stats
        if command.kind == "state":
            if self.adapted is not None:  # a copy: the next step updates the adapter in place
                return {name: t.clone() for name, t in adapter_state(self.adapted).items()}
            return full_model_state(self.model)
        if command.kind == "checkpoint":
            return full_optimizer_state(self.model, self.optimizer)
        return None  # wait, stop

    def follow(self) -> None:
        """A rank other than 0: executes the leader's commands until it says stop."""
        while True:
            command = self.group.receive()
            if command.kind == "stop":
                return  # its status stays "following": only rank 0's has figures
            self.execute(command)

    # ------------------------------------------------------------------ rank 0

    async def _command(self, command: Command | list[Command]):
        """Sends a command to every rank (or one per rank) and executes this rank's."""
        return await self._on_compute(lambda: self.execute(self.group.send(command)))

    async def _on_compute(self, work, *args, **kwargs):
        """`work(*args, **kwargs)` on the process's compute thread."""
        return await asyncio.get_running_loop().run_in_executor(
            self._compute, functools.partial(work, *args, **kwargs))

    @contextlib.asynccontextmanager
    async def _alone(self):
        """Rank 0 works alone (waits for the buffer, writes, evaluates): meanwhile the others,
        blocked in the command collective, get a heartbeat so they never reach its timeout."""
        if not self.group.distributed:
            yield
            return
        stop = asyncio.Event()

        async def beat() -> None:
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), self.heartbeat)
                except TimeoutError:
                    await asyncio.to_thread(self.group.send, WAIT)

        task = asyncio.create_task(beat())
        try:
            yield
        finally:
            stop.set()
            await task  # a heartbeat in flight completes before the next command is sent

    async def _lead(self) -> None:
        settings, spec = self.settings, self.spec
        client = BufferClient(settings.buffer_address, self.job.metadata.name,
                              outage_seconds=settings.outage_seconds)
        try:
            # Every rank loads the checkpoint rank 0 names, so all start from the same weights.
            latest = latest_checkpoint(settings.run_dir)
            restored = await self._command(Command("restore", path=str(latest) if latest else None))
            step = restored.step if restored else 0
            version = restored.version if restored else 0
            forget_records_after(self.metrics_file, restored.step if restored else None)
            async with self._alone():
                announced = (await client.stats()).trainer_version
            if announced > version:
                # Crashed after announcing a version newer than the last checkpoint: keep
                # versions moving forward and republish the restored weights under a new one.
                version = announced + 1
                state = await self._command(STATE)
                async with self._alone():
                    await self.publisher.publish(client, version, step, state)
            elif restored is not None and self.publisher.shared_weights is not None:
                # A shared buffer (ipc) does not outlive the trainer that wrote it: the engines
                # find the version announced before the restart only once this one holds it.
                state = await self._command(STATE)
                async with self._alone():
                    await self.publisher.publish(client, version, step, state)
            self.status.version, self.status.step = version, step
            self.metrics.observe_version(version)
            log.info("trainer starts at step %d, version %d (%d processes)", step, version,
                     self.group.world_size)
            self.tracking.start(resumed_step=step)
            if restored is None and self.evaluator.items:
                # The starting point every later evaluation is compared with.
                state = await self._command(STATE)
                async with self._alone():
                    self.status.phase = "evaluating"
                    evaluation = await self.evaluator.evaluate(state)
                    self.metrics.observe_eval(evaluation)
                    self._write({"kind": "eval", "step": 0, "version": version,
                                 "time": time.time(), "elapsed": 0.0, **evaluation})
            started = time.perf_counter()  # wall time of training, after the baseline evaluation
            while step < spec.algorithm.max_steps:
                self.status.phase = "waiting_for_batch"
                waiting = time.perf_counter()
                async with self._alone(), self._lending_cores():
                    batch = await self._next_batch(client)
                if batch is None:
                    break
                wait_seconds = time.perf_counter() - waiting
                self.status.waited_seconds_total += wait_seconds
                self.status.phase = "training"
                samples, rewards = samples_from_groups(batch.groups, spec.algorithm,
                                                       spec.rollout.max_new_tokens)
                stale = [staleness(version, _versions(g)) for g in batch.groups]
                shares = shares_per_rank(samples, self.group.world_size, self.tensor_parallel)
                stats = await self._command([Command("step", samples=s, version=version,
                                                     step=step) for s in shares])
                state = await self._command(STATE)
                step += 1
                version += 1
                # The job counts as done once its last step is announced (the operator's
                # Succeeded, `asyncrl run`'s end): that step's evaluation, record and
                # checkpoint come first, and it is announced after them.
                final = step == spec.algorithm.max_steps
                async with self._alone():
                    await client.ack(batch.batch_id)
                    self.status.phase = "publishing"
                    transfer, publish_seconds = await self.publisher.publish(
                        client, version, step, state, announce_step=not final)
                    record = {
                        "kind": "train", "step": step, "version": version, "time": time.time(),
                        "backend": spec.trainer.backend,
                        "compute_dtype": self.updater.config.compute_dtype,  # auto resolved
                        "elapsed": time.perf_counter() - started,
                        "reward_mean": float(rewards.mean()), "staleness": stale,
                        "staleness_mean": sum(stale) / len(stale),
                        "dropped_stale": batch.dropped_stale, "redelivered": batch.redelivered,
                        "wait_seconds": wait_seconds, "trained_samples": len(samples),
                        **response_shape(batch.groups),
                        **overlong_penalty_record(batch.groups, spec.algorithm,
                                                  spec.rollout.max_new_tokens),
                        "weight_transfer": transfer, "publish_seconds": publish_seconds,
                        "version_bytes": self.version_bytes, **stats,
                    }
                    if step % spec.trainer.eval_every == 0 or step == spec.algorithm.max_steps:
                        self.status.phase = "evaluating"
                        record.update(await self.evaluator.evaluate(state))
                    # Written before the checkpoint: a crash in between redoes the step and
                    # forget_records_after drops this record, so no step is recorded twice.
                    self._record(record)
                    if self.tracking.active:
                        self.tracking.log_rollout(step, await client.stats(), time.monotonic())
                if step % spec.trainer.checkpoint_every == 0 or step == spec.algorithm.max_steps:
                    await self._checkpoint(state, step, version)
                if final:
                    async with self._alone():
                        await client.set_version(version, self.publisher.published_uri,
                                                 step, final=True)
            if step < spec.algorithm.max_steps:
                await self._finish_used_up(client, step, version, started)
            await self._command(STOP)
            self.status.phase = "done"
        except BaseException:
            self.status.phase = "failed"
            raise
        finally:
            await client.close()
            await self.evaluator.close()
            if self.publisher is not None:
                self.publisher.close()
            await asyncio.to_thread(self.tracking.close)

    @contextlib.asynccontextmanager
    async def _lending_cores(self):
        """This process's threads lent to its rollout worker while it waits (if it shares
        cores with one)."""
        if self.lending is None:
            yield
            return
        self.lending.lend()
        try:
            yield
        finally:
            self.lending.reclaim()

    async def _next_batch(self, client: BufferClient):
        """The next batch of groups, once there is one; None once the dataset is used up and
        too few groups are left for a full batch (they are never trained)."""
        batch_size = self.spec.algorithm.batch_size
        while True:
            batch = await client.get_batch(self.settings.consumer, batch_size, wait_ms=2000)
            if batch.batch_id:
                return batch
            if no_batch_will_come(await client.stats(), batch_size):
                return None

    async def _finish_used_up(self, client: BufferClient, step: int, version: int,
                              started: float) -> None:
        """The dataset ran out before algorithm.maxSteps: the last step's weights become the
        final ones as at maxSteps (evaluated, checkpointed, then announced as final). The last
        step learnt only afterwards that it was the last, so what its own turn skipped is done
        now; a trainer restarted after that finds the job finished and does nothing again."""
        spec = self.spec
        async with self._alone():
            stats = await client.stats()
        if stats.trainer_finished and stats.trainer_step == step:
            return
        log.info("the dataset is used up (dataset.epochs: %d over %d prompts) at step %d of "
                 "%d, the job is done: %d group(s) left over, too few for a batch of %d, are "
                 "not trained",
                 stats.epochs, stats.prompts_per_epoch, step, spec.algorithm.max_steps,
                 stats.depth_groups, spec.algorithm.batch_size)
        evaluate = step % spec.trainer.eval_every != 0 and bool(self.evaluator.items)
        checkpoint = step % spec.trainer.checkpoint_every != 0
        if step > 0 and (evaluate or checkpoint):
            state = await self._command(STATE)
            if evaluate:
                async with self._alone():
                    self.status.phase = "evaluating"
                    evaluation = await self.evaluator.evaluate(state)
                    self.metrics.observe_eval(evaluation)
                    self._write({"kind": "eval", "step": step, "version": version,
                                 "time": time.time(), "elapsed": time.perf_counter() - started,
                                 **evaluation})
            if checkpoint:
                await self._checkpoint(state, step, version)
        elif step == 0:
            log.warning("the dataset was used up before a single full batch: nothing was "
                        "trained (raise dataset.epochs, or lower algorithm.batchSize)")
        async with self._alone():
            await client.set_version(version, self.publisher.published_uri, step,
                                     final=True)

    async def _checkpoint(self, state: dict, step: int, version: int) -> None:
        optimizer_state = await self._command(Command("checkpoint"))
        async with self._alone():
            await self._on_compute(save_checkpoint, self.hf_model, state, optimizer_state,
                                   self.settings.run_dir, TrainerState(step, version),
                                   lora=self.spec.model.lora,
                                   files=ModelFiles.of(self.job, self.hf_model, self.tokenizer))

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
        self.tracking.log(record)


def forget_records_after(metrics_file: Path, step: int | None) -> None:
    """On a (re)start: metrics.jsonl keeps the records of steps up to the restored
    checkpoint's, none without a checkpoint, since the steps after it are trained and recorded
    again. A line cut short by a crash goes too."""
    if not metrics_file.exists():
        return
    kept = []
    for line in metrics_file.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if step is not None and record.get("step", 0) <= step:
            kept.append(line + "\n")
    partial = metrics_file.with_name(f".{metrics_file.name}.partial")
    partial.write_text("".join(kept))
    partial.replace(metrics_file)


def no_batch_will_come(stats, batch_size: int) -> bool:
    """Whether the job's data is done (BufferStats, read in one go): every prompt of every
    epoch is used, so no group is accepted any more, fewer than `batch_size` groups wait,
    and no batch is out to a trainer (one past its ack timeout is delivered again)."""
    return (stats.dataset_used_up and stats.depth_groups < batch_size
            and stats.outstanding_batches == 0)


def response_shape(groups) -> dict[str, float]:
    """The mean length of a batch's responses (their tokens, model's and tools' alike) and
    the share of them cut at rollout.maxNewTokens (finish reason "length")."""
    samples = [sample for group in groups for sample in group.samples]
    if not samples:
        return {"response_length_mean": 0.0, "truncated_fraction": 0.0}
    return {
        "response_length_mean": sum(len(s.response_ids) for s in samples) / len(samples),
        "truncated_fraction": sum(s.finish_reason == "length" for s in samples) / len(samples),
    }


def overlong_penalty_record(groups, algorithm, max_new_tokens: int) -> dict[str, float]:
    """The batch's mean algorithm.overlongPenalty, where the job asks for one ({} if not)."""
    if not algorithm.overlong_penalty.buffer_tokens:
        return {}
    samples = [sample for group in groups for sample in group.samples]
    penalties = length_penalties(samples, algorithm, max_new_tokens)
    return {"overlong_penalty_mean": float(penalties.mean()) if samples else 0.0}


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
            eval_accuracy=s.eval_accuracy, eval_stderr=s.eval_stderr,
            waited_seconds_total=s.waited_seconds_total,
        )


def serve(settings: TrainerSettings) -> None:
    """One trainer process: the whole trainer, or one rank of it under torchrun. The status
    gRPC server runs on each node's local rank 0 (one per pod, so probes pass on every node;
    only rank 0's has figures), Prometheus metrics on rank 0 only."""
    if settings.threads:
        torch.set_num_threads(settings.threads)
    settings.run_dir.mkdir(parents=True, exist_ok=True)
    job = load_manifest(settings.job_file)
    device = select_device(job.spec.trainer.placement.gpus, local_rank())
    if under_torchrun():
        # A rank may be blocked in a collective (or in joining the group), which no Python
        # handler interrupts: SIGTERM (torchrun stopping the group after a rank died, or the
        # pod stopping) ends it at once, and the restart resumes from the checkpoint.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    group = TrainerGroup.from_environment(device, settings.collective_timeout)

    async def run() -> None:
        trainer = Trainer(settings, job, group, device)
        server = None
        if group.local_rank == 0:
            async def running() -> bool:
                return trainer.status.phase != "failed"

            server = await start_server(
                "trainer", f"{settings.host}:{settings.grpc_port}",
                lambda server: trainer_pb2_grpc.add_TrainerStatusServiceServicer_to_server(
                    StatusServicer(trainer.status), server),
                running)
        if group.leader and settings.metrics_port:
            trainer.metrics.serve(settings.metrics_port, settings.host)
        try:
            await trainer.run()
            if server is not None:
                await asyncio.sleep(1.0)  # let a watcher read the final status
        finally:
            if server is not None:
                await server.stop(grace=1)

    try:
        asyncio.run(run())
    except OutageTooLong as exc:
        raise SystemExit(f"trainer: {exc}") from None
    group.close()  # only after success: a failed rank exits and torchrun stops the rest
