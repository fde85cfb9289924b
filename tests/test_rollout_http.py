"""The SGLang-compatible HTTP API over a real torch engine, served by uvicorn on a loopback
port and driven over real HTTP."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from rollout_helpers import (
    MAX_SEQUENCE_LENGTH,
    VOCAB,
    HttpServer,
    queued,
    tiny_engine,
    wait_for,
    write_snapshot,
)

from asyncrl.rollout.http_api import create_app
from asyncrl.rollout.metrics import RolloutMetrics

GREEDY = {"temperature": 0.0, "max_new_tokens": 6}


@pytest.fixture(scope="module")
def service():
    engine = tiny_engine()
    metrics = RolloutMetrics(job="test-job")
    app = create_app(engine, model_path="tiny-random", metrics=metrics)
    with HttpServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        yield client, engine, metrics
    engine.stop()


@pytest.fixture
def client(service):
    return service[0]


@pytest.fixture
def engine(service):
    return service[1]


@pytest.fixture
def background():
    with ThreadPoolExecutor(max_workers=4) as pool:
        yield pool


def generate(client, input_ids, **fields):
    response = client.post("/generate", json={"input_ids": input_ids, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def assert_still_serving(client):
    out = generate(client, [5, 6, 7], sampling_params={"max_new_tokens": 2})
    assert len(out["output_ids"]) == 2
    assert client.get("/health").status_code == 200


def test_generate_returns_sglang_shape(client, engine):
    out = generate(client, [1, 2, 3], sampling_params={"max_new_tokens": 5}, rid="single-1")
    assert set(out) == {"output_ids", "meta_info"}
    assert len(out["output_ids"]) == 5
    assert all(0 <= t < VOCAB for t in out["output_ids"])
    meta = out["meta_info"]
    assert meta["id"] == "single-1"
    assert meta["finish_reason"]["type"] == "length"
    assert meta["finish_reason"]["matched"] is None
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 5
    assert meta["weight_version"] == str(engine.version)
    assert meta["output_token_versions"] == [engine.version] * 5
    assert "output_token_logprobs" not in meta


def test_generate_batch_with_per_prompt_params(client):
    out = generate(
        client,
        [[1, 2], [3, 4, 5]],
        sampling_params=[{"max_new_tokens": 2}, {"max_new_tokens": 4}],
        rid="batch",
    )
    assert isinstance(out, list) and len(out) == 2
    assert [o["meta_info"]["id"] for o in out] == ["batch_0", "batch_1"]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [2, 3]
    assert [len(o["output_ids"]) for o in out] == [2, 4]

    shared = generate(client, [[1], [2], [3]], sampling_params={"max_new_tokens": 3})
    assert [len(o["output_ids"]) for o in shared] == [3, 3, 3]
    assert len({o["meta_info"]["id"] for o in shared}) == 3


def test_return_logprob_gives_one_triple_per_output_token(client):
    out = generate(client, [9, 8, 7], sampling_params={"max_new_tokens": 4}, return_logprob=True)
    triples = out["meta_info"]["output_token_logprobs"]
    assert [t[1] for t in triples] == out["output_ids"]
    assert all(t[0] <= 0.0 and t[2] is None for t in triples)


def test_greedy_generation_is_deterministic(client):
    first = generate(client, [4, 5, 6], sampling_params=GREEDY)
    batch = generate(client, [[4, 5, 6], [4, 5, 6]], sampling_params=GREEDY)
    assert batch[0]["output_ids"] == batch[1]["output_ids"] == first["output_ids"]


def test_stop_token_ends_generation_with_matched_id(client):
    # Sampled tokens; a third of the vocabulary stops (40 draws all missing it: ~1e-7).
    stops = list(range(0, VOCAB, 3))
    params = {"max_new_tokens": 40, "stop_token_ids": stops}
    out = generate(client, [3, 1, 4], sampling_params=params)
    tokens, reason = out["output_ids"], out["meta_info"]["finish_reason"]
    assert not set(tokens[:-1]) & set(stops)
    assert reason == {"type": "stop", "matched": tokens[-1]} and tokens[-1] in stops


def test_request_sent_while_paused_finishes_only_after_continue(client, engine, background):
    assert client.post("/pause_generation").json()["status"] == "ok"
    try:
        pending = background.submit(generate, client, [1, 2], sampling_params={"max_new_tokens": 3})
        wait_for(lambda: queued(engine) == 1, what="the request to be queued")
        with pytest.raises(TimeoutError):
            pending.result(timeout=0.3)
        assert engine.status().paused
    finally:
        assert client.post("/continue_generation").json()["status"] == "ok"
    assert len(pending.result(timeout=30)["output_ids"]) == 3


def test_update_weights_from_disk_switches_version_and_outputs(client, engine, tmp_path):
    before = generate(client, [2, 7, 1], sampling_params=GREEDY, return_logprob=True)
    new_version = engine.version + 1
    snapshot = write_snapshot(tmp_path / "v.safetensors", seed=1)
    response = client.post(
        "/update_weights_from_disk",
        json={"model_path": str(snapshot), "weight_version": str(new_version)},
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["success"] is True and body["weight_version"] == str(new_version)
    assert client.get("/get_model_info").json()["weight_version"] == str(new_version)

    after = generate(client, [2, 7, 1], sampling_params=GREEDY, return_logprob=True)
    assert after["meta_info"]["weight_version"] == str(new_version)
    assert after["meta_info"]["output_token_versions"] == [new_version] * 6
    # (A tiny random model with tied embeddings greedily repeats the last prompt token
    # whatever its seed, so the new weights show in the log-probabilities.)
    logprobs = "output_token_logprobs"
    assert after["meta_info"][logprobs] != before["meta_info"][logprobs]

    # Without a version, the next one is loaded; a directory holding model.safetensors works.
    write_snapshot(tmp_path / "dir" / "model.safetensors", seed=2)
    response = client.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "dir")})
    body = response.json()
    assert body["success"] is True and body["weight_version"] == str(new_version + 1)


def test_update_interrupts_a_running_request_which_resumes_under_new_weights(
    client, engine, background, tmp_path
):
    old = engine.version
    snapshot = write_snapshot(tmp_path / "model.safetensors", seed=3)
    tokens_before = engine.status().generated_tokens_total
    pending = background.submit(
        generate, client, [1, 2, 3], sampling_params={"max_new_tokens": 200}, rid="long"
    )
    wait_for(lambda: engine.status().generated_tokens_total > tokens_before + 2,
             what="the first tokens")
    client.post("/pause_generation", json={"mode": "in_place"})
    try:
        body = client.post(
            "/update_weights_from_disk", json={"model_path": str(snapshot), "version": old + 1}
        ).json()
        assert body["success"] is True and body["num_paused_requests"] == 1
    finally:
        client.post("/continue_generation")
    meta = pending.result(timeout=60)["meta_info"]
    versions = meta["output_token_versions"]
    assert len(versions) == 200 and versions == sorted(versions)
    assert versions[0] == old and versions[-1] == old + 1
    assert meta["weight_version"] == str(old + 1)


BAD_GENERATE = [
    pytest.param({"input_ids": []}, "input_ids", id="empty-input_ids"),
    pytest.param({"input_ids": [1, VOCAB + 10]}, "input_ids", id="token-outside-vocab"),
    pytest.param({"input_ids": ["a"]}, "input_ids", id="input_ids-wrong-type"),
    pytest.param({"input_ids": [1], "sampling_params": {"max_new_tokens": -1}},
                 "max_new_tokens", id="negative-max_new_tokens"),
    pytest.param({"input_ids": [1], "sampling_params": {"max_new_tokens": "3"}},
                 "max_new_tokens", id="max_new_tokens-wrong-type"),
    pytest.param({"input_ids": [1], "sampling_params": {"max_new_tokens": MAX_SEQUENCE_LENGTH}},
                 "max_new_tokens", id="too-long"),
    pytest.param({"input_ids": [1], "sampling_params": {"temperature": -1.0}},
                 "temperature", id="negative-temperature"),
    pytest.param({"input_ids": [1], "sampling_params": {"bogus": 1}}, "bogus", id="unknown-key"),
    pytest.param({"input_ids": [1], "sampling_params": {"min_p": 0.5}},
                 "min_p", id="unsupported-sampling-option"),
    pytest.param({"text": "hello"}, "input_ids", id="text-instead-of-input_ids"),
    pytest.param({"input_ids": [1], "stream": True}, "stream", id="stream"),
    pytest.param({"input_ids": [[1, 2], [1, VOCAB]]}, "batch item 1", id="bad-batch-item"),
    pytest.param({"input_ids": [1], "rid": ["a", "b"]}, "rid", id="rid-count"),
]


@pytest.mark.parametrize(("body", "named"), BAD_GENERATE)
def test_bad_generate_request_is_a_400_naming_the_field(client, engine, body, named):
    response = client.post("/generate", json=body)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert named in message
    assert queued(engine) == 0  # nothing of a refused request stays queued
    assert_still_serving(client)


def test_body_that_is_not_json_is_a_400(client):
    response = client.post(
        "/generate", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400
    assert "error" in response.json()
    assert_still_serving(client)


def test_bad_weight_updates_are_refused_and_the_old_weights_keep_serving(
    client, engine, tmp_path
):
    version = engine.version
    before = generate(client, [6, 6, 6], sampling_params=GREEDY, return_logprob=True)["meta_info"]
    before = before["output_token_logprobs"]
    corrupt = tmp_path / "corrupt.safetensors"
    corrupt.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    older = write_snapshot(tmp_path / "older.safetensors", seed=4)
    cases = [
        ({"model_path": str(older), "weight_version": str(version - 1)}, "version"),
        ({"model_path": str(corrupt)}, "model_path"),
        ({"model_path": str(tmp_path / "missing.safetensors")}, "model_path"),
        ({"model_path": str(older), "weight_version": "latest"}, "weight_version"),
        ({"weight_version": "9"}, "model_path"),
    ]
    for body, named in cases:
        response = client.post("/update_weights_from_disk", json=body)
        assert response.status_code == 400, (body, response.text)
        payload = response.json()
        message = payload.get("message") or payload["error"]["message"]
        assert named in message, (body, message)
        if "message" in payload:
            assert payload["success"] is False
    assert engine.version == version
    after = generate(client, [6, 6, 6], sampling_params=GREEDY, return_logprob=True)["meta_info"]
    assert after["output_token_logprobs"] == before


def test_abort_by_rid_and_abort_all(client, engine, background):
    client.post("/pause_generation", json={"mode": "in_place"})
    try:
        first = background.submit(generate, client, [1], rid="abort-me",
                                  sampling_params={"max_new_tokens": 5})
        second = background.submit(generate, client, [2], rid="and-me",
                                   sampling_params={"max_new_tokens": 5})
        wait_for(lambda: queued(engine) == 2, what="two queued requests")

        duplicate = client.post("/generate", json={"input_ids": [1], "rid": "abort-me"})
        assert duplicate.status_code == 400 and "rid" in duplicate.json()["error"]["message"]

        response = client.post("/abort_request", json={"rid": "abort-me"})
        assert response.status_code == 200 and response.json()["aborted_rids"] == ["abort-me"]
        meta = first.result(timeout=10)["meta_info"]
        assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] == 0

        assert client.post("/abort_request", json={}).status_code == 400
        response = client.post("/abort_request", json={"abort_all": True})
        assert response.json()["aborted_rids"] == ["and-me"]
        assert second.result(timeout=10)["meta_info"]["finish_reason"]["type"] == "abort"
    finally:
        client.post("/continue_generation")
    assert_still_serving(client)


def test_metrics_after_traffic(client, engine, tmp_path):
    generate(client, [[1, 2], [3]], sampling_params={"max_new_tokens": 3})
    snapshot = write_snapshot(tmp_path / "m.safetensors", seed=5)
    client.post("/update_weights_from_disk", json={"model_path": str(snapshot)})
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    samples = {
        (s.name, s.labels.get("finish_reason") or s.labels.get("result")): s
        for family in text_string_to_metric_families(response.text)
        for s in family.samples
    }
    names = {name for name, _ in samples}
    for name in (
        "asyncrl_rollout_generated_tokens_total",
        "asyncrl_rollout_requests_total",
        "asyncrl_rollout_interrupted_requests_total",
        "asyncrl_rollout_weight_updates_total",
        "asyncrl_rollout_policy_version",
        "asyncrl_rollout_running_requests",
        "asyncrl_rollout_waiting_requests",
        "asyncrl_rollout_weight_update_seconds_count",
        "asyncrl_rollout_request_seconds_count",
    ):
        assert name in names, name
    status = engine.status()
    assert samples[("asyncrl_rollout_generated_tokens_total", None)].value == \
        status.generated_tokens_total
    assert samples[("asyncrl_rollout_policy_version", None)].value == status.version
    assert samples[("asyncrl_rollout_requests_total", "length")].value >= 2
    assert samples[("asyncrl_rollout_weight_updates_total", "success")].value >= 1
    assert samples[("asyncrl_rollout_policy_version", None)].labels["rljob"] == "test-job"


def test_health_and_model_info(client, engine):
    assert client.get("/health").status_code == 200
    info = client.get("/get_model_info").json()
    assert info["model_path"] == "tiny-random" and info["is_generation"] is True
    assert info["weight_version"] == str(engine.version)


def test_health_is_503_when_the_engine_thread_is_not_running():
    engine = tiny_engine()
    engine.stop()
    app = create_app(engine, model_path="tiny-random", metrics=RolloutMetrics("test-job"))

    async def probe():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://rollout") as client:
            return (await client.get("/health")).status_code

    assert asyncio.run(probe()) == 503
