"""LoRA (model.lora) with the SGLang engine: SGLang starts with LoRA enabled, each version is an
adapter loaded beside the base with /load_lora_adapter, each request names the adapter it is
sent to, and a replaced adapter is unloaded once no request uses it.

Against the torch engine's SGLang-compatible server on a loopback port, serving a LoRA job
(TorchEngine(lora=...)): every token's log-probability equals the trainer's, computed with the
adapter of the token's version unmerged. The bodies are checked against SGLang's own request
models in test_sglang_requests.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.engine.types import GenerationResult, SamplingParams
from asyncrl.launch.sglang import MAX_LORAS_PER_BATCH, sglang_launch_command
from asyncrl.model.lora import adapter_state, trained_model, write_adapter
from asyncrl.rollout.http_api import create_app
from asyncrl.rollout.metrics import RolloutMetrics
from asyncrl.rollout.sglang_client import (
    SGLangClient,
    SGLangError,
    adapter_name,
    adapter_version,
    generate_payload,
    load_adapter_payload,
    parse_generate_response,
    unload_adapter_payload,
)
from asyncrl.rollout.sglang_engine import SGLangEngine
from asyncrl.spec import load_manifest
from support import ROOT
from support.lora import LORA, trained_adapter
from support.rollout import (
    MAX_SEQUENCE_LENGTH,
    WithoutPerTokenVersions,
    recomputed_logprobs,
    tiny_engine,
)
from support.servers import HttpServer
from support.tiny_model import VOCAB, tiny_model, write_snapshot
from support.waiting import wait_for

BASE_SEED = 1  # trained_adapter's base
LOGPROB_TOLERANCE = 1e-4  # the engine's against the trainer, with or without an adapter


def run(scenario, timeout: float = 300):
    return asyncio.run(asyncio.wait_for(scenario, timeout=timeout))


def write_version(root: Path, version: int) -> Path:
    """Version `version`'s adapter as the trainer publishes it (a peft directory)."""
    directory = root / f"v{version:06d}"
    write_adapter(directory, adapter_state(trained_adapter(seed=version)), LORA)
    return directory


def policies(versions) -> dict:
    """What the trainer computes each version with: the base with that adapter unmerged
    (version 0: the base, as peft starts an adapter at B = 0)."""
    models = {v: trained_model(trained_adapter(seed=v)) for v in versions if v}
    return {0: tiny_model(BASE_SEED), **models}


def lora_engine() -> TorchEngine:
    return TorchEngine(tiny_model(BASE_SEED, VOCAB), max_running_requests=8,
                       max_sequence_length=MAX_SEQUENCE_LENGTH, seed=0, lora=LORA).start()


@pytest.fixture(params=["per-token versions", "sglang-like versions"])
def lora_server(request):
    """The stand-in serving a LoRA job; "sglang-like" answers as SGLang does with adapters:
    no per-token versions, and the base's weight version ("0") whatever adapter ran."""
    engine = lora_engine()
    app = create_app(engine, model_path="tiny-random", metrics=RolloutMetrics(job="t"))
    if request.param == "sglang-like versions":
        app = WithoutPerTokenVersions(app, weight_version="0")
    with HttpServer(app) as served:
        yield served.url, engine
    engine.stop()


async def is_loaded(client: SGLangClient, name: str) -> bool:
    """Whether the server runs a request that names adapter `name`."""
    try:
        await client.generate([1], SamplingParams(max_new_tokens=1), adapter=name, version=0)
    except SGLangError as refused:
        assert refused.status == 400 and "not loaded" in refused.message, refused
        return False
    return True


# --------------------------------------------------------------------------- bodies, launch


def test_adapter_bodies_use_sglang_names():
    assert adapter_name(12) == "v12" and adapter_version("v12") == 12
    assert adapter_version("policy") is None and adapter_version("v") is None
    assert load_adapter_payload("v3", "/run/weights/v000003") == {
        "lora_name": "v3", "lora_path": "/run/weights/v000003"}
    assert unload_adapter_payload("v3") == {"lora_name": "v3"}
    assert generate_payload([1, 2], SamplingParams(), "r", adapter="v3")["lora_path"] == "v3"
    assert "lora_path" not in generate_payload([1, 2], SamplingParams(), "r")


def test_a_request_that_named_an_adapter_is_its_version_whatever_sglang_reports():
    body = {"output_ids": [5, 6],
            "meta_info": {"id": "r", "finish_reason": {"type": "length", "length": 2},
                          "weight_version": "0",  # SGLang's base, with any adapter
                          "output_token_logprobs": [[-1.0, 5, None], [-2.0, 6, None]]}}
    parsed = parse_generate_response(body, prompt_ids=[1], rid="r", known_version=3,
                                     adapter_version=3)
    assert parsed.output_versions == [3, 3]
    # Our per-token versions, where a server reports them, still come first.
    body["meta_info"]["output_token_versions"] = [3, 4]
    assert parse_generate_response(body, prompt_ids=[1], rid="r",
                                   adapter_version=3).output_versions == [3, 4]


