"""The torch engine behind an SGLang-compatible HTTP API.

The rollout service's SGLang client drives a real SGLang server on GPUs and this app on CPUs,
so routes, request bodies and response shapes follow SGLang's native API
(python/sglang/srt/entrypoints/http_server.py and managers/io_struct.py):

- `POST /generate` with `input_ids` (a list of token ids, or a list of lists for a batch),
  `sampling_params`, `return_logprob` and `rid`. The engine is token-in/token-out, as SGLang is
  with `skip_tokenizer_init`: no `text` in, only `output_ids` out. Empty multimodal fields
  (`"image_data": []`, null, "") are absent, as in SGLang; ones with data are refused.
  `sampling_params` honours max_new_tokens, temperature, top_p, top_k, stop_token_ids,
  ignore_eos, frequency_penalty, presence_penalty and sampling_seed (`SamplingParams`); the
  other keys SGLang knows are accepted at their no-op values only. Each response is
  `{"output_ids": [...], "meta_info": {...}}`; `meta_info` carries SGLang's `id`,
  `finish_reason` (`{"type": "stop", "matched": <token id>}`, `{"type": "length", ...}` or
  `{"type": "abort", ...}`), `prompt_tokens`, `completion_tokens`, `cached_tokens`,
  `e2e_latency`, `weight_version` (a string, as SGLang reports it) and, with
  `return_logprob`, `output_token_logprobs` as `[logprob, token_id, null]` triples.
  `output_token_versions` (the integer policy version of each output token) is **our
  extension**: SGLang has no per-token versions, so the SGLang client must not rely on it.
- LoRA, when the engine's versions are an adapter's (TorchEngine(lora=...)): SGLang's
  `POST /load_lora_adapter` (`lora_name`, `lora_path`: a peft adapter directory) merges the
  adapter into the engine's weights as the version its name gives (`v<N>`, as the SGLang client
  names versions; any other name loads as the next version) and registers the name;
  `POST /unload_lora_adapter` drops a name; `lora_path` in /generate must name a loaded
  adapter. Answers are SGLang's `{"success", "error_message", "loaded_adapters"}`, 400 when
  refused. Unlike SGLang, which runs each request with the adapter it names, the engine holds
  one adapter merged, the last loaded: a request naming an older one still loaded runs with
  the last (its `output_token_versions` say so), and one naming none runs with the weights in
  place (SGLang: the base).
- `POST /pause_generation`, `POST /continue_generation`, `POST /update_weights_from_disk`,
  `POST /init_weights_update_group`, `POST /update_weights_from_distributed`,
  `POST /destroy_weights_update_group` (weights broadcast by the trainer over torch.distributed:
  asyncrl.weights.distributed), `POST /abort_request`, `GET /health` (also `/health_generate`), `GET /get_model_info`,
  `GET /get_weight_version`, and `GET /metrics` (Prometheus text). `GET /ready` is ours:
  /health plus the worker's own dependencies (Redis, which announces the weights).

Errors use SGLang's body, `{"error": {"message": ...}}`: a request the engine refuses and a
body that fails validation are 400 (not FastAPI's 422), an unknown request id is 404. An
unknown path (404) or a wrong method (405, with an Allow header) keeps Starlette's
`{"detail": "Not Found"}` / `{"detail": "Method Not Allowed"}`, exactly what SGLang 0.5.23
answers: its HTTPException handler is registered for FastAPI's HTTPException, which the
router's Starlette HTTPException does not reach. A bad request is refused before anything of
it is queued, so it never disturbs other requests.
Handlers never block the event loop: results are awaited as futures, and engine calls that
wait (pause, weight loading, abort) run in worker threads.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from concurrent.futures import Future
from pathlib import Path
from typing import Annotated, Any, Callable, Literal

import torch
from fastapi import APIRouter, Body, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    StrictBool,
    StrictInt,
    StrictStr,
    model_validator,
)

from asyncrl.model.lora import ADAPTER_CONFIG, ADAPTER_FILE
from asyncrl.rollout.metrics import RolloutMetrics
from asyncrl.rollout.openai_api import engine_results, openai_router, submitted
from asyncrl.rollout.sglang_client import adapter_version
from asyncrl.engine.types import (
    GenerationResult,
    RequestError,
    SamplingParams,
    UnknownRequestError,
)
from asyncrl.weights.distributed import (
    JOIN_TIMEOUT_SECONDS,
    GroupAddress,
    TensorMeta,
    in_background,
    join,
)

# SGLang treats a temperature below this as greedy.
_GREEDY_BELOW = 1e-6


# ---------------------------------------------------------------------------- request bodies


def _token_ids(value: Any) -> Any:
    """input_ids: a list of ints (one prompt) or a list of lists of ints (a batch)."""
    if value is None:
        return None

    def is_int(x: Any) -> bool:
        return isinstance(x, int) and not isinstance(x, bool)

    if isinstance(value, list):
        if all(is_int(x) for x in value):
            return value
        if all(isinstance(row, list) and all(is_int(x) for x in row) for row in value):
            return value
    raise ValueError("must be a list of token ids (ints), or a list of such lists for a batch")


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, dict) else value


def _has_data(value: Any) -> bool:
    """Whether a multimodal field carries anything. As SGLang's has_valid_data: None and
    (nested) lists of nothing else are empty (AReaL sends `"image_data": []` with every
    text-only request). "" is empty too here; SGLang counts it as data, but a text-only
    SGLang server has no multimodal processor and never reads it."""
    if isinstance(value, list):
        return any(_has_data(item) for item in value)
    return value is not None and value != ""


class SamplingParamsBody(BaseModel):
    """SGLang's `sampling_params`. Keys SGLang does not know are refused, like SGLang does;
    keys it knows that this engine cannot honour are accepted only at their no-op values."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_new_tokens: int | None = 128  # None: up to the engine's max sequence length
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = -1
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    sampling_seed: int | None = None  # the request's own random stream (SamplingParams.seed)
    # Accepted by SGLang; honoured here only at their defaults (see _check_no_ops).
    stop: str | list[str] | None = None
    stop_regex: str | list[str] | None = None
    min_p: float | None = 0.0
    repetition_penalty: float | None = 1.0
    min_new_tokens: int | None = 0
    n: int | None = 1
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    logit_bias: dict[str, float] | None = None
    custom_params: dict[str, Any] | None = None
    # Shape only the detokenised text, which this engine never produces: ignored.
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    no_stop_trim: bool | None = False
    stream_interval: int | None = None

    @model_validator(mode="after")
    def _check_no_ops(self) -> SamplingParamsBody:
        no_op_defaults = {
            "stop": None, "stop_regex": None, "min_p": 0.0, "repetition_penalty": 1.0,
            "min_new_tokens": 0, "n": 1, "json_schema": None, "regex": None, "ebnf": None,
            "structural_tag": None, "logit_bias": None, "custom_params": None,
        }
        for name, default in no_op_defaults.items():
            value = getattr(self, name)
            if value is not None and value != default and value not in ("", [], {}):
                raise ValueError(
                    f"sampling_params.{name}={value!r} is not supported by the torch engine "
                    "(it supports max_new_tokens, temperature, top_p, top_k, stop_token_ids, "
                    "ignore_eos, frequency_penalty, presence_penalty, sampling_seed); "
                    f"omit it or send {default!r}"
                )
        return self

    def to_engine(self, prompt_length: int, max_sequence_length: int) -> SamplingParams:
        temperature = 1.0 if self.temperature is None else self.temperature
        if 0 <= temperature < _GREEDY_BELOW:
            temperature = 0.0
        max_new_tokens = self.max_new_tokens
        if max_new_tokens is None:
            max_new_tokens = max(max_sequence_length - prompt_length, 0)
        return SamplingParams(
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if self.top_k is None else self.top_k,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=bool(self.ignore_eos),
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            seed=self.sampling_seed,
        )


