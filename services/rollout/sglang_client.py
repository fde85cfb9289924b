"""An async client for SGLang's native HTTP API.

The rollout service drives a real SGLang server on GPUs and the torch engine's
SGLang-compatible API (`asyncrl.rollout.http_api`) on CPUs through this one client. The request
bodies follow SGLang's request models (`sglang.srt.managers.io_struct`: GenerateReqInput,
PauseGenerationReqInput, ContinueGenerationReqInput, UpdateWeightFromDiskReqInput, AbortReq,
LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput) and its HTTP contract for /generate
(`sglang.api.v1.api_types.GenerateRequest`, whose `sampling_params` refuses unknown keys).
They are built by pure functions (`generate_payload`, ...) that
`tests/support/sglang_requests.py` feeds to SGLang's own models.

Token-in/token-out: prompts go in as `input_ids` and come back as `output_ids` (the server runs
with `--skip-tokenizer-init`); every request asks for `return_logprob`, so each output token
has its log-probability (`meta_info.output_token_logprobs`, `[logprob, token_id, text]`).

The policy version of each output token is read, in this order, from:

1. `meta_info.output_token_versions`: one integer per token (the torch engine's extension);
2. `meta_info.weight_versions`: SGLang's spans `[{"version", "start", "end"}]`, which SGLang
   reports for a finished request whose tokens came from more than one weight version;
3. `meta_info.weight_version`: every token is tagged with this one version (SGLang's answer
   when the weights did not change during the request);
4. the client's known version (`SGLangClient.version`: the one it last loaded with
   `update_weights_from_disk`, or was given), when the server reports none.

SGLang's weight versions are strings; ours are integers. The client sends `str(version)`
(start the server with `--weight-version 0`, as `sglang_launch_command` does), and a version
string that is not an integer (SGLang's default is "default") counts as not reported.

LoRA (model.lora): each version is an adapter, loaded beside the base with /load_lora_adapter
under its own name (`adapter_name`), and a request names the adapter that generates it
(`lora_path`, which SGLang resolves by name). SGLang's weight version is then the base model's,
so the tokens of such a request are the version of the adapter it named (after our per-token
versions, where a server reports them).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Literal

import httpx

from asyncrl.engine.types import FinishReason, GenerationResult, SamplingParams, WeightUpdate
from asyncrl.weights.distributed import GroupAddress, TensorMeta

#: SGLang's pause modes: "abort" ends running requests; "retract" puts them back in the
#: waiting queue (their KV cache may be dropped and is recomputed on continue); "in_place"
#: freezes them with their KV cache.
PauseMode = Literal["abort", "retract", "in_place"]


class SGLangError(RuntimeError):
    """A request the server refused or could not answer.

    `status` is the HTTP status (None when the server could not be reached), `endpoint` the
    path, `message` the server's own message.
    """

    def __init__(self, endpoint: str, status: int | None, message: str):
        self.endpoint = endpoint
        self.status = status
        self.message = message
        where = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"SGLang {endpoint}: {where}: {message}")


class SGLangResponseError(SGLangError):
    """A 2xx answer whose body is not what SGLang's API promises."""


# ---------------------------------------------------------------------------- request bodies


def sampling_params_payload(params: SamplingParams) -> dict[str, Any]:
    """`sampling_params` in SGLang's names. top_k -1 means "off" and temperature 0 means
    greedy in SGLang too, so values pass through unchanged; ignore_eos and the penalties have
    SGLang's names and meanings and are sent only when set."""
    body: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
    }
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if params.ignore_eos:
        body["ignore_eos"] = True
    if params.frequency_penalty:
        body["frequency_penalty"] = params.frequency_penalty
    if params.presence_penalty:
        body["presence_penalty"] = params.presence_penalty
    return body