def test_the_launch_command_enables_lora_for_the_jobs_adapter():
    spec = load_manifest(ROOT / "examples" / "gpu-cluster.yaml").spec
    assert "--enable-lora" not in sglang_launch_command(spec, model_path="/m", port=1)
    spec.model.lora = LORA.model_copy(update={"rank": 32, "target_modules": ["q_proj", "v_proj"]})
    command = sglang_launch_command(spec, model_path="/m", port=1, extra_args=["--x"])
    assert "--enable-lora" in command
    assert command[command.index("--max-lora-rank") + 1] == "32"
    targets = command.index("--lora-target-modules")
    assert command[targets + 1:targets + 3] == ["q_proj", "v_proj"]
    assert command[command.index("--max-loras-per-batch") + 1] == str(MAX_LORAS_PER_BATCH)
    assert command[-1] == "--x"


# --------------------------------------------------------------------------- the stand-in


def test_the_stand_in_checks_adapter_requests_as_sglang_does(tmp_path):
    engine = lora_engine()
    app = create_app(engine, model_path="tiny-random", metrics=RolloutMetrics(job="t"))
    v1, v2 = write_version(tmp_path, 1), write_version(tmp_path, 2)
    not_an_adapter = write_snapshot(tmp_path / "full" / "model.safetensors", seed=3).parent

    async def scenario():
        async with SGLangClient(served.url) as client:
            await client.load_lora_adapter("v1", str(v1))
            with pytest.raises(SGLangError) as twice:
                await client.load_lora_adapter("v1", str(v2))
            with pytest.raises(SGLangError) as unknown:
                await client.generate([1, 2], SamplingParams(max_new_tokens=2),
                                      adapter="v7", version=7)
            with pytest.raises(SGLangError) as full:
                await client.load_lora_adapter("v2", str(not_an_adapter))
            with pytest.raises(SGLangError) as missing:
                await client.unload_lora_adapter("v7")
            served_v1 = await client.generate([1, 2], SamplingParams(max_new_tokens=2),
                                              adapter="v1", version=1)
            await client.unload_lora_adapter("v1")
            return twice.value, unknown.value, full.value, missing.value, served_v1, \
                await is_loaded(client, "v1")

    with HttpServer(app) as served:
        try:
            twice, unknown, full, missing, served_v1, still_loaded = run(scenario())
        finally:
            engine.stop()
    assert twice.status == 400 and "already loaded" in twice.message
    assert unknown.status == 400 and "'v7' is not loaded" in unknown.message
    assert full.status == 400 and "not a LoRA adapter directory" in full.message
    assert missing.status == 400 and "v7 does not exist" in missing.message
    assert served_v1.output_versions == [1, 1] and not still_loaded
    assert engine.version == 1  # the refused loads changed nothing


def test_a_server_without_an_adapter_refuses_lora_requests(tmp_path):
    engine = tiny_engine()
    app = create_app(engine, model_path="tiny-random", metrics=RolloutMetrics(job="t"))

    async def scenario():
        async with SGLangClient(served.url) as client:
            with pytest.raises(SGLangError) as load:
                await client.load_lora_adapter("v1", str(write_version(tmp_path, 1)))
            with pytest.raises(SGLangError) as generate:
                await client.generate([1], SamplingParams(max_new_tokens=1), adapter="v1",
                                      version=1)
            return load.value, generate.value

    with HttpServer(app) as served:
        try:
            load, generate = run(scenario())
        finally:
            engine.stop()
    assert load.status == 400 and "LoRA is not enabled" in load.message
    assert generate.status == 400 and "LoRA is not enabled" in generate.message


# --------------------------------------------------------------------------- SGLangEngine


