"""The OpenAI-compatible API of the rollout worker (asyncrl.rollout.openai_api), served by
uvicorn on a loopback port beside the native SGLang-compatible API and driven by the official
`openai` client.

The engine is the torch engine on a tiny random model with SmolLM2's vocabulary, so text goes
through SmolLM2's real tokenizer and chat template; greedy answers are checked against the
native /generate's tokens for the same prompt ids. Tool calls, which a random model never
writes, are checked through the same router over a generate function that answers with the
tokens of a chosen text (a real tokenizer round trip)."""

from __future__ import annotations

import copy
import json

import httpx
import openai
import pytest
from fastapi import FastAPI

from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.model.policy import load_tokenizer
from asyncrl.rollout.http_api import create_app
from asyncrl.rollout.metrics import RolloutMetrics
from asyncrl.rollout.openai_api import openai_router
from support.rollout import queued
from support.scripted import Scripted
from support.servers import HttpServer
from support.tiny_model import tiny_model
from support.waiting import wait_for

MODEL = "tiny-random"
MAX_SEQUENCE_LENGTH = 512
# Log-probs of the same tokens agree up to float noise: the batch a request is decoded in
# changes the last bits.
LOGPROB_NOISE = 1e-5
HELLO = [{"role": "user", "content": "Hello! What is 2 + 2?"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture(scope="module")
def service(tokenizer):
    engine = TorchEngine(tiny_model(0, len(tokenizer)), max_running_requests=8,
                         max_sequence_length=MAX_SEQUENCE_LENGTH,
                         eos_token_ids=(tokenizer.eos_token_id,), seed=0).start()
    app = create_app(engine, model_path=MODEL, metrics=RolloutMetrics(job="test-job"),
                     tokenizer=tokenizer)
    with HttpServer(app) as server, httpx.Client(base_url=server.url, timeout=60) as native:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0,
                               timeout=60)
        yield client, native, engine
    engine.stop()


@pytest.fixture
def client(service) -> openai.OpenAI:
    return service[0]


@pytest.fixture
def native(service) -> httpx.Client:
    return service[1]


def native_greedy(native, prompt_ids, max_new_tokens, **sampling):
    response = native.post("/generate", json={
        "input_ids": prompt_ids, "return_logprob": True,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": max_new_tokens, **sampling}})
    assert response.status_code == 200, response.text
    out = response.json()
    return out["output_ids"], [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]


def chat_prompt_ids(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def text_of(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=True)


# ---------------------------------------------------------------------------- models


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].object == "model"
    assert client.models.retrieve(MODEL).id == MODEL


def test_an_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as error:
        client.models.retrieve("gpt-4o")
    assert "gpt-4o" in error.value.message
    for call in (
        lambda: client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2),
        lambda: client.chat.completions.create(model="gpt-4o", messages=HELLO, max_tokens=2),
    ):
        with pytest.raises(openai.NotFoundError) as error:
            call()
        assert error.value.status_code == 404
        assert error.value.body["param"] == "model"
        assert error.value.body["code"] == "model_not_found"


# ---------------------------------------------------------------------------- completions


def test_greedy_completion_is_the_native_apis_tokens(client, native, tokenizer):
    prompt = "The capital of France is"
    ids = tokenizer.encode(prompt)
    expected_ids, expected_logprobs = native_greedy(native, ids, 8)
    for given in (prompt, ids):  # a string, or the token ids themselves
        out = client.completions.create(model=MODEL, prompt=given, max_tokens=8,
                                        temperature=0, logprobs=1)
        choice = out.choices[0]
        assert choice.text == text_of(tokenizer, expected_ids)
        assert choice.finish_reason == "length"
        assert choice.logprobs.token_logprobs == pytest.approx(expected_logprobs, abs=LOGPROB_NOISE)
        assert choice.logprobs.tokens == [tokenizer.decode([t]) for t in expected_ids]
        assert choice.logprobs.top_logprobs == [
            {tokenizer.decode([t]): lp} for t, lp in zip(expected_ids, expected_logprobs)]
        assert out.usage.prompt_tokens == len(ids)
        assert out.usage.completion_tokens == 8
        assert out.usage.total_tokens == len(ids) + 8
        assert out.id.startswith("cmpl-") and out.model == MODEL and out.object == "text_completion"
        assert out.system_fingerprint is None


def test_completion_without_logprobs_has_none(client):
    out = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=3)
    assert out.choices[0].logprobs is None
    assert out.usage.completion_tokens == 3  # max_tokens


def test_completion_logprobs_zero_gives_each_chosen_tokens_logprob_only(client):
    out = client.completions.create(model=MODEL, prompt="Once upon", max_tokens=4,
                                    temperature=0, logprobs=0)
    logprobs = out.choices[0].logprobs
    assert len(logprobs.token_logprobs) == 4 and logprobs.top_logprobs is None
    assert logprobs.text_offset[0] == 0


def test_completion_of_several_prompts_with_n_gives_n_choices_per_prompt(client, native,
                                                                       tokenizer):
    prompts = ["One, two,", "Red, green,"]
    out = client.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=5,
                                    temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for index, prompt in enumerate(prompts):
        expected, _ = native_greedy(native, tokenizer.encode(prompt), 5)
        for choice in out.choices[2 * index:2 * index + 2]:
            assert choice.text == text_of(tokenizer, expected)
    assert out.usage.prompt_tokens == sum(len(tokenizer.encode(p)) for p in prompts)
    assert out.usage.completion_tokens == 4 * 5


def test_sampled_completions_with_n(client):
    out = client.completions.create(model=MODEL, prompt="Once upon", n=4, max_tokens=6,
                                    temperature=1.0, top_p=0.9, seed=7)
    assert len(out.choices) == 4
    assert out.usage.completion_tokens == sum(6 for _ in out.choices)


def test_a_seed_gives_the_same_completions_each_time_and_each_choice_its_own(client, native,
                                                                              tokenizer):
    def texts(seed):
        out = client.completions.create(model=MODEL, prompt="Once upon", n=3, max_tokens=12,
                                        temperature=1.0, seed=seed)
        return [c.text for c in out.choices]

    first = texts(7)
    # Between the two, other requests move the engine's own generator along.
    client.completions.create(model=MODEL, prompt="Red, green,", n=2, max_tokens=5)
    assert texts(7) == first
    assert len(set(first)) == 3  # three streams, not one three times
    assert texts(8) != first
    # The native API's sampling_seed is the same stream: choice 0 of seed 7 is stream_seed(7, 0).
    from asyncrl.engine.types import stream_seed

    response = native.post("/generate", json={
        "input_ids": tokenizer.encode("Once upon"),
        "sampling_params": {"max_new_tokens": 12, "temperature": 1.0,
                            "sampling_seed": stream_seed(7, 0)}})
    assert response.status_code == 200, response.text
    assert text_of(tokenizer, response.json()["output_ids"]) == first[0]


def test_a_stop_string_cuts_the_text_before_it(client, native, tokenizer):
    ids = tokenizer.encode("The capital of France is")
    full_ids, full_logprobs = native_greedy(native, ids, 12)
    full = text_of(tokenizer, full_ids)
    # A stop string the answer completes at its 5th token: that token's text.
    stop = tokenizer.decode([full_ids[4]]).strip()
    assert stop and full.find(stop) > 0
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                    stop=[stop, "never appears \u2603"], logprobs=1)
    choice = out.choices[0]
    assert choice.text == full[:full.find(stop)]
    assert choice.finish_reason == "stop"
    # Tokens after the one that completed the match were never shown: not counted either.
    kept = out.usage.completion_tokens
    assert kept <= 5 and stop in text_of(tokenizer, full_ids[:kept])
    assert choice.logprobs.token_logprobs == pytest.approx(full_logprobs[:kept], abs=LOGPROB_NOISE)
    # Without a match, the text is whole.
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                    stop="never appears \u2603")
    assert out.choices[0].text == full and out.choices[0].finish_reason == "length"


