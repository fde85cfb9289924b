"""An OpenAI-compatible API on the rollout worker, so agent code written against the OpenAI
SDK can drive the policy being trained.

`openai_router` serves, beside the SGLang-compatible native API (asyncrl.rollout.http_api):

- `GET /v1/models` (and `/v1/models/{model}`): the one served model;
- `POST /v1/completions`: `prompt` as a string, a list of strings, token ids or a list of
  token-id lists; `n`, `max_tokens` (default 16, as OpenAI's), `temperature`, `top_p`,
  `stop`, `frequency_penalty`, `presence_penalty`, `logprobs` (0 or 1), `stream`, `seed`;
- `POST /v1/chat/completions`: `messages` rendered by the tokenizer's chat template; the
  same sampling fields, `max_tokens` / `max_completion_tokens` (default: up to the engine's
  max sequence length), `logprobs` (bool) and `top_logprobs` (0), `stream`, and `tools` /
  `tool_choice` ("auto" or "none") with calls in the Hermes layout (asyncrl.rollout.tool_calls).

Every completion is one `generate(prompt_ids, SamplingParams) -> GenerationResult` call
(`InferenceEngine.generate`'s signature), so any engine serves this API. The engine works on
tokens and returns whole results, so what the engine cannot do is done here, on the text:

- stop strings: the output is decoded, cut before the first match (finish_reason "stop"), and
  the tokens after the one that completed the match are dropped, from `usage` and log-probs
  too. Generation itself runs on to its token stops or `max_tokens`;
- streaming: chunks are sent once the result is in, one per output token (its text and, if
  asked, its log-prob), ending with `data: [DONE]`; the deltas add up to the non-streamed text;
- log-probs: only the chosen token's, the one the engine records (the behaviour policy's);
  alternatives (`logprobs` > 1, `top_logprobs` > 0) are refused, never made up;
- `seed`: choice i samples from the stream `stream_seed(seed, i)` (asyncrl.engine.types:
  `SamplingParams.substream`; the same seed for all would make the n choices one),
  so the same request gives the same completions whatever else the engine serves (with the
  torch engine; SGLang's sampler keeps its own generator).

Errors have OpenAI's body, `{"error": {"message", "type", "param", "code"}}`: 400 for a body
that fails validation (the message and `param` name the field) or that the engine refuses,
404 for a model other than the served one. A request is checked before it reaches the engine;
if the engine refuses part of it (a token id outside its vocabulary), the rest is aborted. A
bad request never disturbs others.

With an `EpisodeBook`, every route is also served under `/episodes/{episode_id}`: the base
URL an episode's client is given (asyncrl.rollout.episodes). Those calls run under the
episode's limits, their prompts reuse the tokens of the episode's earlier calls, and each
finished completion is recorded in the episode (asyncrl.rollout.episode_record); a call for an
episode that has ended gets 404.
"""

from __future__ import annotations

import asyncio
import bisect
import json
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Annotated, Any, Awaitable, Callable, Literal

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from asyncrl.engine.types import GenerationResult, RequestError, SamplingParams
from asyncrl.rollout.episode_record import (
    Episode,
    EpisodeBook,
    EpisodeLimitReached,
    EpisodeNotRunning,
)
from asyncrl.rollout.tool_calls import (
    ParsedOutput,
    hermes_system_prompt,
    parse_tool_calls,
    tool_call_text,
)

Generate = Callable[[list[int], SamplingParams], Awaitable[GenerationResult]]

# OpenAI's limits where the engine has none of its own.
_MAX_N = 128
_MAX_STOPS = 4


