"""The SGLang-compatible HTTP API over a real torch engine, served by uvicorn on a loopback
port and driven over real HTTP."""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.rollout.http_api import create_app
from asyncrl.rollout.metrics import RolloutMetrics
from asyncrl.engine.types import SamplingParams
from support.rollout import MAX_SEQUENCE_LENGTH, queued, tiny_engine
from support.servers import HttpServer
from support.tiny_model import VOCAB, tiny_model, write_snapshot
from support.waiting import wait_for

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


def areal_generate_body(input_ids, **gconfig):
    """The /generate body AReaL 1.0.4's RemoteSGLangEngine sends
    (SGLangBackend.build_generation_request), from GenerationHyperparameters' defaults:
    top_k 1e8, stop_token_ids [], ignore_eos False, skip_special_tokens True,
    frequency_penalty 0.0, and ModelRequest.image_data's default []. AReaL clamps
    max_new_tokens to max_tokens - prompt length; it is given here to suit the tiny engine."""
    config = {"top_p": 1.0, "top_k": int(1e8), "max_new_tokens": 16384, "temperature": 1.0,
              "stop_token_ids": [], "ignore_eos": False, "skip_special_tokens": True,
              "frequency_penalty": 0.0, **gconfig}
    return {
        "input_ids": list(input_ids),
        "image_data": [],
        "sampling_params": config,
        "return_logprob": True,
        "stream": False,
    }


def write_sharded_snapshot(directory, seed, *, index=True):
    """A tiny model's weights as Hugging Face shards them: two model-0000x-of-00002
    .safetensors files and, with `index`, model.safetensors.index.json mapping each tensor to
    its shard. Tied embeddings appear once (lm_head.weight shares embed_tokens' storage)."""
    directory.mkdir(parents=True, exist_ok=True)
    model = tiny_model(seed, VOCAB)
    tensors, storages = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in storages:
            storages.add(tensor.data_ptr())
            tensors[name] = tensor.detach().clone().contiguous()
    names = list(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for file, part in shards.items():
        save_file({name: tensors[name] for name in part}, str(directory / file))
    if index:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map = {name: file for file, part in shards.items() for name in part}
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
        )
    return directory, shards


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
    pytest.param({"input_ids": [1], "image_data": ["https://example.com/cat.png"]},
                 "image_data", id="image_data-with-an-image"),
    pytest.param({"input_ids": [1], "audio_data": "clip.wav"}, "audio_data", id="audio_data"),
    pytest.param({"input_ids": [1], "sampling_params": {"frequency_penalty": 2.5}},
                 "frequency_penalty", id="frequency_penalty-out-of-range"),
    pytest.param({"input_ids": [1], "sampling_params": {"presence_penalty": -3.0}},
                 "presence_penalty", id="presence_penalty-out-of-range"),
    pytest.param({"input_ids": [1], "sampling_params": {"ignore_eos": "yes"}},
                 "ignore_eos", id="ignore_eos-wrong-type"),
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


# ---------------------------------------------------------------- what SGLang clients send


def test_areal_default_generate_body_is_accepted(client, engine):
    body = areal_generate_body([4, 8, 15, 16], max_new_tokens=8)
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    meta = response.json()["meta_info"]
    # Parsed as AReaL parses it: tokens and log-probabilities from output_token_logprobs.
    tokens = [t[1] for t in meta["output_token_logprobs"]]
    assert len(tokens) == 8 and meta["finish_reason"]["type"] == "length"
    assert all(t[0] <= 0.0 for t in meta["output_token_logprobs"])


@pytest.mark.parametrize(
    "empty",
    [{"image_data": []}, {"image_data": None}, {"image_data": ""}, {"image_data": [[]]},
     {"image_data": [None]}, {"video_data": []}, {"audio_data": []}],
    ids=["image[]", "image-null", "image-empty-string", "image[[]]", "image[null]",
         "video[]", "audio[]"],
)
def test_empty_multimodal_fields_are_absent(client, empty):
    out = generate(client, [1, 2, 3], sampling_params={"max_new_tokens": 2}, **empty)
    assert len(out["output_ids"]) == 2