def test_streamed_completion_adds_up_to_the_answer(client):
    kwargs = dict(model=MODEL, prompt="The capital of France is", max_tokens=10,
                  temperature=0, n=2, logprobs=1)
    whole = client.completions.create(**kwargs)
    texts, logprobs, reasons, usage = ["", ""], [[], []], [None, None], None
    for chunk in client.completions.create(**kwargs, stream=True,
                                           stream_options={"include_usage": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.logprobs is not None:
                logprobs[choice.index] += choice.logprobs.token_logprobs
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert texts == [c.text for c in whole.choices]
    for streamed, c in zip(logprobs, whole.choices):
        assert streamed == pytest.approx(c.logprobs.token_logprobs, abs=LOGPROB_NOISE)
    assert reasons == [c.finish_reason for c in whole.choices]
    assert usage == whole.usage


# ---------------------------------------------------------------------------- chat


def test_greedy_chat_is_the_native_apis_tokens_for_the_rendered_prompt(client, native,
                                                                      tokenizer):
    prompt_ids = chat_prompt_ids(tokenizer, HELLO)
    expected_ids, expected_logprobs = native_greedy(
        native, prompt_ids, 10, stop_token_ids=[tokenizer.eos_token_id])
    out = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=10,
                                         temperature=0, logprobs=True)
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == text_of(tokenizer, expected_ids)
    assert choice.message.tool_calls is None
    assert [e.logprob for e in choice.logprobs.content] == pytest.approx(
        expected_logprobs, abs=LOGPROB_NOISE)
    assert [e.token for e in choice.logprobs.content] == [
        tokenizer.decode([t]) for t in expected_ids]
    assert all(e.top_logprobs == [] for e in choice.logprobs.content)
    assert out.usage.prompt_tokens == len(prompt_ids)
    assert out.usage.completion_tokens == len(expected_ids)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    # max_completion_tokens is max_tokens' newer name.
    again = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0,
                                           max_completion_tokens=10)
    assert again.choices[0].message.content == choice.message.content


