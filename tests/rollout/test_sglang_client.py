"""The SGLang client: request bodies and response parsing on SGLang-shaped examples, the
launch command, and the client end to end against the torch engine's SGLang-compatible HTTP
API (a real engine on a tiny random model, served by uvicorn on a loopback port).

The same bodies are checked against SGLang's own request models in test_sglang_requests.py.
"""

from __future__ import annotations

import asyncio
import importlib.util
import sys

import pytest

from asyncrl.rollout.http_api import create_app
from asyncrl.rollout.metrics import RolloutMetrics
from asyncrl.rollout.sglang_client import (
    SGLangClient,
    SGLangError,
    SGLangResponseError,
    abort_payload,
    generate_batch_payload,
    generate_payload,
    parse_finish_reason,
    parse_generate_response,
    pause_payload,
    token_versions,
    update_weights_payload,
)
from asyncrl.launch.sglang import (
    SGLangServer,
    SGLangUnavailableError,
    groups_per_replica,
    max_running_requests,
    sglang_launch_command,
)
from asyncrl.engine.types import SamplingParams
from asyncrl.spec import load_manifest
from asyncrl.spec.job import AutoscaleSpec
from support import ROOT
from support.ports import free_port
from support.rollout import tiny_engine
from support.servers import HttpServer
from support.tiny_model import write_snapshot
from support.waiting import wait_for

EXAMPLES = ROOT / "examples"

# --------------------------------------------------------------------------- request bodies


def test_generate_payload_uses_sglang_names():
    params = SamplingParams(max_new_tokens=7, temperature=0.7, top_p=0.9, top_k=20,
                            stop_token_ids=(2, 5))
    assert generate_payload([1, 2, 3], params, "r1") == {
        "input_ids": [1, 2, 3],
        "sampling_params": {"max_new_tokens": 7, "temperature": 0.7, "top_p": 0.9,
                            "top_k": 20, "stop_token_ids": [2, 5]},
        "return_logprob": True,
        "rid": "r1",
    }


def test_generate_payload_leaves_out_empty_stop_ids():
    body = generate_payload([1], SamplingParams(), "r")
    assert "stop_token_ids" not in body["sampling_params"]
    assert body["sampling_params"]["top_k"] == -1  # SGLang's "off" too


def test_batch_payload_has_one_rid_per_prompt():
    body = generate_batch_payload([[1, 2], [3]], SamplingParams(max_new_tokens=2), ["a", "b"])
    assert body["input_ids"] == [[1, 2], [3]] and body["rid"] == ["a", "b"]
    assert body["sampling_params"]["max_new_tokens"] == 2
    with pytest.raises(ValueError, match="2 prompts need 2 rids"):
        generate_batch_payload([[1], [2]], SamplingParams(), ["a"])


def test_control_payloads():
    assert pause_payload() == {"mode": "retract"}
    assert pause_payload("abort") == {"mode": "abort"}
    # SGLang's weight_version is a string; an int is refused by its model.
    assert update_weights_payload("/w/v3", 3) == {
        "model_path": "/w/v3", "weight_version": "3", "flush_cache": True}
    assert abort_payload("r7") == {"rid": "r7"}
    assert abort_payload() == {"abort_all": True}


# --------------------------------------------------------------------------- responses


def sglang_output(output_ids, *, finish, **meta):
    """A /generate output as SGLang 0.5.23 sends it with return_logprob and
    --skip-tokenizer-init (logprob triples carry no text)."""
    logprob_ids = meta.pop("logprob_ids", output_ids)
    return {
        "output_ids": output_ids,
        "meta_info": {
            "id": "r1",
            "finish_reason": finish,
            "prompt_tokens": 3,
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,
            "output_token_logprobs": [[-0.5 - i, t, None] for i, t in enumerate(logprob_ids)],
            **meta,
        },
    }


def parse(body, known=None):
    return parse_generate_response(body, prompt_ids=[1, 2, 3], rid="r1", known_version=known)