def generate_payload(input_ids: list[int], params: SamplingParams, rid: str,
                     adapter: str | None = None) -> dict[str, Any]:
    """The /generate body for one prompt; `adapter`: the loaded LoRA adapter that generates
    it (SGLang's lora_path takes the adapter's name), else the base model."""
    body = {
        "input_ids": list(input_ids),
        "sampling_params": sampling_params_payload(params),
        "return_logprob": True,
        "rid": rid,
    }
    if adapter is not None:
        body["lora_path"] = adapter
    return body


def generate_batch_payload(
    prompts: list[list[int]], params: SamplingParams, rids: list[str]
) -> dict[str, Any]:
    """The /generate body for several prompts in one request (SGLang's batch form: a list of
    token lists, one rid per prompt, one sampling_params for all)."""
    if len(rids) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts need {len(prompts)} rids, got {len(rids)}")
    if not prompts:
        raise ValueError("a batch needs at least one prompt")
    return {
        "input_ids": [list(p) for p in prompts],
        "sampling_params": sampling_params_payload(params),
        "return_logprob": True,
        "rid": list(rids),
    }


def pause_payload(mode: PauseMode = "retract") -> dict[str, Any]:
    return {"mode": mode}


def continue_payload() -> dict[str, Any]:
    return {}


def update_weights_payload(model_path: str, version: int) -> dict[str, Any]:
    """/update_weights_from_disk: SGLang's weight_version is a string. The KV cache is
    flushed after the update (SGLang's default, spelled out), so no request continues on keys
    and values computed by the old weights."""
    return {"model_path": model_path, "weight_version": str(version), "flush_cache": True}


def adapter_name(version: int) -> str:
    """The name policy `version`'s LoRA adapter is loaded under: one name per version, so a
    new version loads beside the one still serving requests that named it."""
    return f"v{version}"


def adapter_version(name: str) -> int | None:
    """The policy version an `adapter_name` names; None for any other name."""
    digits = name.removeprefix("v")
    return int(digits) if name.startswith("v") and digits.isdigit() else None


def load_adapter_payload(name: str, path: str) -> dict[str, Any]:
    """/load_lora_adapter: the peft adapter directory at `path` (on the server's file system)
    under `name`."""
    return {"lora_name": name, "lora_path": path}


def unload_adapter_payload(name: str) -> dict[str, Any]:
    return {"lora_name": name}


def init_weights_group_payload(address: GroupAddress, rank_offset: int) -> dict[str, Any]:
    """/init_weights_update_group: the server's tensor-parallel rank r joins as rank_offset + r."""
    return {"master_address": address.master_address, "master_port": address.master_port,
            "rank_offset": rank_offset, "world_size": address.world_size,
            "group_name": address.group_name, "backend": address.backend}


def distributed_update_payload(
    tensors: list[TensorMeta], group_name: str, version: int | None,
) -> dict[str, Any]:
    """/update_weights_from_distributed for one bucket: the server receives each named tensor
    from rank 0's broadcast, in this order. The bucket that names the version is the last:
    it flushes the KV cache (keys and values of the old weights) and sets the version."""
    body: dict[str, Any] = {
        "names": [t.name for t in tensors],
        "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
        "shapes": [list(t.shape) for t in tensors],
        "group_name": group_name,
        "flush_cache": version is not None,
    }
    if version is not None:
        body["weight_version"] = str(version)
    return body


def abort_payload(rid: str | None = None) -> dict[str, Any]:
    """/abort_request for one request, or for every request when rid is None."""
    return {"abort_all": True} if rid is None else {"rid": rid}


# ---------------------------------------------------------------------------- responses