def test_chat_with_n_and_sampling(client):
    out = client.chat.completions.create(model=MODEL, messages=HELLO, n=3, max_tokens=4,
                                         temperature=0.8, top_p=0.95)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 12


def test_chat_without_max_tokens_may_use_the_rest_of_the_context(client, tokenizer):
    out = client.chat.completions.create(model=MODEL, messages=HELLO, temperature=0,
                                         stop=[" "])  # stops early, the budget is not used up
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.total_tokens <= MAX_SEQUENCE_LENGTH


def test_chat_stop_string(client, native, tokenizer):
    prompt_ids = chat_prompt_ids(tokenizer, HELLO)
    full_ids, _ = native_greedy(native, prompt_ids, 12, stop_token_ids=[tokenizer.eos_token_id])
    full = text_of(tokenizer, full_ids)
    stop = tokenizer.decode([full_ids[3]]).strip()
    out = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12,
                                         temperature=0, stop=stop)
    assert out.choices[0].message.content == full[:full.find(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_streamed_chat_adds_up_to_the_answer(client):
    kwargs = dict(model=MODEL, messages=HELLO, max_tokens=12, temperature=0, n=2,
                  logprobs=True)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True,
                                                 stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    contents, logprobs, reasons = ["", ""], [[], []], [None, None]
    roles = set()
    for chunk in chunks:
        for choice in chunk.choices:
            roles.add(choice.delta.role)
            contents[choice.index] += choice.delta.content or ""
            if choice.logprobs is not None:
                logprobs[choice.index] += [e.logprob for e in choice.logprobs.content]
            reasons[choice.index] = choice.finish_reason or reasons[choice.index]
    assert roles == {"assistant", None}
    assert contents == [c.message.content for c in whole.choices]
    for streamed, c in zip(logprobs, whole.choices):
        assert streamed == pytest.approx([e.logprob for e in c.logprobs.content], abs=LOGPROB_NOISE)
    assert reasons == [c.finish_reason for c in whole.choices]
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_stream_is_server_sent_events_ending_with_done(native):
    with native.stream("POST", "/v1/chat/completions", json={
            "model": MODEL, "messages": HELLO, "max_tokens": 3, "stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]][-1] == "length"


def test_chat_tools_reach_a_model_whose_template_ignores_them(client, tokenizer):
    # SmolLM2's template ignores `tools`: the tools are offered in the Hermes layout instead.
    plain = chat_prompt_ids(tokenizer, HELLO)
    out = client.chat.completions.create(model=MODEL, messages=HELLO, tools=[WEATHER],
                                         max_tokens=3)
    assert out.usage.prompt_tokens > len(plain) + 50
    # tool_choice "none": no tools offered.
    out = client.chat.completions.create(model=MODEL, messages=HELLO, tools=[WEATHER],
                                         tool_choice="none", max_tokens=3)
    assert out.usage.prompt_tokens == len(plain)


# ---------------------------------------------------------------------------- errors


def test_bad_fields_are_refused_naming_the_field(client):
    cases = [
        (lambda: client.chat.completions.create(model=MODEL, messages=HELLO, temperature=3),
         "temperature"),
        (lambda: client.chat.completions.create(model=MODEL, messages=HELLO, top_p=0),
         "top_p"),
        (lambda: client.chat.completions.create(model=MODEL, messages=HELLO, n=0), "n"),
        (lambda: client.chat.completions.create(model=MODEL, messages=[]), "messages"),
        (lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "robot", "content": "hi"}]), "messages[0].role"),
        (lambda: client.chat.completions.create(
            model=MODEL, messages=HELLO, logprobs=True, top_logprobs=3), "top_logprobs"),
        (lambda: client.chat.completions.create(
            model=MODEL, messages=HELLO, tools=[WEATHER], tool_choice="required"),
         "tool_choice"),
        (lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]),
         "messages[0].content"),
        (lambda: client.chat.completions.create(model=MODEL, messages=HELLO,
                                                max_tokens=MAX_SEQUENCE_LENGTH),
         "max_tokens"),
        (lambda: client.completions.create(model=MODEL, prompt="hi", logprobs=2), "logprobs"),
        (lambda: client.completions.create(model=MODEL, prompt="hi", stop=""), "stop"),
        (lambda: client.completions.create(model=MODEL, prompt=[[1, 2], []]), "prompt"),
        (lambda: client.completions.create(model=MODEL, prompt="hi", echo=True), "echo"),
        (lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=0),
         "max_tokens"),
    ]
    for call, field in cases:
        with pytest.raises(openai.BadRequestError) as error:
            call()
        body = error.value.body
        assert error.value.status_code == 400
        assert body["type"] == "invalid_request_error"
        assert body["param"] == field, body
        assert body["message"].startswith(f"{field}:"), body


