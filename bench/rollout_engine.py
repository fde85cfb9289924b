"""Rollout engine throughput vs plain `transformers` generate, and weight-update latency.

Same model (SmolLM2-135M-Instruct, fp32), same chat prompts, same per-request output lengths
drawn from a long-tailed distribution (most answers short, a few long: the case continuous
batching exists for). `transformers` generate runs fixed batches, each until its longest
request is done; the engine admits and retires requests at every step. Both ignore EOS so the
token counts are identical. Figures are measured in one run and reported as a ratio.

    .venv/bin/python bench/rollout_engine.py [--requests 16] [--batch 8]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_model

from asyncrl import arith
from asyncrl.models import SMOLLM2, load_model, load_tokenizer
from asyncrl.rollout.engine import TorchEngine
from asyncrl.rollout.types import SamplingParams


def long_tail_lengths(count: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(128, 192) if rng.random() < 0.25 else rng.randint(16, 48)
            for _ in range(count)]


def prompts(tokenizer, count: int) -> list[list[int]]:
    chats = [
        tokenizer.apply_chat_template([{"role": "user", "content": p.prompt}],
                                      add_generation_prompt=True, tokenize=False)
        for p in arith.generate(count, seed=1, difficulty=2)
    ]
    return [tokenizer(c, add_special_tokens=False).input_ids for c in chats]


def run_transformers(model, tokenizer, inputs, lengths, batch: int) -> float:
    tokenizer.padding_side = "left"
    started = time.perf_counter()
    for start in range(0, len(inputs), batch):
        chunk = inputs[start : start + batch]
        padded = tokenizer.pad({"input_ids": chunk}, return_tensors="pt")
        with torch.no_grad():
            model.generate(**padded, do_sample=True, temperature=1.0, top_k=0,
                           max_new_tokens=max(lengths[start : start + batch]),
                           min_new_tokens=max(lengths[start : start + batch]),
                           pad_token_id=tokenizer.pad_token_id)
    return time.perf_counter() - started


def run_engine(engine: TorchEngine, inputs, lengths) -> float:
    started = time.perf_counter()
    futures = [engine.submit(ids, SamplingParams(max_new_tokens=n)) for ids, n in zip(inputs, lengths)]
    results = [f.result() for f in futures]
    elapsed = time.perf_counter() - started
    assert [len(r.output_ids) for r in results] == lengths
    return elapsed


def weight_update_latency(engine: TorchEngine, model, inputs) -> tuple[float, float]:
    """(seconds to swap weights, seconds from the announcement until every running request
    has generated a token with the new version)."""
    with tempfile.TemporaryDirectory() as tmp:
        snapshot = Path(tmp) / "model.safetensors"
        save_model(model, str(snapshot))
        futures = [engine.submit(ids, SamplingParams(max_new_tokens=96)) for ids in inputs[:8]]
        while engine.status().generated_tokens_total < 8 * 16 + engine_base(engine):
            time.sleep(0.01)
        announced = time.perf_counter()
        update = engine.update_weights(snapshot, engine.version + 1)
        while engine.status().stale_requests or engine.status().running_requests == 0:
            if all(f.done() for f in futures):
                break
            time.sleep(0.005)
        caught_up = time.perf_counter() - announced
        engine.abort()
        return update.seconds, caught_up


_BASE = {}


def engine_base(engine) -> int:
    return _BASE.setdefault(id(engine), engine.status().generated_tokens_total)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--batch", type=int, default=8, help="transformers generate batch size")
    args = parser.parse_args()

    tokenizer, model = load_tokenizer(SMOLLM2), load_model(SMOLLM2).eval()
    model.generation_config.eos_token_id = None  # both sides generate exactly `lengths`
    inputs, lengths = prompts(tokenizer, args.requests), long_tail_lengths(args.requests)
    tokens = sum(lengths)
    engine = TorchEngine(model, max_running_requests=args.requests, max_sequence_length=512,
                         seed=0).start()
    run_engine(engine, inputs[:2], [4, 4])  # warm-up
    engine_seconds = run_engine(engine, inputs, lengths)
    hf_seconds = run_transformers(model, tokenizer, inputs, lengths, args.batch)
    swap, caught_up = weight_update_latency(engine, model, inputs)
    engine.stop()

    print(f"{args.requests} requests, {tokens} output tokens (lengths {min(lengths)}..{max(lengths)}, "
          f"long-tailed), {torch.get_num_threads()} threads")
    print(f"transformers generate (batch {args.batch}): {tokens / hf_seconds:6.1f} tokens/s")
    print(f"asyncrl torch engine (continuous):  {tokens / engine_seconds:6.1f} tokens/s")
    print(f"speed-up: {hf_seconds / engine_seconds:.2f}x")
    print(f"weight update: swap {swap * 1000:.0f} ms; announcement -> all 8 running requests "
          f"generating with the new version: {caught_up * 1000:.0f} ms")


if __name__ == "__main__":
    main()
