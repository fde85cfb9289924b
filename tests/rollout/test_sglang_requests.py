"""Our SGLang request bodies and launch flags, checked by SGLang's own code.

SGLang cannot run on a CPU-only machine, but its request models can: scripts/sglang_check_env.sh
builds (once, cached) a separate environment with `sglang` and its pure-Python imports, and
tests/support/sglang_requests.py, run with that environment's python, puts each body through what
SGLang's server does with it (see that file). If the environment cannot be built, these tests
fail with the reason: they are never skipped.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from asyncrl.rollout.sglang_client import (
    abort_payload,
    adapter_name,
    continue_payload,
    generate_batch_payload,
    generate_payload,
    load_adapter_payload,
    pause_payload,
    unload_adapter_payload,
    update_weights_payload,
)
from asyncrl.launch.sglang import SGLANG_VERSION, sglang_launch_command
from asyncrl.engine.types import SamplingParams
from asyncrl.spec import load_manifest
from asyncrl.spec.job import DEFAULT_LORA_TARGETS, SGLANG_LORA_TARGETS, LoraSpec
from support import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

TOP_K_ALL = 1 << 30  # SGLang's "whole vocabulary"
VOCAB = 49152

GPU_JOB = load_manifest(ROOT / "examples" / "gpu-cluster.yaml").spec
JOB_SAMPLING = SamplingParams(
    max_new_tokens=GPU_JOB.rollout.max_new_tokens,
    temperature=GPU_JOB.rollout.temperature,
    top_p=GPU_JOB.rollout.top_p,
    top_k=GPU_JOB.rollout.top_k,
)
FULL = SamplingParams(max_new_tokens=16, temperature=0.7, top_p=0.9, top_k=20,
                      stop_token_ids=(2, 7))


def launch_args(spec=GPU_JOB, **options) -> list[str]:
    command = sglang_launch_command(spec, model_path="/models/qwen", port=30000, **options)
    assert command[1:3] == ["-m", "sglang.launch_server"]
    return command[3:]


def with_lora(**lora) -> object:
    spec = GPU_JOB.model_copy(deep=True)
    spec.model.lora = LoraSpec(**lora)
    return spec


def with_sampling(body: dict, **changes) -> dict:
    return {**body, "sampling_params": {**body["sampling_params"], **changes}}


def areal_body(**gconfig) -> dict:
    """The /generate body AReaL 1.0.4's RemoteSGLangEngine builds
    (SGLangBackend.build_generation_request) from GenerationHyperparameters' defaults, with
    ModelRequest.image_data's default []; as tests/rollout/test_rollout_http.py sends it to ours."""
    config = {"top_p": 1.0, "top_k": int(1e8), "max_new_tokens": 16384, "temperature": 1.0,
              "stop_token_ids": [], "ignore_eos": False, "skip_special_tokens": True,
              "frequency_penalty": 0.0, **gconfig}
    return {"input_ids": [1, 2, 3], "image_data": [], "sampling_params": config,
            "return_logprob": True, "stream": False}


SINGLE = generate_payload([1, 2, 3], FULL, "r-single")
PENALISED = SamplingParams(max_new_tokens=16, ignore_eos=True, frequency_penalty=0.5,
                           presence_penalty=-0.25)