class GenerateRequest(BaseModel):
    """SGLang's GenerateReqInput, as far as a token-in/token-out engine supports it. Other
    top-level keys SGLang accepts are ignored."""

    model_config = ConfigDict(extra="ignore")

    input_ids: Annotated[Any, BeforeValidator(_token_ids)] = None
    # A dict applies to every prompt of a batch; a list gives one per prompt.
    sampling_params: Annotated[
        list[SamplingParamsBody] | None, BeforeValidator(_as_list)
    ] = None
    return_logprob: StrictBool | list[StrictBool] | None = None
    rid: StrictStr | list[StrictStr] | None = None
    # The LoRA adapter, by its loaded name (SGLang resolves lora_path by name): one for
    # every prompt, or one per prompt (None: no adapter).
    lora_path: StrictStr | list[StrictStr | None] | None = None
    stream: StrictBool = False
    # Refused with a message saying what to send instead (the multimodal ones only when they
    # carry data: empty ones are absent).
    text: Any = None
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None

    @model_validator(mode="after")
    def _check_inputs(self) -> GenerateRequest:
        if self.text is not None:
            raise ValueError(
                "text input is not supported: this engine is token-in/token-out; "
                "tokenize the prompt and send input_ids"
            )
        if self.input_embeds is not None:
            raise ValueError("input_embeds is not supported by the torch engine; send input_ids")
        for name in ("image_data", "video_data", "audio_data"):
            if _has_data(getattr(self, name)):
                raise ValueError(
                    f"{name} is not supported: the torch engine serves text-only models; "
                    f"send input_ids only (an empty {name}, [] or null, is accepted)"
                )
        if self.input_ids is None:
            raise ValueError("input_ids is required (a list of token ids, or a list of lists)")
        if self.stream:
            raise ValueError("stream=true is not supported by the torch engine; send stream=false")
        return self

    @property
    def is_batch(self) -> bool:
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)

    def prompts(self) -> list[list[int]]:
        return self.input_ids if self.is_batch else [self.input_ids]

    def per_prompt(self, n: int) -> tuple[list[str], list[SamplingParamsBody], list[bool]]:
        """rids, sampling params and return_logprob flags, one each per prompt (SGLang's
        normalize_batch_and_arguments: a missing rid is a fresh uuid, a string rid of a
        batch becomes `{rid}_{i}`)."""
        if self.rid is None:
            rids = [uuid.uuid4().hex for _ in range(n)]
        elif isinstance(self.rid, str):
            rids = [self.rid] if not self.is_batch else [f"{self.rid}_{i}" for i in range(n)]
        else:
            rids = list(self.rid)
        params = self.sampling_params or [SamplingParamsBody()]
        if len(params) == 1:
            params = params * n
        flags = self.return_logprob
        flags = [bool(flags)] * n if not isinstance(flags, list) else flags
        for name, values in (("rid", rids), ("sampling_params", params),
                             ("return_logprob", flags)):
            if len(values) != n:
                raise RequestError(
                    f"{name} has {len(values)} entries but input_ids has {n} prompts; "
                    "give one per prompt (or a single value for all)"
                )
        return rids, params, flags

    def adapters(self, n: int) -> list[str | None]:
        """The adapter named for each of the `n` prompts (None: none)."""
        if not isinstance(self.lora_path, list):
            return [self.lora_path] * n
        if len(self.lora_path) != n:
            raise RequestError(f"lora_path list length ({len(self.lora_path)}) must match "
                               f"the batch size ({n})")
        return list(self.lora_path)