def test_a_field_of_several_shapes_is_refused_with_the_shapes_it_takes(native):
    response = native.post("/v1/completions", json={
        "model": MODEL, "prompt": [[1, "a"]], "stop": 5, "temperature": -1})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert "prompt: must be a string, a list of strings, a list of token ids" in message
    assert "stop: must be a string or a list of up to 4 strings" in message
    assert "temperature: Input should be greater than or equal to 0" in message


def test_a_body_that_is_not_json_or_misses_fields_is_a_400(native):
    response = native.post("/v1/chat/completions", content=b"{not json",
                           headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    response = native.post("/v1/completions", json={"model": MODEL})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "prompt"
    # The native API keeps its own error body.
    response = native.post("/generate", json={"input_ids": "x"})
    assert response.status_code == 400 and set(response.json()["error"]) == {"message"}


def test_an_engine_refusal_is_a_400_and_others_are_served(client, service):
    engine = service[2]
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, prompt=[10**9], max_tokens=2)
    assert "outside the vocabulary" in error.value.message
    # One bad prompt of several: the good ones' requests are aborted, nothing is left queued.
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[[5, 6, 7], [10**9]], n=3,
                                  max_tokens=MAX_SEQUENCE_LENGTH - 3)
    wait_for(lambda: queued(engine) == 0, timeout=30,
             what="the good prompts' requests to be aborted")
    out = client.completions.create(model=MODEL, prompt="still", max_tokens=2)
    assert out.usage.completion_tokens == 2


