"""`asyncrl serve rollout`: one rollout worker process.

Loads the job's model into a torch engine, serves the SGLang-compatible HTTP API and the gRPC
control API, and follows the policy versions the trainer announces in Redis.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from pathlib import Path

import redis.asyncio as redis
import torch
import uvicorn
from pydantic import Field

from asyncrl.buffer.client import BufferClient
from asyncrl.models import load_policy
from asyncrl.prompts import ArithScorer, build_prompts
from asyncrl.reward.client import PromptScorer, RewardClient
from asyncrl.rollout.engine import TorchEngine
from asyncrl.rollout.grpc_control import serve_control
from asyncrl.rollout.http_api import create_app
from asyncrl.rollout.metrics import RolloutMetrics
from asyncrl.rollout.types import SamplingParams
from asyncrl.rollout.weight_sync import WeightWatcher, engine_applier
from asyncrl.rollout.workflow import EngineGenerator, RolloutWorkflow
from asyncrl.settings import ServiceSettings
from asyncrl.spec import load_manifest

log = logging.getLogger(__name__)


class RolloutSettings(ServiceSettings):
    http_port: int = Field(default=30000, ge=1, le=65535, description="SGLang-compatible HTTP API.")
    grpc_port: int = Field(default=50061, ge=1, le=65535, description="RolloutControl gRPC API.")
    max_running_requests: int | None = Field(
        default=None, ge=1,
        description="Engine batch slots (default: this replica's share of "
        "rollout.maxConcurrentRollouts x algorithm.groupSize).",
    )
    max_sequence_length: int | None = Field(
        default=None, ge=16,
        description="Prompt + response cap (default: longest prompt + rollout.maxNewTokens).",
    )
    weights_cache: Path = Field(
        default=Path("/tmp/asyncrl-weights"), description="Where HTTP weight snapshots land."
    )
    poll_seconds: float = Field(default=5.0, gt=0, description="Version re-read interval.")
    buffer_address: str | None = Field(
        default=None, description="host:port of the buffer; when set, the worker runs the "
        "rollout workflow (prompts -> groups -> buffer), otherwise it only serves requests."
    )
    worker: str = Field(default="rollout-0", description="Stable worker name (the pod's name).")
    reward_address: str | None = Field(
        default=None, description="host:port of the reward service; without it, arithmetic "
        "answers are checked in-process (integer match) and code jobs cannot run."
    )


def serve(settings: RolloutSettings) -> None:
    if settings.threads:
        torch.set_num_threads(settings.threads)
    job = load_manifest(settings.job_file)
    if job.spec.rollout.engine != "torch":
        raise SystemExit(
            "serve rollout runs the torch engine; rollout.engine sglang launches SGLang "
            "(asyncrl.rollout.sglang_launch), which needs a GPU"
        )
    model, tokenizer = load_policy(job.spec.model)
    spec = job.spec
    # The KV cache is preallocated: size it to what the job can ask of this replica.
    slots = settings.max_running_requests or -(
        -spec.rollout.max_concurrent_rollouts * spec.algorithm.group_size // spec.rollout.replicas
    )
    train, _ = build_prompts(spec, tokenizer)
    length = settings.max_sequence_length or (
        max(len(item.prompt_ids) for item in train) + spec.rollout.max_new_tokens
    )
    engine = TorchEngine(
        model,
        max_running_requests=slots,
        max_sequence_length=length,
        eos_token_ids=tuple(t for t in (tokenizer.eos_token_id,) if t is not None),
        seed=job.spec.dataset.seed,
    ).start()
    metrics = RolloutMetrics(job.metadata.name)
    control = serve_control(engine, settings.grpc_port, metrics, host=settings.host)
    app = create_app(engine, model_path=job.spec.model.source, metrics=metrics)
    workflow = (
        _workflow_factory(settings, job, engine, tokenizer, train, metrics)
        if settings.buffer_address else None
    )
    try:
        asyncio.run(_serve_async(settings, job.metadata.name, engine, app, workflow, metrics))
    finally:
        control.stop(grace=2)
        engine.stop()


def _workflow_factory(settings: RolloutSettings, job, engine, tokenizer, train, metrics):
    """The workflow coroutine: training prompts, round and round, from where the job was."""

    async def run() -> None:
        spec = job.spec
        client = BufferClient(settings.buffer_address, job.metadata.name, settings.worker,
                              lease_seconds=spec.buffer.lease_seconds)
        # Prompts already used = groups accepted so far (a restart continues the sequence).
        start = (await client.stats()).accepted_total % len(train)
        prompts = itertools.islice(itertools.cycle(train), start, None)
        rollout = spec.rollout
        reward = RewardClient(settings.reward_address, job.metadata.name) if settings.reward_address else None
        scorer = PromptScorer(reward, tokenizer) if reward else ArithScorer(tokenizer, spec.reward.math.extract)
        workflow = RolloutWorkflow(
            prompts,
            generator=EngineGenerator(engine, metrics),
            scorer=scorer,
            gate=client,
            group_size=spec.algorithm.group_size,
            params=SamplingParams(
                max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                top_p=rollout.top_p, top_k=rollout.top_k,
            ),
        )
        try:
            await workflow.run()
        finally:
            await client.close()
            if reward:
                await reward.close()

    return run


async def _serve_async(settings: RolloutSettings, job: str, engine, app, workflow=None,
                       metrics: RolloutMetrics | None = None) -> None:
    server = uvicorn.Server(
        uvicorn.Config(app, host=settings.host, port=settings.http_port, log_level="warning")
    )
    watcher_task = None
    client = None
    if settings.redis_url:
        client = redis.from_url(settings.redis_url)
        watcher = WeightWatcher(
            client, job, engine_applier(engine, settings.weights_cache, metrics),
            current_version=engine.version, poll_seconds=settings.poll_seconds,
        )
        watcher_task = asyncio.create_task(watcher.run())
    serving = asyncio.create_task(server.serve())
    tasks = {serving}
    if workflow is not None:
        tasks.add(asyncio.create_task(workflow()))
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # a failed workflow stops the worker with its error
    finally:
        server.should_exit = True
        for task in tasks:
            if not task.done() and task is not serving:
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if watcher_task:
            watcher_task.cancel()
        if client:
            await client.aclose()