class OpenAIError(Exception):
    """A request refused with OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None,
                 type: str = "invalid_request_error"):  # noqa: A002 (OpenAI's name)
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status, message, param, code, type)

    def response(self) -> JSONResponse:
        return JSONResponse(
            {"error": {"message": self.message, "type": self.type, "param": self.param,
                       "code": self.code}},
            status_code=self.status,
        )


# ---------------------------------------------------------------------------- request bodies


TokenIds = list[Annotated[StrictInt, Field(ge=0)]]


class _Sampling(BaseModel):
    """The fields both endpoints share. Other fields OpenAI defines are ignored (`user`,
    `metadata`, ...), except those whose effect the engine cannot give, which are refused
    when set to anything but their no-op value (`_unsupported`)."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr
    n: Annotated[StrictInt, Field(ge=1, le=_MAX_N)] = 1
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=_MAX_STOPS)] | None = None
    stream: StrictBool | None = False
    stream_options: dict[str, Any] | None = None
    seed: Annotated[StrictInt, Field(ge=-(1 << 63), lt=1 << 63)] | None = None
    logit_bias: dict[str, float] | None = None

    def stops(self) -> tuple[str, ...]:
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if any(not s for s in stops):
            raise OpenAIError(400, "stop: stop strings must not be empty", param="stop")
        return stops

    def include_usage(self) -> bool:
        return bool(self.stream and (self.stream_options or {}).get("include_usage"))

    def params(self, max_tokens: int, stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            stop_token_ids=stop_token_ids,
            frequency_penalty=self.frequency_penalty or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            seed=self.seed,
        )

    def _unsupported(self, name: str, why: str) -> None:
        raise OpenAIError(400, f"{name}: {why}", param=name)

    def check(self) -> None:
        self.stops()
        if self.logit_bias:
            self._unsupported("logit_bias", "not supported by this server; omit it")


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictStr] | TokenIds | list[TokenIds]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = 16
    logprobs: Annotated[StrictInt, Field(ge=0)] | None = None
    echo: StrictBool | None = False
    suffix: StrictStr | None = None
    best_of: StrictInt | None = None

    def check(self) -> None:
        super().check()
        if self.logprobs is not None and self.logprobs > 1:
            self._unsupported(
                "logprobs", f"{self.logprobs} is not supported: this server returns the "
                "log-prob of each chosen token only (logprobs 0 or 1), not the top "
                "alternatives")
        if self.echo:
            self._unsupported("echo", "echo=true is not supported; send echo=false")
        if self.suffix:
            self._unsupported("suffix", "not supported by this server; omit it")
        if self.best_of is not None and self.best_of != self.n:
            self._unsupported("best_of", "not supported by this server; omit it or send n")

    def prompts(self, encode: Callable[[str], list[int]]) -> list[list[int]]:
        """The prompts as token ids, strings through `encode`."""
        prompt = self.prompt
        if isinstance(prompt, str):
            prompts: list = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise OpenAIError(400, "prompt: must not be empty", param="prompt")
        ids = [encode(p) if isinstance(p, str) else list(p) for p in prompts]
        if any(not p for p in ids):
            raise OpenAIError(400, "prompt: a prompt has no tokens", param="prompt")
        return ids