class PauseRequest(BaseModel):
    """SGLang's PauseGenerationReqInput. "abort" (the default, as in SGLang 0.5.23, so an
    empty body `{}` or no body aborts) ends every running and waiting request with finish
    reason "abort" and the tokens generated so far, and holds requests that arrive later
    until continue. "in_place" and "retract" both keep requests: the engine drops nothing
    and resumes them on continue."""

    model_config = ConfigDict(extra="ignore")

    mode: Literal["abort", "retract", "in_place"] = "abort"


class UpdateWeightsFromDiskRequest(BaseModel):
    """SGLang's UpdateWeightFromDiskReqInput. `weight_version` is a string in SGLang; here
    it must name an integer policy version (`version` is accepted as an integer alias).
    Without either, the version after the current one is loaded."""

    model_config = ConfigDict(extra="ignore")

    model_path: StrictStr
    weight_version: StrictStr | StrictInt | None = None
    version: StrictInt | None = None
    load_format: str | None = None
    abort_all_requests: StrictBool = False

    def target_version(self, current: int) -> int:
        return _target_version(self.weight_version, self.version, current)


def _target_version(weight_version: str | int | None, version: int | None, current: int) -> int:
    """The policy version an update names (SGLang's string weight_version, or our integer
    `version`); the one after `current` when it names none."""
    versions = set()
    if version is not None:
        versions.add(version)
    if weight_version is not None:
        try:
            versions.add(int(weight_version))
        except ValueError:
            raise RequestError(
                f"weight_version must be an integer policy version, got {weight_version!r}"
            ) from None
    if len(versions) > 1:
        raise RequestError(f"weight_version {weight_version!r} and version {version} disagree")
    return versions.pop() if versions else current + 1