@pytest.fixture(scope="module")
def eos_service():
    """A second server whose engine has an EOS token: the fourth token of the greedy
    continuation of EOS_PROMPT (found first on an engine without one)."""
    def model():
        return tiny_model(0, VOCAB)

    probe = TorchEngine(model(), max_running_requests=2, max_sequence_length=64, seed=0).start()
    try:
        params = SamplingParams(max_new_tokens=12, temperature=0)
        greedy = probe.submit(EOS_PROMPT, params).result(timeout=60).output_ids
    finally:
        probe.stop()
    eos = greedy[3]
    engine = TorchEngine(model(), max_running_requests=4, max_sequence_length=64,
                         eos_token_ids=(eos,), seed=0).start()
    app = create_app(engine, model_path="tiny-random", metrics=RolloutMetrics("test-job"))
    with HttpServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as client:
        yield client, greedy, eos
    engine.stop()


EOS_PROMPT = [11, 22, 33]


def test_ignore_eos_generates_past_the_eos_token(eos_service):
    client, greedy, eos = eos_service
    cut = greedy.index(eos) + 1
    params = {"max_new_tokens": 12, "temperature": 0.0}
    stopped = generate(client, EOS_PROMPT, sampling_params=params)
    assert stopped["output_ids"] == greedy[:cut]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    # As in SGLang 0.5.23, ignore_eos turns off token stops: EOS and stop_token_ids alike.
    for extra in ({"ignore_eos": True}, {"ignore_eos": True, "stop_token_ids": [eos]}):
        through = generate(client, EOS_PROMPT, sampling_params={**params, **extra})
        assert through["output_ids"] == greedy
        assert through["meta_info"]["finish_reason"]["type"] == "length"
    # The AReaL body with ignore_eos set, as its gconfig.ignore_eos sends it.
    body = areal_generate_body(EOS_PROMPT, max_new_tokens=12, temperature=0.0, ignore_eos=True)
    response = client.post("/generate", json=body)
    assert response.status_code == 200, response.text
    assert response.json()["output_ids"] == greedy


def test_frequency_penalty_changes_the_distribution_tokens_are_drawn_from(client, engine):
    prompt = [7, 7, 7, 7]
    params = {"max_new_tokens": 40, "temperature": 0.0}
    plain = generate(client, prompt, sampling_params=params, return_logprob=True)
    penalised = generate(client, prompt, return_logprob=True,
                         sampling_params={**params, "frequency_penalty": 2.0,
                                          "presence_penalty": 1.0})
    assert len(set(penalised["output_ids"])) > len(set(plain["output_ids"]))
    # The reported log-probability is the penalised one: recompute it directly.
    ids, output = prompt + penalised["output_ids"], penalised["output_ids"]
    with torch.no_grad():
        logits = engine._model(input_ids=torch.tensor([ids])).logits[0]
    expected = []
    for i, token in enumerate(output):
        row = logits[len(prompt) - 1 + i].clone()
        for seen in set(output[:i]):
            row[seen] -= 2.0 * output[:i].count(seen) + 1.0
        assert token == int(row.argmax())
        expected.append(float(torch.log_softmax(row, -1)[token]))
    reported = [t[0] for t in penalised["meta_info"]["output_token_logprobs"]]
    torch.testing.assert_close(torch.tensor(reported), torch.tensor(expected),
                               atol=1e-4, rtol=0)
    # AReaL's body with a frequency penalty is accepted too.
    body = areal_generate_body(prompt, max_new_tokens=4, frequency_penalty=0.5)
    assert client.post("/generate", json=body).status_code == 200


@pytest.mark.parametrize("body", [{"json": {}}, {}], ids=["empty-json-body", "no-body"])
def test_pause_without_a_mode_aborts_as_in_sglang(client, engine, background, body):
    tokens_before = engine.status().generated_tokens_total
    running = background.submit(generate, client, [1, 2, 3],
                                sampling_params={"max_new_tokens": 200})
    wait_for(lambda: engine.status().generated_tokens_total > tokens_before + 2,
             what="the first tokens")
    try:
        # AReaL 1.0.4 pauses with `{}` and relies on SGLang's default mode, "abort".
        assert client.post("/pause_generation", **body).json()["status"] == "ok"
        meta = running.result(timeout=30)["meta_info"]
        assert meta["finish_reason"]["type"] == "abort"
        assert 0 < meta["completion_tokens"] < 200
        # Paused: a request sent now waits for continue.
        waiting = background.submit(generate, client, [4], sampling_params={"max_new_tokens": 2})
        wait_for(lambda: queued(engine) == 1, what="the request to be queued")
        with pytest.raises(TimeoutError):
            waiting.result(timeout=0.3)
    finally:
        assert client.post("/continue_generation", json={}).json()["status"] == "ok"
    assert waiting.result(timeout=30)["meta_info"]["finish_reason"]["type"] == "length"