def test_parses_a_stopped_sglang_output():
    body = sglang_output([11, 12, 2], finish={"type": "stop", "matched": 2}, weight_version="3")
    result = parse(body)
    assert result.request_id == "r1" and result.prompt_ids == [1, 2, 3]
    assert result.output_ids == [11, 12, 2]
    assert result.output_logprobs == [-0.5, -1.5, -2.5]
    assert result.output_versions == [3, 3, 3]
    assert (result.finish_reason, result.matched_stop) == ("stop", 2)
    assert result.interruptions == 0


def test_sglang_weight_version_spans_give_per_token_versions():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    body = sglang_output([5, 6, 7, 8, 9], finish={"type": "length", "length": 5},
                         weight_version="4", weight_versions=spans)
    result = parse(body)
    assert result.output_versions == [3, 3, 4, 4, 4]
    assert result.interruptions == 1
    assert result.finish_reason == "length" and result.matched_stop is None


def test_our_per_token_versions_come_first():
    body = sglang_output([5, 6, 7], finish={"type": "length", "length": 3}, weight_version="9",
                         output_token_versions=[7, 8, 8])
    assert parse(body).output_versions == [7, 8, 8]
    bad = sglang_output([5, 6], finish={"type": "length"}, output_token_versions=[1])
    with pytest.raises(ValueError, match="output_token_versions"):
        parse(bad)


def test_missing_versions_fall_back_to_the_known_version():
    no_version = sglang_output([5, 6], finish={"type": "length", "length": 2})
    assert parse(no_version, known=4).output_versions == [4, 4]
    # SGLang's default version string is not one of ours.
    default = sglang_output([5, 6], finish={"type": "length"}, weight_version="default")
    assert parse(default, known=2).output_versions == [2, 2]
    with pytest.raises(ValueError, match="--weight-version"):
        parse(default, known=None)
    assert token_versions({}, 0, None) == []


def test_spans_shorter_than_the_output_extend_the_last_version():
    meta = {"weight_versions": [{"version": "1", "start": 0, "end": 2}]}
    assert token_versions(meta, 4, None) == [1, 1, 1, 1]


@pytest.mark.parametrize(
    ("finish", "expected"),
    [
        ({"type": "stop", "matched": 2}, ("stop", 2)),
        ({"type": "stop", "matched": [7, 2]}, ("stop", 2)),
        ({"type": "stop", "matched": "</answer>"}, ("stop", None)),
        ({"type": "length", "length": 16}, ("length", None)),
        ({"type": "abort", "message": "Abort in waiting queue", "status_code": None,
          "err_type": None}, ("abort", None)),
        ("stop", ("stop", None)),
    ],
)
def test_finish_reason_shapes(finish, expected):
    assert parse_finish_reason(finish) == expected


def test_unknown_finish_reason_is_an_error():
    with pytest.raises(ValueError, match="unknown finish_reason"):
        parse_finish_reason(None)  # SGLang's "not finished yet", never in a final answer
    with pytest.raises(ValueError, match="unknown finish_reason"):
        parse_finish_reason({"type": "eos"})


def test_an_aborted_output_keeps_its_tokens():
    body = sglang_output([5], finish={"type": "abort", "message": "Aborted"}, weight_version="0")
    result = parse(body)
    assert result.finish_reason == "abort" and result.output_ids == [5]


def test_a_stop_token_trimmed_from_output_ids_is_taken_from_the_logprobs():
    body = sglang_output([11, 12], finish={"type": "stop", "matched": 2}, weight_version="1",
                         logprob_ids=[11, 12, 2])
    result = parse(body)
    assert result.output_ids == [11, 12, 2] and len(result.output_logprobs) == 3


def test_inconsistent_or_incomplete_outputs_are_errors():
    mismatch = sglang_output([11, 12], finish={"type": "length"}, weight_version="1",
                             logprob_ids=[11, 13])
    with pytest.raises(ValueError, match="do not match"):
        parse(mismatch)
    no_logprobs = sglang_output([1], finish={"type": "length"}, weight_version="1")
    del no_logprobs["meta_info"]["output_token_logprobs"]
    with pytest.raises(ValueError, match="output_token_logprobs"):
        parse(no_logprobs)
    text_only = {"text": "hi", "meta_info": {"id": "r1"}}
    with pytest.raises(ValueError, match="skip-tokenizer-init"):
        parse(text_only)


