"""`asyncrl serve rollout`: one rollout worker process.

The worker drives one inference engine (`rollout.engine`): the torch engine in this process,
behind an SGLang-compatible HTTP API, or an SGLang server it launches as a child process and
drives over SGLang's HTTP API (its own HTTP port then serves /health and /metrics). Either way
it runs the rollout workflow against the buffer, follows the policy versions the trainer
announces in Redis, and serves the RolloutControl gRPC status API. If the SGLang child dies,
the worker exits non-zero with SGLang's last output, so Kubernetes restarts the pod. While
Redis or the buffer is unreachable it waits (GET /ready answers 503 meanwhile), and exits
non-zero only past the outage bound (`outage_seconds`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
from dataclasses import replace
from typing import Coroutine

import torch
import uvicorn
from fastapi import FastAPI

from asyncrl.clients.buffer import BufferClient
from asyncrl.platform.core_lending import lending_from
from asyncrl.platform.devices import local_rank, resolve_dtype, select_device
from asyncrl.platform.heap import reuse_large_blocks
from asyncrl.model.policy import load_policy, load_tokenizer, model_directory
from asyncrl.platform.outage import Outage, OutageTooLong, connect, redis_address
from asyncrl.data.prompt_order import PromptOrder
from asyncrl.data.prompts import build_prompts, rollout_sequence_length
from asyncrl.clients.reward import reward_scorer
from asyncrl.evaluation import job_scorer
from asyncrl.engine.kv_cache import slot_bytes, slots_that_fit
from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.engine.api import InferenceEngine, TorchInferenceEngine
from asyncrl.rollout.grpc_control import serve_control
from asyncrl.rollout.http_api import create_app, health_and_metrics
from asyncrl.rollout.openai_api import openai_router
from asyncrl.rollout.metrics import RolloutMetrics
from asyncrl.rollout.sglang_client import SGLangClient
from asyncrl.rollout.sglang_engine import SGLangEngine
from asyncrl.launch.sglang import (
    SGLangServer,
    SGLangUnavailableError,
    groups_per_replica,
    max_running_requests,
    sglang_launch_command,
)
from asyncrl.engine.types import SamplingParams
from asyncrl.rollout.weights_receiver import (
    IpcReceiver,
    TransferMember,
    WeightWatcher,
    engine_applier,
)
from asyncrl.weights.distributed import backend as transfer_backend
from asyncrl.weights.distributed import directory_manifest, engine_ranks, version_manifest
from asyncrl.weights.paths import with_transfer_path
from asyncrl.rollout.workflow import EngineGenerator, RolloutWorkflow, SingleTurnGroups
from asyncrl.rollout.episode_record import EpisodeBook
from asyncrl.rollout.episodes import (
    EpisodeFunctionError,
    EpisodeGroups,
    EpisodeSettings,
    load_episode_function,
)
from asyncrl.platform.settings import RolloutSettings
from asyncrl.spec import load_manifest

log = logging.getLogger(__name__)


def serve(settings: RolloutSettings) -> None:
    if settings.threads:
        torch.set_num_threads(settings.threads)
    # The runner and the operator write the weight transfer path taken; a job file written
    # by hand may still say auto, which knowing nothing of the trainer here is disk.
    job, _ = with_transfer_path(load_manifest(settings.job_file))
    spec = job.spec
    tokenizer = load_tokenizer(spec.model.source, spec.model.revision)
    train, _ = build_prompts(spec, tokenizer)
    # Engine capacity: what the job can ask of this replica.
    slots = settings.max_running_requests or max_running_requests(spec)
    length = settings.max_sequence_length or rollout_sequence_length(spec, train)
    metrics = RolloutMetrics(job.metadata.name)
    # Episode jobs: the function is loaded first, so one that cannot be fails the worker at
    # start; the book is where the OpenAI API records each episode's calls.
    episodes = _episodes(spec)
    workflow = (
        _workflow_factory(settings, job, tokenizer, train, metrics, episodes)
        if settings.buffer_address else None
    )
    # Shared by the weight watcher (which updates it) and GET /ready (which reports it).
    redis_outage = Outage(
        f"Redis at {redis_address(settings.redis_url)}" if settings.redis_url else "Redis",
        settings.outage_seconds,
    )
    if _serves_sglang(settings, spec):
        serve_sglang = _serve_sglang(settings, job, slots, length, metrics, workflow, redis_outage,
                                     tokenizer, episodes)
        try:
            asyncio.run(serve_sglang)
        except (SGLangExited, SGLangUnavailableError, TimeoutError, RuntimeError) as exc:
            # Non-zero with SGLang's own last lines, so the pod restarts with the cause logged.
            raise SystemExit(f"rollout: {exc}") from None
        return
    # cuda:<local rank> when the job gives rollout pods GPUs and CUDA is here, else the CPU;
    # weights and KV cache in rollout.computeDtype (log-probabilities are computed in float32).
    device = select_device(spec.rollout.placement.gpus, local_rank())
    dtype = resolve_dtype(spec.rollout_compute_dtype, device)
    log.info("the engine computes in %s (%s)", dtype,
             f"rollout.computeDtype {spec.rollout.compute_dtype}" if spec.rollout.compute_dtype
             else "model.dtype")
    model, _ = load_policy(spec.model, dtype=dtype, device=device)
    slots = _slots_within_memory(spec, model, slots, length, device)
    # Logits and sampling buffers of MBs every decode step, served from the heap instead of
    # mapped and faulted in afresh (see asyncrl.platform.heap).
    reuse_large_blocks()
    torch_engine = TorchEngine(
        model,
        max_running_requests=slots,
        max_sequence_length=length,
        eos_token_ids=tuple(t for t in (tokenizer.eos_token_id,) if t is not None),
        seed=spec.dataset.seed,
        lora=spec.model.lora,
        # The cores this process shares with the trainer (asyncrl run): lent while the engine
        # has nothing to generate, borrowed back before each step.
        lending=lending_from(settings.lend_cores_file, "rollout", settings.threads),
    ).start()
    engine = TorchInferenceEngine(torch_engine)
    transfer = transfer_member(settings, spec, engine,
                               lambda dtype: version_manifest(model, spec.model))
    ipc = IpcReceiver(torch_engine, device) if spec.trainer.weight_transfer == "ipc" else None
    control = serve_control(engine, settings.grpc_port, host=settings.host,
                            ready=lambda: redis_outage.available)
    app = create_app(torch_engine, model_path=spec.model.source, metrics=metrics,
                     ready=lambda: redis_outage.available, tokenizer=tokenizer,
                     **_episode_api(spec, episodes))
    try:
        asyncio.run(_serve_async(settings, job.metadata.name, engine, app, workflow, metrics,
                                 redis_outage=redis_outage, transfer=transfer, ipc=ipc))
    except OutageTooLong as exc:
        raise SystemExit(f"rollout: {exc}") from None
    finally:
        control.stop(grace=2)
        torch_engine.stop()


def _slots_within_memory(spec, model, slots: int, length: int, device: torch.device) -> int:
    """The engine's slots, fewer where rollout.kvCacheMemoryFraction of the device's memory
    does not hold them all."""
    fraction = spec.rollout.kv_cache_memory_fraction
    if fraction is None:
        return slots
    total = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
             else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    per_slot = slot_bytes(model.config, length, next(model.parameters()).dtype)
    fitting = slots_that_fit(slots, int(fraction * total), per_slot)
    if fitting < slots:
        log.warning("rollout.kvCacheMemoryFraction %.2f of %s's %.1f GiB holds %d of the %d "
                    "requests the job can ask at once (%.0f MiB each): the engine runs %d, the "
                    "others wait", fraction, device, total / 2**30, fitting, slots,
                    per_slot / 2**20, fitting)
    return fitting


class SGLangExited(RuntimeError):
    """The SGLang server this worker launched is gone."""


def sglang_command(settings: RolloutSettings, spec) -> list[str]:
    """The SGLang server's command line: `settings.sglang_command` with {port} and
    {model_path} filled in when set, else `python -m sglang.launch_server ...` for the job."""
    model_path = str(model_directory(spec.model))
    if settings.sglang_command:
        return [part.format(port=settings.sglang_port, model_path=model_path)
                for part in shlex.split(settings.sglang_command)]
    return sglang_launch_command(spec, model_path=model_path, port=settings.sglang_port,
                                 host="127.0.0.1", seed=spec.dataset.seed,
                                 mem_fraction_static=spec.rollout.kv_cache_memory_fraction)


async def _serve_sglang(settings: RolloutSettings, job, slots: int, length: int,
                        metrics: RolloutMetrics, workflow, redis_outage: Outage,
                        tokenizer, episodes) -> None:
    server = SGLangServer(sglang_command(settings, job.spec),
                          url=f"http://127.0.0.1:{settings.sglang_port}",
                          startup_timeout=settings.sglang_startup_seconds)
    log.info("launching SGLang: %s", " ".join(server.command))
    await asyncio.to_thread(server.start)
    control = None
    try:
        async with SGLangClient(server.url) as client:
            engine = SGLangEngine(client, max_running_requests=slots, max_sequence_length=length,
                                  lora=job.spec.model.lora is not None)
            control = serve_control(engine, settings.grpc_port, host=settings.host,
                                    ready=lambda: redis_outage.available)
            app = status_app(engine, metrics, ready=lambda: redis_outage.available)
            # The OpenAI-compatible API over SGLang's generation, as the torch worker serves it.
            app.include_router(openai_router(engine.generate, tokenizer,
                                             model_name=job.spec.model.source,
                                             max_sequence_length=length,
                                             **_episode_api(job.spec, episodes)))
            transfer = transfer_member(
                settings, job.spec, engine,
                lambda dtype: directory_manifest(model_directory(job.spec.model), dtype))
            await _serve_async(settings, job.metadata.name, engine, app, workflow, metrics,
                               watch=_watch_sglang(server, client, engine),
                               redis_outage=redis_outage, transfer=transfer)
    finally:
        if control is not None:
            control.stop(grace=2)
        await asyncio.to_thread(server.stop)


async def _watch_sglang(server: SGLangServer, client: SGLangClient, engine: SGLangEngine,
                        interval: float = 2.0) -> None:
    """Keeps the engine's health equal to SGLang's; raises SGLangExited when the server
    process ends, which stops the worker."""
    while True:
        code = server.returncode
        if code is not None:
            engine.set_healthy(False)
            raise SGLangExited(f"SGLang exited with code {code}; last output:\n{server.log_tail}")
        engine.set_healthy(await client.health())
        await asyncio.sleep(interval)


def transfer_member(settings: RolloutSettings, spec, engine: InferenceEngine,
                    manifest) -> TransferMember | None:
    """This worker's end of the distributed weight transfer, when the job uses it;
    `manifest(dtype)` lists the engine's tensors."""
    if spec.trainer.weight_transfer != "distributed":
        return None
    if not settings.weights_address:
        log.warning("trainer.weightTransfer is distributed but this worker has no "
                    "--weights-address: it loads every version from disk")
        return None
    rollout = spec.rollout
    return TransferMember(engine, settings.weights_address,
                          engine_ranks(rollout.engine, rollout.placement.gpus),
                          transfer_backend(spec), manifest(getattr(torch, spec.model.dtype)))