class ChatMessage(BaseModel):
    """One message, as OpenAI's chat API takes it. `content` is a string or a list of text
    parts; other parts (images, audio) are refused."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: StrictStr | None = None

    def text(self, index: int) -> str | None:
        if not isinstance(self.content, list):
            return self.content
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise OpenAIError(
                    400, f"messages[{index}].content: only text parts are supported "
                    f"(got type {part.get('type')!r})", param=f"messages[{index}].content")
            texts.append(part["text"])
        return "".join(texts)

    def for_template(self, index: int) -> dict[str, Any]:
        """The message as chat templates read it (plain-text content; OpenAI's "developer"
        is a system message)."""
        message: dict[str, Any] = {
            "role": "system" if self.role == "developer" else self.role,
            "content": self.text(index) or "",
        }
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        return message


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool | None = False
    top_logprobs: Annotated[StrictInt, Field(ge=0)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["auto", "none"] | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None

    def check(self) -> None:
        super().check()
        if self.top_logprobs:
            self._unsupported(
                "top_logprobs", f"{self.top_logprobs} is not supported: this server returns "
                "the log-prob of each chosen token only (top_logprobs 0), not the top "
                "alternatives")
        if isinstance(self.tool_choice, dict):
            self._unsupported("tool_choice", "only \"auto\" and \"none\" are supported")
        if self.response_format and self.response_format.get("type", "text") != "text":
            self._unsupported("response_format", "only {\"type\": \"text\"} is supported")
        for index, tool in enumerate(self.tools or ()):
            function = tool.get("function")
            if tool.get("type") != "function" or not isinstance(function, dict) \
                    or not isinstance(function.get("name"), str):
                raise OpenAIError(
                    400, f"tools[{index}]: a tool is {{\"type\": \"function\", \"function\": "
                    "{\"name\": ..., \"parameters\": {...}}}", param=f"tools[{index}]")

    @property
    def tools_offered(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


# ---------------------------------------------------------------------------- text from tokens


@dataclass(frozen=True)
class _Choice:
    """One completion as the API reports it: the result (its tokens cut after a stop string),
    its text, and why it ended."""

    result: GenerationResult
    text: str
    finish_reason: str
    parsed: ParsedOutput | None = None  # chat with tools: content and calls


class _Text:
    """The tokenizer's side of the API: prompts in, text and token strings out."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def choice(self, result: GenerationResult, stops: tuple[str, ...]) -> _Choice:
        """The result's text, cut before the first stop string; its tokens then end with the
        one that completed that match (those after it were never shown)."""
        text = self.decode(result.output_ids)
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        if cut < 0:
            return _Choice(result, text, result.finish_reason)

        def matched(k: int) -> bool:
            prefix = self.decode(result.output_ids[:k])
            return any(0 <= prefix.find(s) <= cut for s in stops)

        kept = bisect.bisect_left(range(len(result.output_ids) + 1), True, key=matched)
        result = replace(result, output_ids=result.output_ids[:kept],
                         output_logprobs=result.output_logprobs[:kept],
                         output_versions=result.output_versions[:kept],
                         finish_reason="stop", matched_stop=None)
        return _Choice(result, text[:cut], "stop")

    def pieces(self, ids: list[int], text: str) -> list[str]:
        """`text` split into one piece per token of `ids`: the text each token adds (empty
        while a token ends inside a character), found as vLLM's detokenize_incrementally
        finds it, by decoding a few tokens at a time; the pieces add up to `text`."""
        pieces: list[str] = []
        sent = produced = 0  # characters of `text` handed out; characters the tokens gave
        start = read = 0  # the decoded window: ids[start:read] gave their text already
        for k in range(1, len(ids) + 1):
            before = self.decode(ids[start:read])
            now = self.decode(ids[start:k])
            if len(now) > len(before) and not now.endswith("\ufffd"):
                produced += len(now) - len(before)
                start, read = read, k
            upto = max(sent, min(produced, len(text)))
            pieces.append(text[sent:upto])
            sent = upto
        if pieces:
            pieces[-1] += text[sent:]
        return pieces


def _usage(prompt_tokens: int, choices: list[_Choice]) -> dict[str, int]:
    completion = sum(len(c.result.output_ids) for c in choices)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion}


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


# ---------------------------------------------------------------------------- the router


