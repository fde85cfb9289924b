"""Checks request bodies and launch flags against SGLang's own code.

Run with the python of the environment scripts/sglang_check_env.sh builds (it has sglang, not
asyncrl). Reads on stdin `{"vocab_size": n, "cases": [{"name", "kind", "body"}, ...]}` and
prints one JSON object: `{"sglang_version", "results": {name: {"accepted", "error",
"normalized"}}}`. Each kind goes through what the SGLang server does with it:

- generate: the HTTP contract gate of /generate (`generate_contract_error`), the FastAPI
  parse into `GenerateReqInput`, `normalize_batch_and_arguments()` and
  `contains_mm_input()` (whether SGLang sees multimodal data), then for every request of the
  batch the tokenizer manager's `SamplingParams(**...)`, `.normalize()` and
  `.verify(vocab_size)`;
- pause, continue, update_weights_from_disk, abort, load_lora_adapter, unload_lora_adapter:
  the FastAPI parse into PauseGenerationReqInput, ContinueGenerationReqInput,
  UpdateWeightFromDiskReqInput, AbortReq, LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput;
- launch: the body is the argument list after `python -m sglang.launch_server`, parsed by
  the parser `ServerArgs.add_cli_args` builds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import warnings


def main() -> None:
    request = json.load(sys.stdin)
    out = sys.stdout
    # SGLang may log while importing; only the verdict goes to stdout.
    with contextlib.redirect_stdout(sys.stderr):
        warnings.simplefilter("ignore")
        verdict = check_all(request)
    json.dump(verdict, out)
    out.write("\n")


def check_all(request: dict) -> dict:
    import sglang
    from pydantic import TypeAdapter
    from sglang.srt.entrypoints.api_contract import generate_contract_error
    from sglang.srt.managers.io_struct import (
        AbortReq,
        ContinueGenerationReqInput,
        GenerateReqInput,
        LoadLoRAAdapterReqInput,
        PauseGenerationReqInput,
        UnloadLoRAAdapterReqInput,
        UpdateWeightFromDiskReqInput,
    )
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs

    vocab_size = request.get("vocab_size", 49152)
    control_models = {
        "pause": PauseGenerationReqInput,
        "continue": ContinueGenerationReqInput,
        "update_weights_from_disk": UpdateWeightFromDiskReqInput,
        "abort": AbortReq,
        "load_lora_adapter": LoadLoRAAdapterReqInput,
        "unload_lora_adapter": UnloadLoRAAdapterReqInput,
    }

    def check_generate(body: dict) -> dict:
        error = generate_contract_error(body)
        if error is not None:
            raise ValueError(f"HTTP contract: {error}")
        obj = TypeAdapter(GenerateReqInput).validate_python(body)
        obj.normalize_batch_and_arguments()
        items = [obj] if obj.is_single else [obj[i] for i in range(obj.batch_size)]
        sampling = []
        for item in items:
            params = SamplingParams(**item.sampling_params)
            params.normalize(None)
            params.verify(vocab_size)
            sampling.append({
                "max_new_tokens": params.max_new_tokens,
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": params.top_k,
                "stop_token_ids": sorted(params.stop_token_ids or ()),
                "ignore_eos": params.ignore_eos,
                "frequency_penalty": params.frequency_penalty,
                "presence_penalty": params.presence_penalty,
            })
        return {
            "is_single": obj.is_single,
            "batch_size": obj.batch_size,
            "rid": obj.rid,
            "return_logprob": obj.return_logprob,
            "lora_path": obj.lora_path,
            "contains_mm_input": obj.contains_mm_input(),
            "sampling_params": sampling,
        }

    def check_control(kind: str, body: dict) -> dict:
        obj = TypeAdapter(control_models[kind]).validate_python(body)
        return {name: _plain(getattr(obj, name)) for name in obj.__struct_fields__}

    def check_launch(argv: list[str]) -> dict:
        parser = argparse.ArgumentParser(prog="sglang.launch_server", exit_on_error=False)
        ServerArgs.add_cli_args(parser)
        messages = io.StringIO()
        try:
            with contextlib.redirect_stderr(messages):
                args = parser.parse_args(argv)
        except argparse.ArgumentError as exc:
            raise ValueError(str(exc)) from None
        except SystemExit:
            # argparse prints the whole usage first; its last line is the error.
            lines = messages.getvalue().strip().splitlines() or ["argument parsing failed"]
            raise ValueError(lines[-1]) from None
        names = ("model_path", "host", "port", "tp_size", "dtype", "max_running_requests",
                 "skip_tokenizer_init", "weight_version", "random_seed", "mem_fraction_static",
                 "enable_lora", "max_lora_rank", "lora_target_modules", "max_loras_per_batch")
        return {name: getattr(args, name) for name in names}

    results = {}
    for case in request["cases"]:
        kind, body = case["kind"], case["body"]
        try:
            if kind == "generate":
                normalized = check_generate(body)
            elif kind == "launch":
                normalized = check_launch(body)
            else:
                normalized = check_control(kind, body)
            results[case["name"]] = {"accepted": True, "error": None, "normalized": normalized}
        except Exception as exc:  # every refusal is a verdict, whatever SGLang raises
            message = f"{type(exc).__name__}: {exc}"
            results[case["name"]] = {"accepted": False, "error": message, "normalized": None}
    return {"sglang_version": sglang.__version__, "results": results}


def _plain(value):
    plain = (str, int, float, bool, type(None), list, dict)
    return value if isinstance(value, plain) else repr(value)


if __name__ == "__main__":
    main()