def status_app(engine: InferenceEngine, metrics: RolloutMetrics,
               ready=lambda: True) -> FastAPI:
    """The worker's own HTTP front when SGLang serves generation: /health (SGLang's health
    and the worker's), /ready and /metrics (the OpenAI-compatible API is added beside them)."""
    app = FastAPI(title="asyncrl rollout (SGLang engine)")
    app.include_router(health_and_metrics(engine, metrics, ready))
    return app


def _episodes(spec) -> tuple | None:
    """(the episode function, the book of running episodes) for an episode job, else None."""
    workflow = spec.rollout.workflow
    if workflow.kind != "episode":
        return None
    path = os.path.abspath(workflow.path) if workflow.path else None
    # Every call of every episode is an in-process HTTP request: not a log line each.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return load_episode_function(workflow.function, path), EpisodeBook()
    except EpisodeFunctionError as exc:
        raise SystemExit(f"rollout: {exc}") from None


def _episode_api(spec, episodes) -> dict:
    """The OpenAI router's options for the job's episodes (none for a single-turn job)."""
    if episodes is None:
        return {}
    return {"episodes": episodes[1], "episode_sampling": SamplingParams.from_spec(spec)}


def _serves_sglang(settings: RolloutSettings, spec) -> bool:
    """Whether this worker generates with SGLang (rather than the torch engine)."""
    return (settings.engine or spec.rollout.engine) == "sglang"


