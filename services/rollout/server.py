"""`asyncrl serve rollout`: one rollout worker process.

Loads the job's model into a torch engine, serves the SGLang-compatible HTTP API and the gRPC
control API, and follows the policy versions the trainer announces in Redis.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import redis.asyncio as redis
import torch
import uvicorn
from pydantic import Field

from asyncrl.models import load_policy
from asyncrl.rollout.engine import TorchEngine
from asyncrl.rollout.grpc_control import serve_control
from asyncrl.rollout.http_api import create_app
from asyncrl.rollout.metrics import RolloutMetrics
from asyncrl.rollout.weight_sync import WeightWatcher, engine_applier
from asyncrl.settings import ServiceSettings
from asyncrl.spec import load_manifest

log = logging.getLogger(__name__)


class RolloutSettings(ServiceSettings):
    http_port: int = Field(default=30000, ge=1, le=65535, description="SGLang-compatible HTTP API.")
    grpc_port: int = Field(default=50061, ge=1, le=65535, description="RolloutControl gRPC API.")
    max_running_requests: int = Field(default=64, ge=1, description="Engine batch slots.")
    max_sequence_length: int = Field(default=2048, ge=16, description="Prompt + response cap.")
    weights_cache: Path = Field(
        default=Path("/tmp/asyncrl-weights"), description="Where HTTP weight snapshots land."
    )
    poll_seconds: float = Field(default=5.0, gt=0, description="Version re-read interval.")


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
    engine = TorchEngine(
        model,
        max_running_requests=settings.max_running_requests,
        max_sequence_length=settings.max_sequence_length,
        eos_token_ids=tuple(t for t in (tokenizer.eos_token_id,) if t is not None),
        seed=job.spec.dataset.seed,
    ).start()
    metrics = RolloutMetrics(job.metadata.name)
    control = serve_control(engine, settings.grpc_port, metrics, host=settings.host)
    app = create_app(engine, model_path=job.spec.model.source, metrics=metrics)
    try:
        asyncio.run(_serve_async(settings, job.metadata.name, engine, app))
    finally:
        control.stop(grace=2)
        engine.stop()


async def _serve_async(settings: RolloutSettings, job: str, engine, app) -> None:
    server = uvicorn.Server(
        uvicorn.Config(app, host=settings.host, port=settings.http_port, log_level="warning")
    )
    watcher_task = None
    client = None
    if settings.redis_url:
        client = redis.from_url(settings.redis_url)
        watcher = WeightWatcher(
            client, job, engine_applier(engine, settings.weights_cache),
            current_version=engine.version, poll_seconds=settings.poll_seconds,
        )
        watcher_task = asyncio.create_task(watcher.run())
    try:
        await server.serve()
    finally:
        if watcher_task:
            watcher_task.cancel()
        if client:
            await client.aclose()