# --------------------------------------------------------------------------- launch command


@pytest.fixture(scope="module")
def gpu_job():
    return load_manifest(EXAMPLES / "gpu-cluster.yaml").spec


def flag(command, name):
    return command[command.index(name) + 1]


def test_launch_command_for_the_gpu_example(gpu_job):
    command = sglang_launch_command(gpu_job, model_path="/models/qwen", port=30000,
                                    python="/usr/bin/python3")
    assert command[:3] == ["/usr/bin/python3", "-m", "sglang.launch_server"]
    assert flag(command, "--model-path") == "/models/qwen"
    assert flag(command, "--host") == "0.0.0.0" and flag(command, "--port") == "30000"
    assert flag(command, "--tp-size") == "1"
    assert flag(command, "--dtype") == "bfloat16"
    # 256 prompts job-wide over 4 replicas, 16 responses each.
    assert flag(command, "--max-running-requests") == "1024"
    assert "--skip-tokenizer-init" in command
    assert flag(command, "--weight-version") == "0"
    assert flag(command, "--random-seed") == "0"
    assert "--mem-fraction-static" not in command


def test_launch_command_dtype_is_the_engines(gpu_job):
    """rollout.computeDtype, else model.dtype; auto is bf16 on the GPUs SGLang serves."""
    for model_dtype, engine_dtype, expected in (("float32", None, "float32"),
                                                ("float32", "auto", "bfloat16"),
                                                ("bfloat16", "float32", "float32")):
        job = gpu_job.model_copy(deep=True)
        job.model.dtype, job.rollout.compute_dtype = model_dtype, engine_dtype
        command = sglang_launch_command(job, model_path="/m", port=1, python="p")
        assert flag(command, "--dtype") == expected, (model_dtype, engine_dtype)


def test_launch_command_takes_the_interpreter_from_the_environment(gpu_job, monkeypatch):
    monkeypatch.delenv("ASYNCRL_SGLANG_PYTHON", raising=False)
    assert sglang_launch_command(gpu_job, model_path="/m", port=1)[0] == sys.executable
    monkeypatch.setenv("ASYNCRL_SGLANG_PYTHON", "/opt/sglang/bin/python")
    assert sglang_launch_command(gpu_job, model_path="/m", port=1)[0] == "/opt/sglang/bin/python"
    # An explicit argument wins.
    assert sglang_launch_command(gpu_job, model_path="/m", port=1, python="/p")[0] == "/p"


def test_launch_command_options(gpu_job):
    spec = gpu_job.model_copy(deep=True)
    spec.rollout.placement.gpus = 4
    spec.rollout.replicas = 3  # 256 / 3 prompts, rounded up
    command = sglang_launch_command(
        spec, model_path="/m", port=31000, host="127.0.0.1", initial_version=12, seed=5,
        mem_fraction_static=0.8, extra_args=["--log-level", "warning"],
    )
    assert flag(command, "--tp-size") == "4"
    assert max_running_requests(spec) == 86 * 16
    assert flag(command, "--max-running-requests") == str(86 * 16)
    assert groups_per_replica(spec) == 86
    assert flag(command, "--weight-version") == "12" and flag(command, "--random-seed") == "5"
    assert flag(command, "--mem-fraction-static") == "0.8"
    assert command[-2:] == ["--log-level", "warning"]
    with pytest.raises(ValueError, match="mem_fraction_static"):
        sglang_launch_command(spec, model_path="/m", port=1, mem_fraction_static=1.5)


def test_missing_sglang_gives_a_clear_error(gpu_job):
    assert importlib.util.find_spec("sglang") is None  # never in the project's environment
    server = SGLangServer.for_job(gpu_job, model_path="/m", port=free_port())
    with pytest.raises(SGLangUnavailableError, match=r"sglang package.*engine: torch"):
        server.start()