def greedy_logprobs(client, prompt=(3, 5, 7)):
    out = generate(client, list(prompt), sampling_params=GREEDY, return_logprob=True)
    return [t[0] for t in out["meta_info"]["output_token_logprobs"]]


def test_update_weights_from_a_sharded_checkpoint(client, engine, tmp_path):
    # The same weights as one file and as shards must serve the same log-probabilities.
    single = write_snapshot(tmp_path / "single" / "model.safetensors", seed=6)
    response = client.post("/update_weights_from_disk", json={"model_path": str(single)})
    assert response.status_code == 200, response.text
    reference = greedy_logprobs(client)

    for name, index in (("indexed", True), ("plain", False)):
        directory, _ = write_sharded_snapshot(tmp_path / name, seed=6, index=index)
        write_snapshot(tmp_path / "other" / "model.safetensors", seed=7)
        client.post("/update_weights_from_disk",
                    json={"model_path": str(tmp_path / "other")})
        assert greedy_logprobs(client) != reference
        # AReaL's weight-update sequence: pause `{}`, update, continue `{}`.
        client.post("/pause_generation", json={})
        try:
            response = client.post("/update_weights_from_disk",
                                   json={"model_path": str(directory), "abort_all_requests": True})
        finally:
            client.post("/continue_generation", json={})
        assert response.status_code == 200, (name, response.text)
        assert response.json()["weight_version"] == str(engine.version)
        assert greedy_logprobs(client) == reference, name


def test_bad_sharded_checkpoints_are_refused_and_the_old_weights_keep_serving(
    client, engine, tmp_path
):
    version, before = engine.version, greedy_logprobs(client)

    def broken(name, damage):
        directory, shards = write_sharded_snapshot(tmp_path / name, seed=8)
        damage(directory, shards)
        return directory

    def drop_tensor(directory, shards):
        file, names = next(iter(shards.items()))
        kept = load_file(str(directory / file))
        del kept[names[0]]
        save_file(kept, str(directory / file))

    def reshape_tensor(directory, shards):
        file = list(shards)[1]
        kept = load_file(str(directory / file))
        name = shards[file][0]
        kept[name] = torch.zeros(3, 3)
        save_file(kept, str(directory / file))

    def index_names_unknown_tensor(directory, shards):
        index = directory / "model.safetensors.index.json"
        content = json.loads(index.read_text())
        file = list(shards)[0]
        content["weight_map"] = {n: file for n in shards[file]}  # shard 2 never loaded
        index.write_text(json.dumps(content))

    cases = [
        (broken("dropped", drop_tensor), "lacks tensor"),
        (broken("reshaped", reshape_tensor), "has shape"),
        (broken("no-shard", lambda d, s: (d / list(s)[1]).unlink()), "is missing"),
        (broken("partial-index", index_names_unknown_tensor), "missing tensor"),
        (broken("bad-index", lambda d, s: (d / "model.safetensors.index.json")
                .write_text("{not json")), "model.safetensors.index.json"),
    ]
    for directory, named in cases:
        response = client.post("/update_weights_from_disk", json={"model_path": str(directory)})
        assert response.status_code == 400, (directory.name, response.text)
        body = response.json()
        assert body["success"] is False and named in body["message"], (directory.name, body)
    assert engine.version == version
    assert greedy_logprobs(client) == before


def test_unknown_path_and_wrong_method_answer_as_sglang_does(client):
    """SGLang 0.5.23 registers its HTTPException handler for FastAPI's HTTPException; the
    router raises Starlette's, so SGLang answers these with Starlette's `{"detail": ...}`."""
    response = client.get("/no_such_route")
    assert response.status_code == 404 and response.json() == {"detail": "Not Found"}
    response = client.get("/generate")
    assert response.status_code == 405 and response.json() == {"detail": "Method Not Allowed"}
    assert set(response.headers["allow"].replace(" ", "").split(",")) == {"POST", "PUT"}
    response = client.post("/health")
    assert response.status_code == 405 and response.json() == {"detail": "Method Not Allowed"}