def test_each_version_is_an_adapter_and_every_token_has_its_adapters_logprob(
    lora_server, tmp_path
):
    url, torch_engine = lora_server
    versions = {v: write_version(tmp_path, v) for v in (1, 2)}
    params = SamplingParams(max_new_tokens=60)

    async def scenario():
        async with SGLangClient(url) as client:
            engine = SGLangEngine(client, max_running_requests=8, max_sequence_length=256,
                                  lora=True)
            requests = [asyncio.create_task(engine.generate([3 + i, 4, 5], params))
                        for i in range(4)]
            for version, path in versions.items():
                # Land each version while the requests are generating.
                before = torch_engine.status().generated_tokens_total
                await asyncio.to_thread(
                    wait_for, lambda: torch_engine.status().generated_tokens_total >= before + 20,
                    60, "tokens to be generated")
                update = await engine.update_weights_from_disk(path, version)
                assert update.version == version == engine.version
            results = await asyncio.gather(*requests)
            after = await engine.generate([9, 9], SamplingParams(max_new_tokens=8))
            # The replaced adapter goes once its last request has returned.
            while await is_loaded(client, "v1"):
                await asyncio.sleep(0.05)
            return results + [after], await is_loaded(client, "v2"), engine.status()

    results, v2_loaded, status = run(scenario())
    models = policies((0, 1, 2))
    spanning = 0
    for result in results:
        assert result.output_versions == sorted(result.output_versions)
        spanning += len(set(result.output_versions)) > 1
        torch.testing.assert_close(
            torch.tensor(result.output_logprobs),
            recomputed_logprobs(models, result.prompt_ids, result.output_ids,
                                result.output_versions),
            atol=LOGPROB_TOLERANCE, rtol=0)
    assert all(len(r.output_ids) == 60 for r in results[:-1])
    assert results[-1].output_versions == [2] * 8
    assert spanning >= 1 and status.interrupted_requests_total >= 1
    assert v2_loaded and status.version == 2


def test_a_failed_adapter_load_keeps_the_version_and_its_adapter(lora_server, tmp_path):
    url, _ = lora_server
    v1 = write_version(tmp_path, 1)

    async def scenario():
        async with SGLangClient(url) as client:
            engine = SGLangEngine(client, max_running_requests=8, max_sequence_length=256,
                                  lora=True)
            await engine.update_weights_from_disk(v1, 1)
            with pytest.raises(SGLangError, match="not a LoRA adapter directory"):
                await engine.update_weights_from_disk(tmp_path / "missing", 2)
            result = await engine.generate([1, 2], SamplingParams(max_new_tokens=3))
            return engine.version, result, await is_loaded(client, "v1")

    version, result, v1_loaded = run(scenario())
    assert version == 1 and result.output_versions == [1, 1, 1] and v1_loaded


class RecordingServer:
    """An SGLangClient double that records what the engine asks, and holds each generate
    until the test lets it return: when a request returns is the test's to choose."""

    def __init__(self):
        self.version = 0
        self.calls: list[tuple] = []
        self.release = asyncio.Event()

    async def generate(self, input_ids, params, rid=None, *, version=None, adapter=None):
        self.calls.append(("generate", adapter))
        await self.release.wait()
        return GenerationResult(rid, list(input_ids), [7], [-1.0], [version], "length")

    async def pause(self, mode):
        self.calls.append(("pause", mode))

    async def resume(self):
        self.calls.append(("continue",))

    async def load_lora_adapter(self, name, path):
        self.calls.append(("load", name))

    async def unload_lora_adapter(self, name):
        self.calls.append(("unload", name))


def test_a_replaced_adapter_is_unloaded_only_once_no_request_uses_it():
    async def scenario():
        server = RecordingServer()
        engine = SGLangEngine(server, max_running_requests=4, max_sequence_length=64,
                              lora=True)
        await engine.update_weights_from_disk(Path("/w/v1"), 1)
        assert server.calls == [("pause", "abort"), ("load", "v1"), ("continue",)]
        using_v1 = asyncio.create_task(engine.generate([1], SamplingParams(max_new_tokens=1)))
        await asyncio.sleep(0)
        await engine.update_weights_from_disk(Path("/w/v2"), 2)
        assert ("unload", "v1") not in server.calls  # a request still names it
        using_v2 = asyncio.create_task(engine.generate([1], SamplingParams(max_new_tokens=1)))
        await asyncio.sleep(0)
        server.release.set()
        await asyncio.gather(using_v1, using_v2)
        for _ in range(10):  # its last request's return unloads it, in the background
            await asyncio.sleep(0)
        assert server.calls.count(("unload", "v1")) == 1
        await engine.update_weights_from_disk(Path("/w/v3"), 3)  # v2 is unused: at once
        assert server.calls[-1] == ("unload", "v2")
        return server.calls, using_v1.result(), using_v2.result()

    calls, first, second = run(scenario(), timeout=30)
    assert [c for c in calls if c[0] == "generate"] == [("generate", "v1"), ("generate", "v2")]
    assert first.output_versions == [1] and second.output_versions == [2]


def test_no_adapter_comes_by_broadcast():
    async def scenario():
        engine = SGLangEngine(RecordingServer(), max_running_requests=1, max_sequence_length=8,
                              lora=True)
        with pytest.raises(RuntimeError, match="from disk"):
            await engine.join_weight_transfer(None, 1)

    run(scenario(), timeout=30)
