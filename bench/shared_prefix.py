"""The held-out evaluation of a job with and without the engine's shared-prefix prefill.

The trainer's evaluation submits every held-out prompt at once; their chat template's system
turn is the same for all (24 of the about 63 tokens of an arith prompt), and the engine
computes such shared leading tokens once, in one row (asyncrl.engine.torch_engine,
SHARED_PREFIX_MIN_TOKENS). This times the job's own evaluation (its model, prompts, greedy
sampling and engine, the trainer's code path) both ways, in turns, best of `--repeats` each
(the machine is shared), and checks that both give the same tokens.

    .venv/bin/python bench/shared_prefix.py [examples/arith.yaml] [--repeats 2]
        [--max-new-tokens N]   (the job's by default; a trained model answers in fewer)
"""

from __future__ import annotations

import argparse
import time

import torch

from asyncrl.engine import torch_engine
from asyncrl.evaluation import evaluation_engine, generate, held_out_prompts, sampling
from asyncrl.model.policy import load_policy
from asyncrl.spec.manifest import load_manifest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("job", nargs="?", default="examples/arith.yaml")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    args = parser.parse_args()

    spec = load_manifest(args.job).spec
    if args.max_new_tokens:
        spec = spec.model_copy(update={"rollout": spec.rollout.model_copy(
            update={"max_new_tokens": args.max_new_tokens})})
    model, tokenizer = load_policy(spec.model)
    items = held_out_prompts(spec, tokenizer)
    prompts = [item.prompt_ids for item in items]
    shared = torch_engine._shared_prefix_length(prompts)
    print(f"{len(items)} held-out prompts, {sum(map(len, prompts)) / len(prompts):.1f} tokens on "
          f"average, {shared} leading tokens shared by all; {torch.get_num_threads()} threads")

    default = torch_engine.SHARED_PREFIX_MIN_TOKENS
    settings = {"shared prefix": default, "each prompt whole": 10**9}
    best: dict[str, float] = {}
    tokens: dict[str, list[list[int]]] = {}
    with torch.inference_mode():
        for _ in range(args.repeats):
            for name, minimum in settings.items():
                torch_engine.SHARED_PREFIX_MIN_TOKENS = minimum
                engine = evaluation_engine(model, spec, items, tokenizer)
                started = time.perf_counter()
                results = generate(engine, items, sampling(spec, 1))
                seconds = time.perf_counter() - started
                engine.stop()
                best[name] = min(best.get(name, float("inf")), seconds)
                tokens[name] = [group[0].output_ids for group in results]
    torch_engine.SHARED_PREFIX_MIN_TOKENS = default

    generated = sum(map(len, tokens["shared prefix"]))
    for name, seconds in best.items():
        print(f"{name:>18}: {seconds:6.1f} s (best of {args.repeats}), "
              f"{generated / seconds:6.1f} generated tokens/s")
    print(f"ratio: {best['each prompt whole'] / best['shared prefix']:.2f}x")
    differ = sum(a != b for a, b in zip(tokens["shared prefix"], tokens["each prompt whole"]))
    print(f"responses that differ between the two: {differ} of {len(items)} "
          "(the same tokens but for rounding: a different matmul shape may flip a near tie)")


if __name__ == "__main__":
    main()