class _OpenAIRoute(APIRoute):
    """Answers every refusal of these routes with OpenAI's error body: a body that fails
    validation, OpenAIError, and what the engine refuses (RequestError). The app's own
    handlers (SGLang's body) keep serving the native routes."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def route(request: Request):
            try:
                return await handler(request)
            except RequestValidationError as exc:
                return _invalid_body(exc).response()
            except OpenAIError as exc:
                return exc.response()
            except RequestError as exc:
                return OpenAIError(400, str(exc)).response()
            except EpisodeLimitReached as exc:
                return OpenAIError(400, str(exc), code="episode_limit_reached").response()
            except EpisodeNotRunning as exc:
                return OpenAIError(404, str(exc), code="episode_not_found").response()

        return route


def _invalid_body(exc: RequestValidationError) -> OpenAIError:
    """A body that failed validation as one 400 naming each bad field. A field of several
    shapes fails once per shape; it is named once, with the shapes it takes (_SHAPES)."""
    by_path: dict[str, list[str]] = {}
    for error in exc.errors():
        loc = [p for p in error.get("loc", ()) if p != "body"]
        # A union's alternatives add their type's name to the path (prompt.str, ...).
        loc = [p for p in loc if not (isinstance(p, str) and ("[" in p or p in _TYPE_NAMES))]
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
        message = error.get("msg", "invalid").removeprefix("Value error, ")
        by_path.setdefault(path, []).append(message)
    for field, shape in _SHAPES.items():
        paths = [p for p in by_path if p == field or p.startswith((f"{field}[", f"{field}."))]
        if sum(len(by_path[p]) for p in paths) > 1:
            for path in paths:
                del by_path[path]
            by_path[field] = [f"must be {shape}"]
    parts = [f"{path or 'request body'}: {'; '.join(dict.fromkeys(messages))}"
             for path, messages in by_path.items()]
    first = next(iter(by_path), "")
    return OpenAIError(400, "; ".join(parts) or "invalid request body", param=first or None)


# The names pydantic gives a union's alternatives in an error's path.
_TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "function-after", "constrained-int"}

# What the fields of several shapes take.
_SHAPES = {
    "prompt": "a string, a list of strings, a list of token ids (ints >= 0), "
              "or a list of such lists",
    "stop": f"a string or a list of up to {_MAX_STOPS} strings",
    "tool_choice": '"auto" or "none" (a named function is not supported)',
}


async def engine_results(futures: list[Future], rids: list[str],
                         abort: Callable[[list[str]], Any]) -> list[GenerationResult]:
    """The results of requests submitted to the torch engine (`rids` their ids). If the
    awaiting handler is cancelled (its client went away), the requests are aborted, without
    waiting, so they free their slots; the engine's futures themselves are never cancelled."""
    try:
        return await asyncio.gather(*(asyncio.shield(asyncio.wrap_future(f)) for f in futures))
    except asyncio.CancelledError:
        asyncio.get_running_loop().run_in_executor(None, abort, rids)
        raise


def submitted(submit: Callable[[list[int], SamplingParams, str], Future],
              abort: Callable[[list[str]], Any]) -> Generate:
    """`generate` over an engine's submit path (the torch engine's `submit(prompt_ids, params,
    rid) -> Future` and `abort(rids)`), aborting a request whose caller is gone."""

    async def generate(prompt_ids: list[int], params: SamplingParams) -> GenerationResult:
        rid = uuid.uuid4().hex
        (result,) = await engine_results([submit(prompt_ids, params, rid)], [rid], abort)
        return result

    return generate