# ---------------------------------------------------------------------------- tool calls


CALL = ('I will look it up.\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call>')


@pytest.fixture
def scripted(tokenizer):
    """A server over a Scripted generate function, and the function."""

    def serve(text: str, tok=None):
        generate = Scripted(tok or tokenizer, text)
        app = FastAPI()
        app.include_router(openai_router(generate, tok or tokenizer, model_name=MODEL,
                                         max_sequence_length=4096))
        return HttpServer(app), generate

    return serve


def test_a_tool_call_in_the_output_becomes_tool_calls(scripted, tokenizer):
    server, generate = scripted(CALL)
    with server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[WEATHER])
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "I will look it up."
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments) == {"city": "Paris"}
        assert out.usage.completion_tokens == len(generate.ids)  # EOS included
        # The tools reached the prompt in the Hermes layout (SmolLM2's template drops them),
        # and the turn ends at the chat template's end token.
        prompt = tokenizer.decode(generate.prompts[0])
        assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in prompt
        assert "<tool_call></tool_call> XML tags" in prompt
        assert tokenizer.eos_token_id in generate.params[0].stop_token_ids

        # Streamed: the content, then the call.
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
            tools=[WEATHER], stream=True))
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
        calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or ()]
        assert content == "I will look it up."
        assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
            (0, "get_weather", {"city": "Paris"})]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"

        # Without tools, or with tool_choice "none", the text is left as it is.
        for extra in ({}, {"tools": [WEATHER], "tool_choice": "none"}):
            out = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "Weather?"}], **extra)
            assert out.choices[0].message.content == CALL
            assert out.choices[0].message.tool_calls is None
            assert out.choices[0].finish_reason == "stop"


def test_earlier_calls_and_their_results_are_shown_to_the_model(scripted, tokenizer):
    server, generate = scripted("It is sunny in Paris.")
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"sky": "sunny"}'},
    ]
    with server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER])
    assert out.choices[0].message.content == "It is sunny in Paris."
    assert out.choices[0].finish_reason == "stop"
    prompt = tokenizer.decode(generate.prompts[0])
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
        in prompt
    assert '<tool_response>\n{"sky": "sunny"}\n</tool_response>' in prompt


def test_a_template_that_renders_tools_is_used_as_it_is(scripted, tokenizer):
    own = copy.deepcopy(tokenizer)
    own.chat_template = (
        "{% if tools %}TOOLS:{{ tools | map(attribute='function.name') | join(',') }}\n"
        "{% endif %}{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}")
    server, generate = scripted(CALL, own)
    with server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        out = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER])
    assert out.choices[0].finish_reason == "tool_calls"
    assert own.decode(generate.prompts[0]) == "TOOLS:get_weather\nuser: Weather?\nassistant:"


def test_streamed_multibyte_text_adds_up_one_chunk_per_token(scripted):
    text = "Grüße, 你好 🎉🎉 done."
    server, generate = scripted(text)
    with server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        chunks = list(client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True,
            logprobs=True))
    per_token = [c for c in chunks if c.choices[0].logprobs is not None]
    assert len(per_token) == len(generate.ids)  # the EOS too, with an empty piece
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text
    assert all("\ufffd" not in (c.choices[0].delta.content or "") for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "stop"