def parse_version(value: Any) -> int | None:
    """An integer policy version from SGLang's string weight version, or None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            return None
    return None


def parse_finish_reason(value: Any) -> tuple[FinishReason, int | None]:
    """SGLang's finish_reason as (reason, matched stop token).

    SGLang sends `{"type": "stop", "matched": <token id, token ids or stop string>}`,
    `{"type": "length", "length": n}` or `{"type": "abort", "message": ...}`; an OpenAI-style
    plain string is accepted too. The matched token is the id (the last one when a list);
    a matched stop string gives None.
    """
    kind = value.get("type") if isinstance(value, dict) else value
    if kind not in ("stop", "length", "abort"):
        raise ValueError(f"unknown finish_reason {value!r}")
    matched = value.get("matched") if isinstance(value, dict) else None
    if isinstance(matched, list):
        matched = matched[-1] if matched else None
    if not isinstance(matched, int) or isinstance(matched, bool):
        matched = None
    return kind, matched


def token_versions(meta_info: dict[str, Any], count: int, known: int | None) -> list[int]:
    """The policy version of each of `count` output tokens (see the module docstring for the
    order of sources). Raises ValueError when no version can be found or the per-token list
    has the wrong length."""
    per_token = meta_info.get("output_token_versions")
    if per_token is not None:
        versions = [parse_version(v) for v in per_token]
        if len(versions) != count or any(v is None for v in versions):
            raise ValueError(
                f"output_token_versions {per_token!r} is not {count} integer versions"
            )
        return versions
    spans = meta_info.get("weight_versions")
    if spans:
        versions = []
        for span in spans:
            version = parse_version(span.get("version"))
            if version is None:
                break  # not our integer versions: fall through to weight_version
            versions += [version] * max(min(span["end"], count) - len(versions), 0)
        else:
            # Tokens past the last span (SGLang drops spans that start past the output)
            # come from the last span's version.
            return versions + [versions[-1] if versions else known] * (count - len(versions))
    version = parse_version(meta_info.get("weight_version"))
    if version is None:
        version = known
    if version is None and count:
        raise ValueError(
            "the server reports no integer weight version and the client knows none; "
            "start SGLang with --weight-version 0 or give SGLangClient(version=...)"
        )
    return [version] * count


def parse_generate_response(
    body: Any, *, prompt_ids: list[int], rid: str, known_version: int | None = None,
    adapter_version: int | None = None,
) -> GenerationResult:
    """One /generate output (`{"output_ids": [...], "meta_info": {...}}`) as a
    GenerationResult. Raises ValueError when the body lacks what was asked for.

    Tokens come from `output_ids`, log-probabilities from `meta_info.output_token_logprobs`;
    their ids must agree. If `output_ids` is shorter and a prefix of the logprob ids (a stop
    token trimmed from the output), the logprob ids are used, so every token keeps its
    log-probability. `interruptions` counts the version changes inside the output (a weight
    update during which the request produced no token is not visible there).
    `adapter_version`: the version of the LoRA adapter the request named, which made every
    token the server gives no per-token version for.
    """
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise ValueError(f"expected an object with output_ids and meta_info, got {body!r:.200}")
    meta = body["meta_info"]
    output_ids = body.get("output_ids")
    if not isinstance(output_ids, list):
        raise ValueError("the response has no output_ids (is the server started with "
                         "--skip-tokenizer-init?)")
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise ValueError("meta_info has no output_token_logprobs although return_logprob "
                         "was requested")
    logprob_ids = [int(t[1]) for t in triples]
    if logprob_ids != output_ids:
        if len(output_ids) < len(logprob_ids) and logprob_ids[: len(output_ids)] == output_ids:
            output_ids = logprob_ids
        else:
            raise ValueError(
                f"output_token_logprobs ids {logprob_ids[:8]}... do not match output_ids "
                f"{output_ids[:8]}..."
            )
    logprobs = [float(t[0]) for t in triples]
    reason, matched = parse_finish_reason(meta.get("finish_reason"))
    if adapter_version is not None and "output_token_versions" not in meta:
        versions = [adapter_version] * len(output_ids)
    elif reason == "abort" and "output_token_versions" not in meta and known_version is not None:
        # An aborted request's tokens were all generated before the pause that aborted it;
        # the server may report its version only after a weight update has landed, so the
        # version the caller pinned when it sent the request is the true one.
        versions = [known_version] * len(output_ids)
    else:
        versions = token_versions(meta, len(output_ids), known_version)
    return GenerationResult(
        request_id=str(meta.get("id", rid)),
        prompt_ids=list(prompt_ids),
        output_ids=[int(t) for t in output_ids],
        output_logprobs=logprobs,
        output_versions=versions,
        finish_reason=reason,
        matched_stop=matched,
        interruptions=sum(1 for a, b in zip(versions, versions[1:]) if a != b),
    )


def error_message(response: httpx.Response) -> str:
    """The server's own message from an error response: SGLang's `{"error": {"message"}}`,
    its contract errors `{"error": "..."}`, a weight update's `{"message"}`, an adapter
    update's `{"error_message"}`, FastAPI's `{"detail"}`, or the raw text."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip() or response.reason_phrase
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if isinstance(error, str):
            return error
        for key in ("message", "error_message", "detail"):
            if body.get(key):
                return str(body[key])
    return response.text.strip() or response.reason_phrase