def openai_router(generate: Generate, tokenizer, *, model_name: str,
                  max_sequence_length: int, episodes: EpisodeBook | None = None,
                  episode_sampling: SamplingParams | None = None) -> APIRouter:
    """The OpenAI-compatible routes over `generate` (an InferenceEngine's, or the torch
    engine's submit path), serving `model_name` with `tokenizer`; `max_sequence_length` bounds
    prompt + max_tokens, as the engine does. With `episodes`, the same routes under
    `/episodes/{episode_id}` record into that episode; a temperature or top_p an episode's
    call leaves unset is `episode_sampling`'s (the job's rollout settings)."""
    router = APIRouter(route_class=_OpenAIRoute)
    text = _Text(tokenizer)
    created = int(time.time())
    chat_end = _chat_end_ids(tokenizer)

    def check_model(name: str) -> None:
        if name != model_name:
            raise OpenAIError(404, f"The model {name!r} does not exist; this server serves "
                              f"{model_name!r}", param="model", code="model_not_found")

    def episode_of(request: Request) -> Episode | None:
        episode_id = request.path_params.get("episode_id")
        return None if episodes is None or episode_id is None else episodes.get(episode_id)

    def max_tokens(prompt: list[int], requested: int | None, field: str) -> int:
        room = max_sequence_length - len(prompt)
        if requested is None:
            if room < 1:
                raise OpenAIError(
                    400, f"{field}: the prompt has {len(prompt)} tokens, which leaves no "
                    f"room to answer within this server's maximum context length "
                    f"{max_sequence_length}", param=field)
            return room
        if requested > room:
            raise OpenAIError(
                400, f"max_tokens: the prompt ({len(prompt)} tokens) + max_tokens "
                f"({requested}) exceeds this server's maximum context length "
                f"{max_sequence_length}; shorten the prompt or lower max_tokens",
                param="max_tokens")
        return requested

    def sampling(body: _Sampling, episode: Episode | None, tokens: int,
                 stop_token_ids: tuple[int, ...] = ()) -> SamplingParams:
        params = body.params(tokens, stop_token_ids)
        if episode is not None and episode_sampling is not None:
            unset = {"temperature", "top_p"} - body.model_fields_set
            params = replace(params, **{name: getattr(episode_sampling, name) for name in unset})
            if params.temperature != episode_sampling.temperature:
                # The trainer computes every token's log-prob at the job's temperature.
                raise OpenAIError(
                    400, f"temperature: an episode's calls sample at the job's "
                    f"rollout.temperature ({episode_sampling.temperature:g}), the temperature "
                    f"the trainer computes log-probs at, not {params.temperature:g}; leave "
                    "temperature unset, or change rollout.temperature", param="temperature")
        _check(params)
        return params

    def encoder(episode: Episode | None, special_tokens: bool) -> Callable[[str], list[int]]:
        if episode is None:
            return lambda prompt: tokenizer.encode(prompt, add_special_tokens=special_tokens)
        return lambda prompt: episode.tokenize(prompt, tokenizer, special_tokens=special_tokens)

    async def _complete(prompt_ids: list[int], params: SamplingParams, n: int,
                        stops: tuple[str, ...], episode: Episode | None,
                        response_id: str) -> list[_Choice]:
        """`n` completions of one prompt (every completion of this API passes here)."""
        results = await _all(generate(prompt_ids, params.substream(index))
                             for index in range(n))
        choices = [text.choice(result, stops) for result in results]
        if episode is not None:
            episode.record(response_id, prompt_ids, [c.result for c in choices])
        return choices

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "asyncrl"}

    async def list_models(request: Request):
        episode_of(request)
        return {"object": "list", "data": [model_card()]}

    async def retrieve_model(model: str, request: Request):
        episode_of(request)
        check_model(model)
        return model_card()

    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        body.check()
        episode = episode_of(request)
        stops = body.stops()
        prompts = body.prompts(encoder(episode, special_tokens=True))
        requested = body.max_tokens
        if episode is not None:  # one turn for the call, its budget shared by its prompts
            requested = episode.allow(requested, body.n * len(prompts))
        params = [sampling(body, episode, max_tokens(p, requested, "prompt")) for p in prompts]
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": model_name, "system_fingerprint": None}
        per_prompt = await _all(
            _complete(prompt, p, body.n, stops, episode, head["id"])
            for prompt, p in zip(prompts, params))
        choices = [c for group in per_prompt for c in group]
        usage = _usage(sum(len(p) for p in prompts), choices)
        if body.stream:
            return _stream(_completion_chunks(head, choices, body.logprobs, text,
                                              usage if body.include_usage() else None))
        return {**head, "usage": usage, "choices": [
            {"index": index, "text": c.text, "finish_reason": c.finish_reason,
             "logprobs": _completion_logprobs(c, body.logprobs, text)}
            for index, c in enumerate(choices)]}

    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        body.check()
        episode = episode_of(request)
        stops = body.stops()
        prompt = encoder(episode, special_tokens=False)(_render(tokenizer, body))
        requested = body.max_new_tokens()
        if episode is not None:
            requested = episode.allow(requested, body.n)
        params = sampling(body, episode, max_tokens(prompt, requested, "messages"), chat_end)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": model_name, "system_fingerprint": None}
        choices = await _complete(prompt, params, body.n, stops, episode, head["id"])
        if body.tools_offered:
            choices = [_with_calls(c) for c in choices]
        usage = _usage(len(prompt), choices)
        if body.stream:
            return _stream(_chat_chunks(head, choices, bool(body.logprobs), text,
                                        usage if body.include_usage() else None))
        return {**head, "usage": usage, "choices": [
            {"index": index, "message": _message(c), "finish_reason": c.finish_reason,
             "logprobs": _chat_logprobs(c, text) if body.logprobs else None}
            for index, c in enumerate(choices)]}

    for prefix in ("", "/episodes/{episode_id}") if episodes is not None else ("",):
        router.add_api_route(f"{prefix}/v1/models", list_models, methods=["GET"])
        router.add_api_route(f"{prefix}/v1/models/{{model:path}}", retrieve_model,
                             methods=["GET"])
        router.add_api_route(f"{prefix}/v1/completions", completions, methods=["POST"])
        router.add_api_route(f"{prefix}/v1/chat/completions", chat_completions,
                             methods=["POST"])
    return router