class InitWeightsUpdateGroupRequest(BaseModel):
    """SGLang's InitWeightsUpdateGroupReqInput (asyncrl.weights.distributed)."""

    model_config = ConfigDict(extra="ignore")

    master_address: StrictStr
    master_port: StrictInt
    rank_offset: StrictInt
    world_size: StrictInt
    group_name: StrictStr = "weight_update_group"
    backend: Literal["gloo", "nccl"] = "nccl"

    def address(self) -> GroupAddress:
        if not 1 <= self.rank_offset < self.world_size:
            raise RequestError(f"rank_offset {self.rank_offset} must be in 1..world_size - 1 "
                               f"({self.world_size - 1}); rank 0 is the trainer")
        return GroupAddress(self.master_address, self.master_port, self.world_size,
                            self.group_name, self.backend)


class UpdateWeightsFromDistributedRequest(BaseModel):
    """SGLang's UpdateWeightsFromDistributedReqInput: the named tensors arrive by broadcast
    from rank 0 of the group, in this order. `flush_cache` (SGLang's default, true) ends an
    update: the version it names (or the next) is served from then on; a request with
    flush_cache false is one part of an update, and the engine generates nothing until the
    part that ends it has landed."""

    model_config = ConfigDict(extra="ignore")

    names: list[StrictStr]
    dtypes: list[StrictStr]
    shapes: list[list[StrictInt]]
    group_name: StrictStr = "weight_update_group"
    flush_cache: StrictBool = True
    abort_all_requests: StrictBool = False
    weight_version: StrictStr | StrictInt | None = None

    def tensors(self) -> list[TensorMeta]:
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise RequestError(f"names ({len(self.names)}), dtypes ({len(self.dtypes)}) and "
                               f"shapes ({len(self.shapes)}) must have the same length")
        unknown = sorted(set(self.dtypes) - set(_TRANSFER_DTYPES))
        if unknown:
            raise RequestError(f"dtypes {unknown} are not supported; use one of "
                               f"{sorted(_TRANSFER_DTYPES)}")
        return [TensorMeta(n, _TRANSFER_DTYPES[d], tuple(s))
                for n, d, s in zip(self.names, self.dtypes, self.shapes)]


_TRANSFER_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                    "float16": torch.float16}


class LoadLoraAdapterRequest(BaseModel):
    """SGLang's LoadLoRAAdapterReqInput."""

    model_config = ConfigDict(extra="ignore")

    lora_name: StrictStr
    lora_path: StrictStr
    pinned: StrictBool = False


class UnloadLoraAdapterRequest(BaseModel):
    """SGLang's UnloadLoRAAdapterReqInput."""

    model_config = ConfigDict(extra="ignore")

    lora_name: StrictStr