def test_a_server_that_exits_reports_its_output():
    script = "import sys; print('loading model'); print('CUDA error: no GPU'); sys.exit(3)"
    server = SGLangServer([sys.executable, "-c", script], url=f"http://127.0.0.1:{free_port()}",
                          startup_timeout=30)
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 3.*CUDA error: no GPU"):
        server.start()


def test_a_server_that_never_gets_healthy_times_out_and_is_stopped():
    server = SGLangServer([sys.executable, "-c", "import time; print('waiting'); time.sleep(60)"],
                          url=f"http://127.0.0.1:{free_port()}", startup_timeout=1.5)
    with pytest.raises(TimeoutError, match="(?s)not healthy within 1.5s.*waiting"):
        server.start()
    assert server._process is None  # stopped


# --------------------------------------------------------------------------- end to end

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def served():
    engine = tiny_engine()
    app = create_app(engine, model_path="tiny-random", metrics=RolloutMetrics(job="sglang-test"))
    with HttpServer(app) as server:
        yield server.url, engine
    engine.stop()


def run(scenario):
    return asyncio.run(asyncio.wait_for(scenario, timeout=120))


def test_health_and_model_info(served):
    url, engine = served

    async def scenario():
        async with SGLangClient(url) as client:
            assert await client.health()
            await client.wait_until_healthy(timeout=5)
            info = await client.model_info()
            assert info["model_path"] == "tiny-random"
            assert info["weight_version"] == str(engine.version)

    run(scenario())


def test_generate_single_and_batch(served):
    url, engine = served

    async def scenario():
        async with SGLangClient(url, version=None) as client:
            one = await client.generate([4, 5, 6], GREEDY, rid="e2e-one")
            batch = await client.generate_batch([[4, 5, 6], [4, 5, 6]], GREEDY,
                                                rids=["e2e-b0", "e2e-b1"])
            sampled = await client.generate([1, 2], SamplingParams(max_new_tokens=5, top_k=50))
            return one, batch, sampled

    one, batch, sampled = run(scenario())
    assert one.request_id == "e2e-one" and one.prompt_ids == [4, 5, 6]
    assert len(one.output_ids) == len(one.output_logprobs) == 6
    assert all(lp <= 0 for lp in one.output_logprobs)
    assert one.output_versions == [engine.version] * 6
    assert one.finish_reason == "length" and one.interruptions == 0
    assert [r.request_id for r in batch] == ["e2e-b0", "e2e-b1"]
    assert batch[0].output_ids == batch[1].output_ids == one.output_ids  # greedy
    assert len(sampled.output_ids) == 5 and sampled.request_id  # a fresh rid was made


def test_stop_token_ids_end_generation(served):
    url, _ = served
    stops = tuple(range(0, 256, 3))  # a third of the vocabulary

    async def scenario():
        async with SGLangClient(url) as client:
            return await client.generate([3, 1, 4], SamplingParams(max_new_tokens=40,
                                                                   stop_token_ids=stops))

    result = run(scenario())
    assert result.finish_reason == "stop"
    assert result.matched_stop == result.output_ids[-1] and result.matched_stop in stops


def test_pause_holds_requests_until_resume(served):
    url, engine = served

    async def scenario():
        async with SGLangClient(url) as client:
            await client.pause()
            try:
                pending = asyncio.create_task(client.generate([1, 2], GREEDY))
                await asyncio.to_thread(wait_for, lambda: engine.status().waiting_requests
                                        + engine.status().running_requests == 1)
                done, _ = await asyncio.wait({pending}, timeout=0.3)
                assert not done and engine.status().paused
            finally:
                await client.resume()
            return await pending

    result = run(scenario())
    assert len(result.output_ids) == 6 and not engine.status().paused