async def _all(coroutines) -> list:
    """The results of `coroutines`, run together; if one fails (the engine refuses a
    prompt), the others are cancelled, which aborts their requests, and its error is raised."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


def _check(params: SamplingParams) -> None:
    try:
        params.check()
    except RequestError as exc:  # the fields are checked above; this is a last guard
        raise OpenAIError(400, str(exc)) from None


def _chat_end_ids(tokenizer) -> tuple[int, ...]:
    """The tokens that end an assistant turn: the tokenizer's EOS, and the chat template's
    end-of-turn token where it is another (ChatML's <|im_end|>, as Qwen's base models have)."""
    ids = {tokenizer.eos_token_id}
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if isinstance(end, int) and end != tokenizer.unk_token_id:
        ids.add(end)
    return tuple(sorted(i for i in ids if i is not None))


# ---------------------------------------------------------------------------- chat


def _render(tokenizer, body: ChatCompletionRequest) -> str:
    """The prompt's text: the messages through the model's chat template, with the tools
    offered. Where the template ignores `tools` (SmolLM2's does), they are offered in a
    system message in the Hermes layout, and earlier calls and their results are shown as
    Hermes' `<tool_call>` and `<tool_response>` text, so tools reach the model either way."""
    messages = [m.for_template(i) for i, m in enumerate(body.messages)]
    tools = body.tools if body.tools_offered else None
    try:
        prompt = _apply(tokenizer, messages, tools)
        if tools and prompt == _apply(tokenizer, messages, None):
            prompt = _apply(tokenizer, _hermes_messages(messages, tools), None)
    except Exception as exc:  # jinja's TemplateError, a template's raise_exception, a bad call
        raise OpenAIError(400, f"messages: the chat template refused them: {exc}",
                          param="messages") from None
    return prompt


def _apply(tokenizer, messages: list[dict[str, Any]], tools) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                         tokenize=False)


def _hermes_messages(messages: list[dict[str, Any]], tools) -> list[dict[str, Any]]:
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    rest = messages[1:] if system is not None else messages
    out = [{"role": "system", "content": hermes_system_prompt(tools, system)}]
    for message in rest:
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = [tool_call_text(call["function"]["name"], call["function"]["arguments"])
                     for call in message["tool_calls"]]
            content = "\n".join(([message["content"]] if message["content"] else []) + calls)
            out.append({"role": "assistant", "content": content})
        elif message["role"] == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        else:
            out.append({"role": message["role"], "content": message["content"]})
    return out


def _with_calls(choice: _Choice) -> _Choice:
    parsed = parse_tool_calls(choice.text)
    reason = "tool_calls" if parsed.tool_calls else choice.finish_reason
    return replace(choice, parsed=parsed, finish_reason=reason)