class AbortRequestBody(BaseModel):
    """SGLang's AbortReq: one rid (a list is accepted too), or abort_all."""

    model_config = ConfigDict(extra="ignore")

    rid: StrictStr | list[StrictStr] | None = ""
    abort_all: StrictBool = False


# ---------------------------------------------------------------------------- responses


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=status)


def _finish_reason(result: GenerationResult) -> dict[str, Any]:
    reason: dict[str, Any] = {"type": result.finish_reason, "matched": result.matched_stop}
    if result.finish_reason == "length":
        reason["length"] = len(result.output_ids)
    elif result.finish_reason == "abort":
        reason["message"] = "Request aborted (abort_request, or pause_generation with mode abort)."
    return reason


def generate_response(
    result: GenerationResult, *, return_logprob: bool, weight_version: int, seconds: float
) -> dict[str, Any]:
    """SGLang's /generate output for one request."""
    meta: dict[str, Any] = {
        "id": result.request_id,
        "finish_reason": _finish_reason(result),
        "prompt_tokens": len(result.prompt_ids),
        "completion_tokens": len(result.output_ids),
        "cached_tokens": 0,
        "e2e_latency": seconds,
        "weight_version": str(weight_version),
        # Our extension: the policy version that generated each output token.
        "output_token_versions": list(result.output_versions),
    }
    if return_logprob:
        meta["output_token_logprobs"] = [
            [logprob, token, None]
            for logprob, token in zip(result.output_logprobs, result.output_ids)
        ]
    return {"output_ids": list(result.output_ids), "meta_info": meta}


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors():
        loc = [p for p in error.get("loc", ()) if p != "body"]
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
        message = error.get("msg", "invalid").removeprefix("Value error, ")
        parts.append(f"{path}: {message}" if path else message)
    return "; ".join(parts) or "invalid request body"


# ---------------------------------------------------------------------------- the app