# ---------------------------------------------------------------------------- the client


class SGLangClient:
    """Drives one SGLang (or SGLang-compatible) server. Use as `async with SGLangClient(url)
    as client:` or call `aclose()`.

    `version` is the client's known policy version: the initial one given here, then the one
    of each successful `update_weights_from_disk`. It tags output tokens only when the server
    reports no integer version (see the module docstring).
    """

    def __init__(self, base_url: str, *, timeout: float = 600.0, version: int | None = 0):
        self.base_url = base_url.rstrip("/")
        self.version = version
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=timeout)

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *_) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(
        self, method: str, path: str, body: dict[str, Any] | None = None, **kwargs
    ) -> httpx.Response:
        try:
            response = await self._http.request(method, path, json=body, **kwargs)
        except httpx.TimeoutException as exc:
            raise SGLangError(path, None, f"timed out ({type(exc).__name__})") from exc
        except httpx.TransportError as exc:
            raise SGLangError(path, None, f"cannot reach {self.base_url}: {exc}") from exc
        if response.status_code >= 400:
            raise SGLangError(path, response.status_code, error_message(response))
        return response

    @staticmethod
    def _json(response: httpx.Response, path: str) -> Any:
        try:
            return response.json()
        except ValueError:
            raise SGLangResponseError(
                path, response.status_code, f"expected JSON, got {response.text[:200]!r}"
            ) from None

    async def generate(
        self, input_ids: list[int], params: SamplingParams, rid: str | None = None, *,
        version: int | None = None, adapter: str | None = None,
    ) -> GenerationResult:
        """Generates one response. A request aborted by `abort` (or by a pause in mode
        "abort") returns with finish_reason "abort" and the tokens it had. `version` is the
        policy version the caller pinned before sending (default: the client's known one):
        it tags tokens the server reports no version for, and every token of an aborted
        request (see parse_generate_response). `adapter`: the LoRA adapter (loaded with
        `load_lora_adapter`) that generates it, as policy `version`."""
        rid = rid or uuid.uuid4().hex
        body = generate_payload(input_ids, params, rid, adapter)
        response = await self._request("POST", "/generate", body)
        pinned = self.version if version is None else version
        return self._parse(self._json(response, "/generate"), input_ids, rid, version,
                           adapter_version=pinned if adapter is not None else None)

    async def generate_batch(
        self, prompts: list[list[int]], params: SamplingParams, rids: list[str] | None = None
    ) -> list[GenerationResult]:
        """Generates one response per prompt in a single request (SGLang's batch form)."""
        rids = rids or [uuid.uuid4().hex for _ in prompts]
        body = generate_batch_payload(prompts, params, rids)
        outputs = self._json(await self._request("POST", "/generate", body), "/generate")
        if not isinstance(outputs, list) or len(outputs) != len(prompts):
            raise SGLangResponseError(
                "/generate", 200, f"expected a list of {len(prompts)} outputs, got {outputs!r:.200}"
            )
        return [self._parse(o, p, r) for o, p, r in zip(outputs, prompts, rids)]

    def _parse(
        self, body: Any, prompt_ids: list[int], rid: str, version: int | None = None,
        adapter_version: int | None = None,
    ) -> GenerationResult:
        try:
            return parse_generate_response(
                body, prompt_ids=prompt_ids, rid=rid,
                known_version=self.version if version is None else version,
                adapter_version=adapter_version,
            )
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise SGLangResponseError("/generate", 200, str(exc)) from exc

    async def pause(self, mode: PauseMode = "retract") -> None:
        """Stops generation. The default "retract" keeps every request: on `resume` each
        continues from prompt + tokens so far (recomputing its KV cache), under whatever
        weights were loaded meanwhile."""
        await self._request("POST", "/pause_generation", pause_payload(mode))

    async def resume(self) -> None:
        await self._request("POST", "/continue_generation", continue_payload())

    async def update_weights_from_disk(self, path: str, version: int) -> WeightUpdate:
        """Loads the weights at `path` as policy `version` (on the server's file system).
        `seconds` is measured here, round trip included."""
        started = time.perf_counter()
        body = await self._confirmed("/update_weights_from_disk",
                                     update_weights_payload(path, version))
        self.version = version
        return WeightUpdate(
            version=version,
            interrupted_requests=int(body.get("num_paused_requests") or 0),
            seconds=time.perf_counter() - started,
        )

    async def init_weights_update_group(self, address: GroupAddress, rank_offset: int) -> None:
        """Joins the server to the weight transfer group; returns once the group has formed
        (every rank joined), so no HTTP timeout applies."""
        await self._confirmed("/init_weights_update_group",
                              init_weights_group_payload(address, rank_offset), timeout=None)

    async def destroy_weights_update_group(self, group_name: str) -> None:
        """Has the server leave a weight transfer group (one of an earlier generation)."""
        await self._confirmed("/destroy_weights_update_group", {"group_name": group_name})

    async def update_weights_from_distributed(
        self, tensors: list[TensorMeta], group_name: str, version: int | None,
    ) -> None:
        """Receives one bucket of the transfer (see `distributed_update_payload`)."""
        await self._confirmed("/update_weights_from_distributed",
                              distributed_update_payload(tensors, group_name, version))
        if version is not None:
            self.version = version

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Loads the peft adapter directory at `path` (on the server's file system) beside
        the base, as adapter `name`; requests name it to be generated by it."""
        await self._confirmed("/load_lora_adapter", load_adapter_payload(name, path))

    async def unload_lora_adapter(self, name: str) -> None:
        """Unloads adapter `name`; SGLang first lets the requests that named it finish."""
        await self._confirmed("/unload_lora_adapter", unload_adapter_payload(name))

    async def _confirmed(self, path: str, body: dict[str, Any], **kwargs) -> dict[str, Any]:
        """POSTs `body`; the answer must say success: true."""
        response = await self._request("POST", path, body, **kwargs)
        answer = self._json(response, path)
        if not isinstance(answer, dict) or answer.get("success") is not True:
            message = (answer.get("message") or answer.get("error_message")
                       if isinstance(answer, dict) else None)
            raise SGLangError(path, response.status_code,
                              message or f"not confirmed: {answer!r:.200}")
        return answer

    async def abort(self, rid: str | None = None) -> None:
        """Aborts one request, or all requests when rid is None."""
        await self._request("POST", "/abort_request", abort_payload(rid))

    async def health(self) -> bool:
        """True when the server answers /health with 200."""
        try:
            response = await self._http.get("/health", timeout=10.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def model_info(self) -> dict[str, Any]:
        response = await self._request("GET", "/get_model_info")
        return self._json(response, "/get_model_info")

    async def wait_until_healthy(self, timeout: float, interval: float = 0.5) -> None:
        """Polls /health until it answers 200; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while not await self.health():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{self.base_url} was not healthy within {timeout:g}s")
            await asyncio.sleep(interval)