CASES = {
    # accepted
    "single": ("generate", SINGLE),
    "defaults": ("generate", generate_payload([5], SamplingParams(), "r-defaults")),
    "greedy": ("generate", generate_payload([5, 6], SamplingParams(temperature=0.0), "r-greedy")),
    "job sampling": ("generate", generate_payload(list(range(40)), JOB_SAMPLING, "r-job")),
    "batch": ("generate", generate_batch_payload([[1, 2], [3, 4, 5], [6]], FULL,
                                                 ["b0", "b1", "b2"])),
    "penalised": ("generate", generate_payload([5, 6], PENALISED, "r-penalised")),
    "areal default": ("generate", areal_body()),
    "areal ignore_eos and frequency_penalty": ("generate",
                                               areal_body(ignore_eos=True, frequency_penalty=1.5)),
    "empty image_data null": ("generate", {**SINGLE, "image_data": None}),
    "empty image_data nested": ("generate", {**SINGLE, "image_data": [[]]}),
    "empty image_data string": ("generate", {**SINGLE, "image_data": ""}),
    "pause without a mode": ("pause", {}),
    "pause retract": ("pause", pause_payload()),
    "pause abort": ("pause", pause_payload("abort")),
    "pause in_place": ("pause", pause_payload("in_place")),
    "continue": ("continue", continue_payload()),
    "update weights": ("update_weights_from_disk", update_weights_payload("/weights/v3", 3)),
    "abort one": ("abort", abort_payload("r-single")),
    "abort all": ("abort", abort_payload()),
    "generate with an adapter": ("generate", generate_payload([1, 2, 3], FULL, "r-lora",
                                                              adapter=adapter_name(3))),
    "load adapter": ("load_lora_adapter",
                     load_adapter_payload(adapter_name(3), "/run/weights/v000003")),
    "unload adapter": ("unload_lora_adapter", unload_adapter_payload(adapter_name(3))),
    "launch lora": ("launch", launch_args(with_lora(rank=8))),
    "launch lora on every module sglang adapts": (
        "launch", launch_args(with_lora(target_modules=list(SGLANG_LORA_TARGETS)))),
    "launch": ("launch", launch_args()),
    "launch with options": ("launch", launch_args(mem_fraction_static=0.8, initial_version=7,
                                                  seed=3, host="127.0.0.1")),
    # refused by SGLang (each for the reason the test checks)
    "unknown sampling field": ("generate", with_sampling(SINGLE, top_logprobs=5)),
    "max_new_tokens as a string": ("generate", with_sampling(SINGLE, max_new_tokens="16")),
    "top_k 0": ("generate", with_sampling(SINGLE, top_k=0)),
    "top_p 0": ("generate", with_sampling(SINGLE, top_p=0.0)),
    "frequency_penalty 2.5": ("generate", with_sampling(SINGLE, frequency_penalty=2.5)),
    "presence_penalty -3": ("generate", with_sampling(SINGLE, presence_penalty=-3.0)),
    "token ids as strings": ("generate", {**SINGLE, "input_ids": ["1", "2"]}),
    "integer weight_version": ("update_weights_from_disk",
                               {"model_path": "/weights/v3", "weight_version": 3}),
    "unknown pause mode": ("pause", {"mode": "later"}),
    "unknown launch flag": ("launch", launch_args(extra_args=["--enable-weight-sync"])),
    "unsupported dtype": ("launch", launch_args(extra_args=["--dtype", "float64"])),
    "adapter load without a path": ("load_lora_adapter", {"lora_name": "v3"}),
    "lora on a module sglang does not adapt": (
        "launch", launch_args(with_lora(), extra_args=["--lora-target-modules", "c_attn"])),
}


@pytest.fixture(scope="module")
def verdict() -> dict:
    build = subprocess.run(
        ["bash", str(ROOT / "scripts" / "sglang_check_env.sh")],
        capture_output=True, text=True, timeout=1700,
    )
    if build.returncode != 0:
        pytest.fail(
            f"could not build the SGLang check environment (exit {build.returncode}):\n"
            f"{build.stderr[-4000:]}",
            pytrace=False,
        )
    python = build.stdout.strip().splitlines()[-1]
    request = {
        "vocab_size": VOCAB,
        "cases": [{"name": n, "kind": k, "body": b} for n, (k, b) in CASES.items()],
    }
    check = subprocess.run(
        [python, str(ROOT / "tests" / "support" / "sglang_requests.py")],
        input=json.dumps(request), capture_output=True, text=True, timeout=600,
    )
    if check.returncode != 0:
        pytest.fail(f"the SGLang request check crashed:\n{check.stderr[-4000:]}", pytrace=False)
    return json.loads(check.stdout)


def accepted(verdict: dict, name: str) -> dict:
    result = verdict["results"][name]
    assert result["accepted"], f"SGLang refused {name!r}: {result['error']}"
    return result["normalized"]


def refused(verdict: dict, name: str) -> str:
    result = verdict["results"][name]
    assert not result["accepted"], f"SGLang accepted {name!r}, which should be refused"
    return result["error"]


def test_checked_against_the_pinned_sglang(verdict):
    assert verdict["sglang_version"] == SGLANG_VERSION
    assert set(verdict["results"]) == set(CASES)


def test_single_generate_request(verdict):
    single = accepted(verdict, "single")
    assert single["is_single"] and single["rid"] == "r-single"
    assert single["return_logprob"] is True
    assert not single["contains_mm_input"]
    assert single["sampling_params"] == [{
        "max_new_tokens": 16, "temperature": 0.7, "top_p": 0.9, "top_k": 20,
        "stop_token_ids": [2, 7], "ignore_eos": False, "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
    }]


def test_sampling_conventions_mean_the_same_in_sglang(verdict):
    # Our top_k -1 ("off") is SGLang's whole vocabulary; temperature 0 is greedy (top_k 1).
    (defaults,) = accepted(verdict, "defaults")["sampling_params"]
    assert defaults["top_k"] == TOP_K_ALL and defaults["stop_token_ids"] == []
    (greedy,) = accepted(verdict, "greedy")["sampling_params"]
    assert greedy["top_k"] == 1
    (job,) = accepted(verdict, "job sampling")["sampling_params"]
    assert job["max_new_tokens"] == GPU_JOB.rollout.max_new_tokens


