"""The rollout engine in float32 against bf16 (`rollout.computeDtype`) on one CPU, in one run.

The arith job's rollout workload: what one worker of examples/arith.yaml runs at once, 8
prompts x 8 responses (64 requests), each to the job's maxNewTokens (64; EOS ignored so both
engines generate the same tokens' worth) at its temperature. The two engines run in turns,
`--repeats` times each, and each reports its best (the machine is shared: turns make a busy
moment slow both alike). Also printed: what `rollout.computeDtype: auto` chooses here and the
bf16 matrix multiply's speedup it measured. `bench/rollout_engine.py --dtype` measures either
dtype on long-tailed lengths instead.

    .venv/bin/python bench/engine_dtype.py [--requests 64] [--max-new-tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.engine.types import SamplingParams
from asyncrl.model.policy import SMOLLM2, load_model, load_tokenizer
from asyncrl.platform.devices import cpu_bf16_speedup, resolve_dtype
from asyncrl.platform.heap import reuse_large_blocks
from rollout_engine import grouped

DTYPES = ("float32", "bfloat16")


def generate(engine: TorchEngine, inputs: list[list[int]], params: SamplingParams) -> float:
    """Seconds to serve every request, in this thread (the engine's loop is not started)."""
    started = time.perf_counter()
    futures = [engine.submit(ids, params) for ids in inputs]
    engine.run_until_idle()
    assert all(len(f.result().output_ids) == params.max_new_tokens for f in futures)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--responses-per-prompt", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.6)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    reuse_large_blocks()  # as `asyncrl serve rollout` does
    tokenizer = load_tokenizer(SMOLLM2)
    inputs = grouped(tokenizer, args.requests, args.responses_per_prompt)
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                            ignore_eos=True)
    engines = {dtype: TorchEngine(load_model(SMOLLM2, dtype=dtype).eval(),
                                  max_running_requests=args.requests, max_sequence_length=256,
                                  seed=0)
               for dtype in DTYPES}
    for engine in engines.values():
        generate(engine, inputs[:2], SamplingParams(max_new_tokens=4, ignore_eos=True))  # warm-up
    seconds: dict[str, list[float]] = {dtype: [] for dtype in DTYPES}
    for _ in range(args.repeats):
        for dtype, engine in engines.items():
            seconds[dtype].append(generate(engine, inputs, params))
    tokens = len(inputs) * args.max_new_tokens
    print(f"{args.requests} requests ({args.requests // args.responses_per_prompt} prompts x "
          f"{args.responses_per_prompt}) of {args.max_new_tokens} tokens at temperature "
          f"{args.temperature}, {tokens} output tokens, "
          f"{torch.get_num_threads()} threads")
    for dtype in DTYPES:
        print(f"engine in {dtype:8}: {tokens / min(seconds[dtype]):7.1f} tokens/s (best of "
              f"{args.repeats}; all: {', '.join(f'{tokens / s:.0f}' for s in seconds[dtype])})")
    print(f"bf16 / float32: {min(seconds['float32']) / min(seconds['bfloat16']):.2f}x; "
          f"rollout.computeDtype auto chooses {resolve_dtype('auto', 'cpu')} here (a bf16 matrix "
          f"multiply measured {cpu_bf16_speedup():.2f}x float32)")


if __name__ == "__main__":
    main()
