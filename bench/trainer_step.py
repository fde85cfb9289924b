"""How long one decoupled-PPO trainer step takes for SmolLM2-135M on this machine.

Times full steps (proximal forward + forward/backward per micro-batch + AdamW) on a batch of
random token sequences, and in the same run a no-grad forward pass over the same batch, so the
step's cost is also reported as a ratio to a forward pass (robust to machine noise).

    .venv/bin/python bench/trainer_step.py [--sequences 8] [--prompt 64] [--response 128]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from asyncrl.algorithms.packing import pack_sequences
from asyncrl.models import SMOLLM2, load_model, packed_token_logprobs
from asyncrl.trainer.step import PolicyUpdater, TrainSample, UpdateConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    parser.add_argument("--response", type=int, default=128, help="response tokens per sequence")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--micro-batch-max-tokens", type=int, default=2048)
    args = parser.parse_args()

    model = load_model(SMOLLM2)
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    length = args.prompt + args.response
    samples = []
    for i in range(args.sequences):
        ids = torch.randint(0, vocab, (length,), generator=generator)
        mask = torch.arange(length) >= args.prompt
        behaviour = torch.where(mask, torch.full((length,), -10.0), torch.zeros(length))
        samples.append(TrainSample(ids, mask, behaviour, 1.0 if i % 2 else -1.0))

    updater = PolicyUpdater(
        model,
        torch.optim.AdamW(model.parameters(), lr=1e-6),
        UpdateConfig(micro_batch_max_tokens=args.micro_batch_max_tokens),
    )
    packed = pack_sequences([s.input_ids for s in samples])

    def forward() -> None:
        with torch.no_grad():
            packed_token_logprobs(model, packed.input_ids, packed.position_ids, packed.cu_seqlens)

    updater.step(samples)  # warm-up
    forward()
    step_times, forward_times = [], []
    for _ in range(args.repeats):
        started = time.perf_counter()
        updater.step(samples)
        step_times.append(time.perf_counter() - started)
        started = time.perf_counter()
        forward()
        forward_times.append(time.perf_counter() - started)

    step, fwd = statistics.median(step_times), statistics.median(forward_times)
    total_tokens, trained_tokens = args.sequences * length, args.sequences * args.response
    print(f"SmolLM2-135M fp32, {torch.get_num_threads()} threads, batch {args.sequences} x "
          f"({args.prompt} prompt + {args.response} response) tokens")
    print(f"trainer step: {step:.1f} s  ({trained_tokens / step:.0f} trained tokens/s, "
          f"{total_tokens / step:.0f} tokens/s through the model)")
    print(f"no-grad forward of the same batch: {fwd:.2f} s; step / forward = {step / fwd:.1f}x")


if __name__ == "__main__":
    main()