def _workflow_factory(settings: RolloutSettings, job, tokenizer, train, metrics, episodes):
    """The workflow coroutine over an engine: the prompts the buffer hands out with each slot
    (each once per epoch across every replica and restart), until every epoch's are used.
    The worker then keeps serving, idle, until it is stopped: a process that ended would be
    started again by its Deployment (or fail `asyncrl run`), only to be told the same."""

    async def run(engine: InferenceEngine, app) -> None:
        spec = job.spec
        # N goes to the buffer with each slot asked for: the buffer keeps the first worker's,
        # and refuses a worker whose dataset counts otherwise.
        client = BufferClient(settings.buffer_address, job.metadata.name, settings.worker,
                              lease_seconds=spec.buffer.lease_seconds,
                              outage_seconds=settings.outage_seconds, prompts=len(train))
        prompts = PromptOrder(train, spec.dataset.seed)
        reward = reward_scorer(settings.reward_address, job.metadata.name, spec.reward)
        if episodes is not None:  # the episode scores itself; `app` serves its calls
            function, book = episodes
            source = EpisodeGroups(function, book, app, EpisodeSettings.from_spec(spec),
                                   on_episode=metrics.observe_episode)
        else:
            source = SingleTurnGroups(
                generator=EngineGenerator(engine, metrics),
                scorer=job_scorer(reward, spec, tokenizer, training=True),
                group_size=spec.algorithm.group_size,
                # Each response its own stream: what a group samples does not depend on
                # the machine's load (SGLang's sampler keeps its own; docs/sglang.md).
                params=replace(SamplingParams.from_spec(spec),
                               seed=None if _serves_sglang(settings, spec) else spec.dataset.seed),
            )
        workflow = RolloutWorkflow(
            prompts,
            source=source,
            gate=client,
            skip_uniform=spec.algorithm.skip_uniform_groups,
            on_skipped=lambda _group: metrics.observe_skipped_group(),
            on_dropped=lambda _item: metrics.observe_dropped_prompt("too_long"),
            max_in_flight=groups_per_replica(spec),
        )
        try:
            await workflow.run()
        finally:
            await client.close()
            await reward.close()
        log.info("every prompt is used (dataset.epochs: %d over %d prompts): this worker "
                 "generates no more, and serves until it is stopped",
                 spec.dataset.epochs, len(train))
        await asyncio.Event().wait()

    return run


