"""SGLangEngine (the InferenceEngine over SGLang's HTTP API) against the torch engine's
SGLang-compatible server on a real loopback port.

The strongest check: after weight updates interrupt running requests, every token's
log-probability equals a full forward pass of the weights its version names, so versions are
exactly those that produced each token. It is run twice: with our per-token versions, and with
them stripped from the responses, as real SGLang answers (then the engine's pinned versions and
SGLang's per-request `weight_version` must be right on their own).
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncrl.engine.api import InferenceEngine
from asyncrl.rollout.http_api import create_app
from asyncrl.rollout.metrics import RolloutMetrics
from asyncrl.rollout.sglang_client import SGLangClient
from asyncrl.rollout.sglang_engine import SGLangEngine
from asyncrl.engine.types import SamplingParams
from support.rollout import WithoutPerTokenVersions, tiny_engine
from support.servers import HttpServer
from support.tiny_model import tiny_model, write_snapshot
from support.waiting import wait_for


@pytest.fixture(params=["per-token versions", "sglang-like versions"])
def server(request):
    engine = tiny_engine()
    app = create_app(engine, model_path="tiny-random", metrics=RolloutMetrics(job="t"))
    if request.param == "sglang-like versions":
        app = WithoutPerTokenVersions(app)
    with HttpServer(app) as served:
        yield served.url, engine
    engine.stop()


def run(scenario):
    return asyncio.run(asyncio.wait_for(scenario, timeout=300))


def expected_logprobs(result, models) -> list[float]:
    """log p(token i | prefix) under the model of token i's version (temperature 1)."""
    tokens = torch.tensor([result.prompt_ids + result.output_ids])
    prompt = len(result.prompt_ids)
    values = []
    with torch.no_grad():
        logits = {v: torch.log_softmax(m(tokens).logits[0].float(), -1) for v, m in models.items()}
    for i, (token, version) in enumerate(zip(result.output_ids, result.output_versions)):
        values.append(float(logits[version][prompt + i - 1, token]))
    return values


def test_generate_through_sglang_api(server):
    url, _ = server

    async def scenario():
        async with SGLangClient(url) as client:
            engine = SGLangEngine(client, max_running_requests=8, max_sequence_length=256)
            assert isinstance(engine, InferenceEngine)
            result = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=6))
            return result, engine.status()

    result, status = run(scenario())
    assert len(result.output_ids) == 6 and result.finish_reason == "length"
    assert result.output_versions == [0] * 6 and result.interruptions == 0
    assert status.generated_tokens_total == 6 and status.running_requests == 0
    models = {0: tiny_model(0)}
    assert result.output_logprobs == pytest.approx(expected_logprobs(result, models), abs=1e-4)


def test_weight_updates_interrupt_and_every_token_keeps_the_version_that_made_it(
    server, tmp_path
):
    url, torch_engine = server
    snapshots = {v: write_snapshot(tmp_path / f"v{v}/model.safetensors", seed=v) for v in (1, 2)}
    params = SamplingParams(max_new_tokens=60)

    async def scenario():
        async with SGLangClient(url) as client:
            engine = SGLangEngine(client, max_running_requests=8, max_sequence_length=256)
            requests = [asyncio.create_task(engine.generate([3 + i, 4, 5], params))
                        for i in range(4)]
            for version in (1, 2):
                # Land each update while the requests are generating.
                before = torch_engine.status().generated_tokens_total
                await asyncio.to_thread(
                    wait_for, lambda: torch_engine.status().generated_tokens_total >= before + 20,
                    60, "tokens to be generated")
                update = await engine.update_weights_from_disk(snapshots[version].parent, version)
                assert update.version == version and engine.version == version
            return await asyncio.gather(*requests), engine.status()

    results, status = run(scenario())
    models = {v: tiny_model(v) for v in (0, 1, 2)}
    spanning = 0
    for result in results:
        # Interrupted requests are resent and finish their whole budget.
        assert len(result.output_ids) == 60 and result.finish_reason == "length"
        assert result.output_versions == sorted(result.output_versions)
        spanning += len(set(result.output_versions)) > 1
        assert result.output_logprobs == pytest.approx(expected_logprobs(result, models),
                                                       abs=1e-4)
    assert spanning >= 1, [r.output_versions for r in results]
    assert status.interrupted_requests_total >= 1 and status.version == 2


def test_a_failed_update_keeps_the_version_and_generation_going(server, tmp_path):
    url, _ = server

    async def scenario():
        async with SGLangClient(url) as client:
            engine = SGLangEngine(client, max_running_requests=8, max_sequence_length=256)
            with pytest.raises(Exception, match="snapshot"):
                await engine.update_weights_from_disk(tmp_path / "missing", 1)
            result = await engine.generate([1, 2], SamplingParams(max_new_tokens=3))
            return engine.version, result

    version, result = run(scenario())
    assert version == 0 and result.output_versions == [0, 0, 0]