def _tool_calls(choice: _Choice) -> list[dict[str, Any]]:
    calls = choice.parsed.tool_calls if choice.parsed else ()
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": call.name, "arguments": call.arguments}} for call in calls]


def _message(choice: _Choice) -> dict[str, Any]:
    content = choice.parsed.content if choice.parsed else choice.text
    message: dict[str, Any] = {"role": "assistant", "content": content}
    calls = _tool_calls(choice)
    if calls:
        message["tool_calls"] = calls
    return message


def _chat_logprob(token_id: int, logprob: float, text: _Text) -> dict[str, Any]:
    token = text.token(token_id)
    return {"token": token, "logprob": logprob, "bytes": list(token.encode()),
            "top_logprobs": []}


def _chat_logprobs(choice: _Choice, text: _Text) -> dict[str, Any]:
    r = choice.result
    return {"content": [_chat_logprob(t, lp, text)
                        for t, lp in zip(r.output_ids, r.output_logprobs)],
            "refusal": None}


def _chat_chunks(head, choices: list[_Choice], logprobs: bool, text: _Text,
                 usage: dict[str, int] | None):
    head = {**head, "object": "chat.completion.chunk"}

    def chunk(index: int, delta: dict[str, Any], finish: str | None = None,
              entry: dict[str, Any] | None = None) -> str:
        return _sse({**head, "choices": [{
            "index": index, "delta": delta, "finish_reason": finish,
            "logprobs": {"content": [entry], "refusal": None} if entry else None}]})

    for index, c in enumerate(choices):
        yield chunk(index, {"role": "assistant", "content": ""})
        r = c.result
        if c.parsed and c.parsed.tool_calls:
            # Calls are known only once the whole text is: content, then the calls, at once.
            if c.parsed.content:
                yield chunk(index, {"content": c.parsed.content})
            calls = [{"index": i, **call} for i, call in enumerate(_tool_calls(c))]
            yield chunk(index, {"tool_calls": calls})
            if logprobs:
                for t, lp in zip(r.output_ids, r.output_logprobs):
                    yield chunk(index, {}, entry=_chat_logprob(t, lp, text))
        else:
            content = c.parsed.content if c.parsed else c.text
            pieces = text.pieces(r.output_ids, content or "")
            for piece, t, lp in zip(pieces, r.output_ids, r.output_logprobs):
                yield chunk(index, {"content": piece},
                            entry=_chat_logprob(t, lp, text) if logprobs else None)
        yield chunk(index, {}, c.finish_reason)
    if usage is not None:
        yield _sse({**head, "choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------------------- completions


def _completion_logprobs(choice: _Choice, logprobs: int | None,
                         text: _Text) -> dict[str, Any] | None:
    if logprobs is None:
        return None
    r = choice.result
    tokens = [text.token(t) for t in r.output_ids]
    offsets = [0]
    for token in tokens[:-1]:
        offsets.append(offsets[-1] + len(token))
    return {"tokens": tokens, "token_logprobs": list(r.output_logprobs),
            "top_logprobs": ([{tok: lp} for tok, lp in zip(tokens, r.output_logprobs)]
                             if logprobs >= 1 else None),
            "text_offset": offsets[:len(tokens)]}


def _completion_chunks(head, choices: list[_Choice], logprobs: int | None, text: _Text,
                       usage: dict[str, int] | None):
    for index, c in enumerate(choices):
        r = c.result
        per_token = _completion_logprobs(c, logprobs, text)
        for k, piece in enumerate(text.pieces(r.output_ids, c.text)):
            entry = None
            if per_token is not None:
                entry = {key: (None if value is None else value[k:k + 1])
                         for key, value in per_token.items()}
            yield _sse({**head, "choices": [{"index": index, "text": piece,
                                              "logprobs": entry, "finish_reason": None}]})
        yield _sse({**head, "choices": [{"index": index, "text": "", "logprobs": None,
                                          "finish_reason": c.finish_reason}]})
    if usage is not None:
        yield _sse({**head, "choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


def _stream(chunks) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