async def _after_catching_up(watcher: WeightWatcher | None, work: Coroutine) -> None:
    """Runs `work` (the workflow) once `watcher` has caught up with the announced version: a
    worker started mid-run (a scale out, a restart) generates on the current policy, not on
    the weights it loaded at start, whose samples the staleness bound would drop."""
    if watcher is not None:
        await watcher.caught_up.wait()
    await work


async def _serve_async(settings: RolloutSettings, job: str, engine: InferenceEngine, app,
                       workflow=None, metrics: RolloutMetrics | None = None,
                       watch: Coroutine | None = None,
                       redis_outage: Outage | None = None,
                       transfer: TransferMember | None = None,
                       ipc: IpcReceiver | None = None) -> None:
    """Serves `app`, follows announced versions and runs the workflow until one of them (or
    `watch`) ends; an error in any stops the worker with that error (OutageTooLong once
    Redis has been unreachable for longer than `redis_outage` allows)."""
    server = uvicorn.Server(
        uvicorn.Config(app, host=settings.host, port=settings.http_port, log_level="warning")
    )
    watcher_task = watcher = None
    client = None
    if settings.redis_url:
        client = connect(settings.redis_url)
        watcher = WeightWatcher(
            client, job, engine_applier(engine, settings.weights_cache, metrics, transfer, ipc),
            current_version=engine.version, poll_seconds=settings.poll_seconds,
            outage=redis_outage,
        )
        watcher_task = asyncio.create_task(watcher.run())
    serving = asyncio.create_task(server.serve())
    # Joining waits for the whole group (the trainer and every engine) while the worker serves,
    # and joins each later generation of it.
    joining = asyncio.create_task(transfer.run()) if transfer else None
    # A weight update that fails stops the worker too: serving an old version forever while
    # the trainer moves on would silently break the staleness bound.
    tasks = {serving} | ({watcher_task} if watcher_task else set())
    if workflow is not None:
        tasks.add(asyncio.create_task(_after_catching_up(watcher, workflow(engine, app))))
    if watch is not None:
        tasks.add(asyncio.create_task(watch))
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()  # a failed workflow stops the worker with its error
    finally:
        server.should_exit = True
        for task in tasks:
            if not task.done() and task is not serving:
                task.cancel()
        if joining is not None:
            joining.cancel()
        await asyncio.gather(*tasks, *filter(None, [joining]), return_exceptions=True)
        if client:
            await client.aclose()