def test_batch_generate_request(verdict):
    batch = accepted(verdict, "batch")
    assert not batch["is_single"] and batch["batch_size"] == 3
    assert batch["rid"] == ["b0", "b1", "b2"]
    assert batch["return_logprob"] == [True, True, True]
    assert [p["top_k"] for p in batch["sampling_params"]] == [20, 20, 20]


def test_penalties_and_ignore_eos_keep_their_meaning_in_sglang(verdict):
    (penalised,) = accepted(verdict, "penalised")["sampling_params"]
    assert penalised["ignore_eos"] is True
    assert penalised["frequency_penalty"] == 0.5 and penalised["presence_penalty"] == -0.25


def test_areals_bodies_and_empty_multimodal_fields(verdict):
    # What our HTTP API accepts from AReaL, SGLang accepts too, and sees no image in.
    default = accepted(verdict, "areal default")
    assert not default["contains_mm_input"] and default["return_logprob"] is True
    (params,) = default["sampling_params"]
    assert params["ignore_eos"] is False and params["frequency_penalty"] == 0.0
    (params,) = accepted(verdict, "areal ignore_eos and frequency_penalty")["sampling_params"]
    assert params["ignore_eos"] is True and params["frequency_penalty"] == 1.5
    for name in ("empty image_data null", "empty image_data nested"):
        assert not accepted(verdict, name)["contains_mm_input"], name
    # "" counts as data to has_valid_data, but a text-only server has no multimodal processor
    # and ignores it; we accept it as empty.
    accepted(verdict, "empty image_data string")


def test_pause_without_a_mode_aborts(verdict):
    # Our /pause_generation's default follows this.
    assert accepted(verdict, "pause without a mode")["mode"] == "abort"


def test_control_requests(verdict):
    for mode in ("retract", "abort", "in_place"):
        assert accepted(verdict, f"pause {mode}")["mode"] == mode
    accepted(verdict, "continue")
    update = accepted(verdict, "update weights")
    assert update["model_path"] == "/weights/v3" and update["weight_version"] == "3"
    assert update["flush_cache"] is True and update["abort_all_requests"] is False
    one = accepted(verdict, "abort one")
    assert one["rid"] == "r-single" and one["abort_all"] is False
    assert accepted(verdict, "abort all")["abort_all"] is True


def test_launch_flags_parse_with_sglangs_own_parser(verdict):
    args = accepted(verdict, "launch")
    assert args == {
        "model_path": "/models/qwen", "host": "0.0.0.0", "port": 30000, "tp_size": 1,
        "dtype": "bfloat16", "max_running_requests": 1024, "skip_tokenizer_init": True,
        "weight_version": "0", "random_seed": 0, "mem_fraction_static": None,
        "enable_lora": None, "max_lora_rank": None, "lora_target_modules": None,
        "max_loras_per_batch": 8,
    }
    options = accepted(verdict, "launch with options")
    assert options["mem_fraction_static"] == 0.8 and options["weight_version"] == "7"
    assert options["random_seed"] == 3 and options["host"] == "127.0.0.1"


def test_lora_requests_and_flags(verdict):
    generate = accepted(verdict, "generate with an adapter")
    assert generate["lora_path"] == "v3" and generate["rid"] == "r-lora"
    load = accepted(verdict, "load adapter")
    assert load["lora_name"] == "v3" and load["lora_path"] == "/run/weights/v000003"
    assert load["pinned"] is False
    assert accepted(verdict, "unload adapter")["lora_name"] == "v3"
    launch = accepted(verdict, "launch lora")
    assert launch["enable_lora"] is True and launch["max_lora_rank"] == 8
    assert launch["lora_target_modules"] == list(DEFAULT_LORA_TARGETS)
    assert launch["max_loras_per_batch"] == 2
    # The spec's list of what SGLang adapts is within SGLang's own choices.
    every = accepted(verdict, "launch lora on every module sglang adapts")
    assert every["lora_target_modules"] == list(SGLANG_LORA_TARGETS)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("unknown sampling field", "unknown field `top_logprobs`"),
        ("max_new_tokens as a string", 'invalid type: string "16"'),
        ("top_k 0", "top_k must be -1 (disable) or at least 1"),
        ("top_p 0", "top_p must be in (0, 1]"),
        ("frequency_penalty 2.5", "frequency_penalty must be in [-2, 2]"),
        ("presence_penalty -3", "presence_penalty must be in [-2, 2]"),
        ("token ids as strings", 'invalid type: string "1"'),
        ("integer weight_version", "weight_version"),
        ("unknown pause mode", "mode"),
        ("unknown launch flag", "unrecognized arguments: --enable-weight-sync"),
        ("unsupported dtype", "float64"),
        ("adapter load without a path", "lora_path"),
        ("lora on a module sglang does not adapt", "invalid choice: 'c_attn'"),
    ],
)
def test_sglang_refuses_wrong_requests(verdict, name, reason):
    assert reason in refused(verdict, name)

