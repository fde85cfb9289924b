"""What the OpenAI-compatible API costs against the native `/generate`, on one rollout worker.

One server (the rollout worker's HTTP app, `asyncrl.rollout.http_api.create_app`, on loopback)
over one torch engine with SmolLM2-135M-Instruct; the same `--requests` chat prompts, sent
all at once, greedy, at most `--max-tokens` each: as token ids through `POST /generate` and
`POST /v1/completions`, as messages through `POST /v1/chat/completions` (the chat template
and the tokenizer in the request's path), and the same chat through an episode's base URL
(`/episodes/{id}/v1`: checked against the episode's limits, tokenized against its earlier
calls, and recorded, as rollout.workflow.kind: episode runs it; one episode per request). Greedy decoding makes the first two generate the same
tokens; chat also ends a turn at its end token, so it may generate fewer. The figure is
generated tokens per second of each, run in turns `--repeats` times (the machine is shared;
each keeps its best), and the ratios to the native API.

    .venv/bin/python bench/openai_api.py [--requests 32] [--max-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time

import httpx
import uvicorn

from asyncrl.data import arith
from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.model.policy import SMOLLM2, load_model, load_tokenizer
from asyncrl.platform.redis_server import free_port
from asyncrl.rollout.http_api import create_app
from asyncrl.rollout.episode_record import EpisodeBook, EpisodeLimits
from asyncrl.rollout.metrics import RolloutMetrics


def serve(app, port: int) -> uvicorn.Server:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return server


async def native(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> int:
    reply = await client.post("/generate", json={
        "input_ids": prompt, "sampling_params": {"max_new_tokens": max_tokens, "temperature": 0}})
    reply.raise_for_status()
    return len(reply.json()["output_ids"])


async def openai(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> int:
    reply = await client.post("/v1/completions", json={
        "model": SMOLLM2, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    reply.raise_for_status()
    return reply.json()["usage"]["completion_tokens"]


async def chat(client: httpx.AsyncClient, messages: list[dict], max_tokens: int,
               path: str = "/v1/chat/completions") -> int:
    reply = await client.post(path, json={
        "model": SMOLLM2, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
    reply.raise_for_status()
    return reply.json()["usage"]["completion_tokens"]


def recorded(book: EpisodeBook):
    """`chat` in an episode of its own, recorded."""

    async def call(client: httpx.AsyncClient, messages: list[dict], max_tokens: int) -> int:
        episode = book.open(EpisodeLimits())
        try:
            return await chat(client, messages, max_tokens,
                              path=f"/episodes/{episode.episode_id}/v1/chat/completions")
        finally:
            book.close(episode)

    return call


async def run(call, base: str, prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        started = time.perf_counter()
        tokens = await asyncio.gather(*(call(client, p, max_tokens) for p in prompts))
        return time.perf_counter() - started, sum(tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    tokenizer = load_tokenizer(SMOLLM2)
    conversations = [[{"role": "user", "content": problem.prompt}]
                     for problem in arith.generate(args.requests)]
    prompts = [tokenizer(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                       tokenize=False),
                         add_special_tokens=False)["input_ids"] for messages in conversations]
    engine = TorchEngine(load_model(SMOLLM2).eval(), max_running_requests=args.requests,
                         max_sequence_length=512, seed=0).start()
    book = EpisodeBook()
    app = create_app(engine, model_path=SMOLLM2, metrics=RolloutMetrics("bench"),
                     tokenizer=tokenizer, episodes=book)
    port = free_port()
    server = serve(app, port)
    base = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(run(native, base, prompts[:2], 4))  # warm-up
        best: dict[str, tuple[float, int]] = {}
        for _ in range(args.repeats):
            for name, call, inputs in (("native /generate", native, prompts),
                                       ("/v1/completions", openai, prompts),
                                       ("/v1/chat/completions", chat, conversations),
                                       ("recorded episode chat", recorded(book),
                                        conversations)):
                seconds, tokens = asyncio.run(run(call, base, inputs, args.max_tokens))
                if name not in best or seconds < best[name][0]:
                    best[name] = (seconds, tokens)
    finally:
        server.should_exit = True
        engine.stop()
    print(f"{args.requests} requests, at most {args.max_tokens} tokens each, greedy, best of "
          f"{args.repeats}")
    rates = {name: tokens / seconds for name, (seconds, tokens) in best.items()}
    for name, (seconds, tokens) in best.items():
        print(f"{name:22} {tokens:6d} tokens in {seconds:6.2f} s: {rates[name]:7.1f} tokens/s")
    for name in ("/v1/completions", "/v1/chat/completions", "recorded episode chat"):
        print(f"{name} / native: {rates[name] / rates['native /generate']:.3f}")
    print(f"recorded episode chat / chat: "
          f"{rates['recorded episode chat'] / rates['/v1/chat/completions']:.3f}")


if __name__ == "__main__":
    main()