def test_weight_update_mid_generation_resumes_under_the_new_version(served, tmp_path):
    url, engine = served
    snapshot = write_snapshot(tmp_path / "next.safetensors", seed=1)

    async def scenario():
        async with SGLangClient(url, version=engine.version) as client:
            start = client.version
            before = engine.status().generated_tokens_total
            long = SamplingParams(max_new_tokens=200, temperature=1.0)
            pending = asyncio.create_task(client.generate([7, 8, 9], long, rid="e2e-long"))
            await asyncio.to_thread(
                wait_for, lambda: engine.status().generated_tokens_total >= before + 3)
            await client.pause()  # retract: the request stays
            update = await client.update_weights_from_disk(str(snapshot), start + 1)
            await client.resume()
            result = await pending
            info = await client.model_info()
            return start, update, result, info, client.version

    start, update, result, info, known = run(scenario())
    assert update.version == start + 1 == known and update.seconds > 0
    assert update.interrupted_requests == 1
    assert info["weight_version"] == str(start + 1)
    versions = result.output_versions
    assert len(result.output_ids) == len(versions) == 200
    assert versions[0] == start and versions[-1] == start + 1
    assert versions == sorted(versions) and result.interruptions == 1


def test_abort_one_request_and_all(served):
    url, engine = served

    async def scenario():
        async with SGLangClient(url) as client:
            await client.pause()
            try:
                first = asyncio.create_task(client.generate([1, 2, 3], GREEDY, rid="e2e-abort"))
                others = [asyncio.create_task(client.generate([4], GREEDY)) for _ in range(2)]
                await asyncio.to_thread(wait_for, lambda: engine.status().waiting_requests
                                        + engine.status().running_requests == 3)
                await client.abort("e2e-abort")
                aborted = await first
                await client.abort()
                rest = await asyncio.gather(*others)
            finally:
                await client.resume()
            return aborted, rest

    aborted, rest = run(scenario())
    assert aborted.request_id == "e2e-abort" and aborted.finish_reason == "abort"
    assert aborted.output_ids == [] and aborted.output_versions == []
    assert [r.finish_reason for r in rest] == ["abort", "abort"]


def test_server_errors_carry_status_and_message(served, tmp_path):
    url, engine = served

    async def scenario():
        async with SGLangClient(url, version=engine.version) as client:
            known = client.version
            with pytest.raises(SGLangError) as missing:
                await client.update_weights_from_disk(str(tmp_path / "nothing"), known + 1)
            assert client.version == known  # unchanged by a failed update
            with pytest.raises(SGLangError) as bad_token:
                await client.generate([1, 999], GREEDY)
            # Like SGLang, aborting a request that is not (or no longer) there is no error.
            await client.abort("no-such-request")
            return missing.value, bad_token.value

    missing, bad_token = run(scenario())
    assert missing.status == 400 and missing.endpoint == "/update_weights_from_disk"
    assert "no safetensors snapshot" in missing.message
    assert bad_token.status == 400 and "token id 999" in bad_token.message
    assert "HTTP 400" in str(bad_token) and "/generate" in str(bad_token)
    assert not isinstance(bad_token, SGLangResponseError)


def test_an_unreachable_server():
    url = f"http://127.0.0.1:{free_port()}"

    async def scenario():
        async with SGLangClient(url, timeout=5) as client:
            assert not await client.health()
            with pytest.raises(SGLangError) as error:
                await client.generate([1], GREEDY)
            with pytest.raises(TimeoutError, match="not healthy within 0.3s"):
                await client.wait_until_healthy(timeout=0.3, interval=0.1)
            return error.value

    error = run(scenario())
    assert error.status is None and "cannot reach" in error.message


def test_with_autoscale_a_replicas_share_is_that_of_the_fewest_replicas(gpu_job):
    """A job scaled down to minReplicas still uses the whole rollout.maxConcurrentRollouts."""
    spec = gpu_job.model_copy(deep=True)
    spec.rollout.max_concurrent_rollouts = 16
    spec.rollout.replicas = 4
    assert groups_per_replica(spec) == 4
    spec.rollout.autoscale = AutoscaleSpec(min_replicas=2, max_replicas=8)
    assert groups_per_replica(spec) == 8
    assert max_running_requests(spec) == 8 * spec.algorithm.group_size