def create_app(engine, *, model_path: str, metrics: RolloutMetrics,
               ready: Callable[[], bool] = lambda: True, tokenizer=None,
               **openai_options) -> FastAPI:
    """The HTTP front of one engine (a started TorchEngine or anything with its interface);
    `ready` tells whether the worker's dependencies are reachable (see health_and_metrics).
    With the model's `tokenizer`, the OpenAI-compatible API (asyncrl.rollout.openai_api) is
    served too, as model `model_path` (`openai_options`: its episodes and their sampling)."""
    app = FastAPI(title="asyncrl rollout (SGLang-compatible)")
    groups: dict[str, Any] = {}  # weight transfer groups joined, by name
    adapters: dict[str, str] = {}  # LoRA adapters loaded: name -> lora_path

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, _validation_message(exc))

    @app.exception_handler(RequestError)
    async def _refused(_: Request, exc: RequestError) -> JSONResponse:
        return _error(400, str(exc))

    @app.exception_handler(UnknownRequestError)
    async def _unknown(_: Request, exc: UnknownRequestError) -> JSONResponse:
        return _error(404, exc.args[0] if exc.args else "unknown request id")

    def submit(prompt: list[int], params: SamplingParams, rid: str) -> Future:
        started = time.perf_counter()
        future = engine.submit(prompt, params, rid)

        def observe(done: Future) -> None:
            if not done.cancelled() and done.exception() is None:
                metrics.observe_result(done.result(), time.perf_counter() - started)

        future.add_done_callback(observe)
        return future

    def check_adapters(names: list[str | None]) -> None:
        """Every adapter a request names must be loaded, as SGLang requires."""
        for name in dict.fromkeys(n for n in names if n is not None):
            if not engine.has_adapter:
                raise RequestError(f"LoRA adapter {name!r} was requested, but LoRA is not "
                                   "enabled: this engine's job has no model.lora")
            if name not in adapters:
                raise RequestError(f"LoRA adapter {name!r} is not loaded (loaded: "
                                   f"{sorted(adapters)}); load it with /load_lora_adapter")

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(body: GenerateRequest):
        prompts = body.prompts()
        rids, bodies, logprob_flags = body.per_prompt(len(prompts))
        check_adapters(body.adapters(len(prompts)))
        max_length = engine.status().max_sequence_length
        params = [b.to_engine(len(p), max_length) for b, p in zip(bodies, prompts)]
        for index, p in enumerate(params):
            _checked(p.check, index, body.is_batch)
        started = time.perf_counter()
        futures: list[Future] = []
        try:
            for index, (prompt, p, rid) in enumerate(zip(prompts, params, rids)):
                futures.append(_checked(lambda: submit(prompt, p, rid), index, body.is_batch))
        except RequestError:
            # All or nothing: a batch with one bad prompt leaves nothing of it queued.
            if futures:
                await asyncio.to_thread(engine.abort, rids[: len(futures)])
            raise
        results = await engine_results(futures, rids, engine.abort)
        seconds = time.perf_counter() - started
        version = engine.version
        outputs = [
            generate_response(r, return_logprob=flag, weight_version=version, seconds=seconds)
            for r, flag in zip(results, logprob_flags)
        ]
        return outputs if body.is_batch else outputs[0]

    @app.post("/pause_generation")
    async def pause_generation(body: Annotated[PauseRequest | None, Body()] = None):
        mode = (body or PauseRequest()).mode
        # Paused first, so nothing starts between the abort and the pause (SGLang too marks
        # itself paused before aborting).
        await asyncio.to_thread(engine.pause)
        if mode == "abort":
            await asyncio.to_thread(engine.abort, None)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation():
        engine.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateWeightsFromDiskRequest):
        try:
            version = body.target_version(engine.version)
            if body.abort_all_requests:
                await asyncio.to_thread(engine.abort, None)
            update = await asyncio.to_thread(engine.update_weights, body.model_path, version)
        except RequestError as exc:
            metrics.observe_weight_update_failure()
            return JSONResponse(
                {"success": False, "message": str(exc), "num_paused_requests": 0},
                status_code=400,
            )
        metrics.observe_weight_update(update)
        return {
            "success": True,
            "message": f"Succeeded to update model weights. "
                       f"Weight version updated to {update.version}.",
            "num_paused_requests": update.interrupted_requests,
            "weight_version": str(update.version),
            "seconds": update.seconds,
        }

    def adapter_answer(error: str | None = None) -> JSONResponse | dict[str, Any]:
        """SGLang's LoRAUpdateOutput: 400 with the message when refused."""
        answer = {"success": error is None, "error_message": error or "",
                  "loaded_adapters": dict(adapters)}
        return answer if error is None else JSONResponse(answer, status_code=400)

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterRequest):
        name, path = body.lora_name, Path(body.lora_path)
        if not engine.has_adapter:
            return adapter_answer("LoRA is not enabled: this engine's job has no model.lora")
        if name in adapters:
            return adapter_answer(f"Failed to load LoRA adapter {name} because it is "
                                  "already loaded")
        if not ((path / ADAPTER_CONFIG).is_file() and (path / ADAPTER_FILE).is_file()):
            return adapter_answer(f"lora_path {body.lora_path!r} is not a LoRA adapter "
                                  f"directory ({ADAPTER_CONFIG} and {ADAPTER_FILE}, as peft "
                                  "saves one)")
        version = adapter_version(name)
        try:
            update = await asyncio.to_thread(
                engine.update_weights, path,
                engine.version + 1 if version is None else version)
        except RequestError as exc:
            metrics.observe_weight_update_failure()
            return adapter_answer(f"Failed to load LoRA adapter {name}: {exc}")
        adapters[name] = body.lora_path
        metrics.observe_weight_update(update)
        return adapter_answer()

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest):
        if adapters.pop(body.lora_name, None) is None:
            return adapter_answer(f"LoRA with name {body.lora_name} does not exist. "
                                  f"Loaded LoRAs: {sorted(adapters)}")
        return adapter_answer()

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitWeightsUpdateGroupRequest):
        address = body.address()
        try:
            groups[body.group_name] = await asyncio.wrap_future(
                in_background(join, address, body.rank_offset, JOIN_TIMEOUT_SECONDS))
        except Exception as exc:  # the trainer never came, or the store refused us
            return JSONResponse({"success": False, "message": f"cannot join: {exc}"},
                                status_code=500)
        return {"success": True, "message": f"Joined {body.group_name} as rank {body.rank_offset}."}

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: UpdateWeightsFromDistributedRequest):
        tensors = body.tensors()
        group = groups.get(body.group_name)
        if group is None:
            raise RequestError(f"no weight transfer group {body.group_name!r}; "
                               "POST /init_weights_update_group first")
        version = (_target_version(body.weight_version, None, engine.version)
                   if body.flush_cache else None)
        if body.abort_all_requests:
            await asyncio.to_thread(engine.abort, None)
        try:
            update = await asyncio.to_thread(engine.update_weights_from_distributed,
                                             group, tensors, version)
        except Exception as exc:
            metrics.observe_weight_update_failure()
            status = 400 if isinstance(exc, RequestError) else 500
            return JSONResponse({"success": False, "message": str(exc)}, status_code=status)
        if version is not None:
            metrics.observe_weight_update(update)
        return {"success": True, "message": "Succeeded to update parameter online.",
                "weight_version": str(engine.version), "seconds": update.seconds}

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: Annotated[dict | None, Body()] = None):
        name = (body or {}).get("group_name", "weight_update_group")
        if groups.pop(name, None) is None:
            raise RequestError(f"no weight transfer group {name!r}")
        return {"success": True, "message": f"Left {name}."}

    @app.post("/abort_request")
    async def abort_request(body: AbortRequestBody):
        if body.abort_all:
            aborted = await asyncio.to_thread(engine.abort, None)
        elif body.rid:
            rids = [body.rid] if isinstance(body.rid, str) else body.rid
            aborted = await asyncio.to_thread(engine.abort, rids)
        else:
            raise RequestError("abort_request needs rid (a request id) or abort_all: true")
        # SGLang answers 200 with no body; the ids actually aborted are our addition.
        return {"success": True, "aborted_rids": aborted}

    @app.get("/get_model_info")
    async def get_model_info():
        return {
            "model_path": model_path,
            "tokenizer_path": None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": str(engine.version),
        }

    @app.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": str(engine.version)}

    app.include_router(health_and_metrics(engine, metrics, ready))
    if tokenizer is not None:
        app.include_router(openai_router(
            submitted(submit, engine.abort), tokenizer, model_name=model_path,
            max_sequence_length=engine.status().max_sequence_length, **openai_options))
    return app


def health_and_metrics(engine, metrics: RolloutMetrics,
                       ready: Callable[[], bool] = lambda: True) -> APIRouter:
    """`/health` (and SGLang's `/health_generate`): 200 while the engine serves, else 503 (the
    liveness probe); `/ready`: 200 while the engine serves and `ready()`, else 503 (the
    readiness probe: not ready while Redis is down, without the worker being restarted);
    `/metrics`: Prometheus text. Any engine with `alive` and `status()` (an InferenceEngine or
    a TorchEngine)."""
    router = APIRouter()

    @router.get("/health")
    @router.get("/health_generate")
    async def health():
        return Response(status_code=200 if engine.alive else 503)

    @router.get("/ready")
    async def readiness():
        return Response(status_code=200 if engine.alive and ready() else 503)

    @router.get("/metrics")
    async def prometheus_metrics():
        metrics.refresh(engine.status())
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    return router


def _checked(call, index: int, is_batch: bool):
    """Runs `call`, naming the batch item in a RequestError's message."""
    try:
        return call()
    except RequestError as exc:
        if is_batch:
            raise RequestError(f"batch item {index}: {exc}") from None
        raise
