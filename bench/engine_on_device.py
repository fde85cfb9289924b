"""The torch engine on a published model's shape (random weights) on a device: what
`bench/rollout_engine.py --shape ... --device ...` runs.

In one run, on the same long-tailed workload (`--requests` requests, `--responses-per-prompt`
to a prompt of `--prompt-tokens` random ids, EOS ignored so lengths are fixed):
- the engine as a rollout worker runs it (CUDA graphs on a GPU), its first run apart, which
  captures the graphs it needs;
- ms per decode step with every slot busy: the time of a run of `--requests` requests of equal
  length, minus that of a shorter one, per extra step (so prefill and start-up cancel out),
  with the graphs and, on a GPU, without them (the engine's eager steps);
- the weights-read floor: the model's weight bytes over the device's copy bandwidth, what one
  decode step cannot go below;
- `transformers` generate on the same prompts and lengths, in batches of `--batch`, each
  batch until its longest request is done, in the same dtype on the same device;
- the engine's log-probs against a full forward of prompt and output (a check of the graphs).
"""

from __future__ import annotations

import json
import random
import time

import torch

from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.model.shapes import parameter_count, random_model
from asyncrl.platform.devices import make_current
from rollout_engine import long_tail_lengths
from rollout_engine import run_engine as run


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s a device-to-device copy moves, read and write counted (1 GiB, best of 10)."""
    source = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(12):
        synchronize(device)
        started = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        best = min(best, time.perf_counter() - started)
    return 2 * source.numel() / best


def full_batch_step_ms(engine: TorchEngine, inputs, short: int, long: int) -> float:
    """Milliseconds per decode step with every slot busy: (time of `long` tokens each - time
    of `short` tokens each) / (long - short), each the best of two runs after one untimed."""
    times = {}
    for length in (short, long):
        run(engine, inputs, [length] * len(inputs))
        times[length] = min(run(engine, inputs, [length] * len(inputs))[0] for _ in range(2))
    return 1000 * (times[long] - times[short]) / (long - short)


def logprob_error(model, results, device) -> float:
    """The largest |engine log-prob - a full forward's| over the first three results."""
    worst = 0.0
    with torch.no_grad():
        for result in results[:3]:
            ids = torch.tensor([result.prompt_ids + result.output_ids], device=device)
            logits = model(input_ids=ids).logits[0, len(result.prompt_ids) - 1:-1].float()
            expected = torch.log_softmax(logits, dim=-1).gather(
                1, ids[0, len(result.prompt_ids):, None])[:, 0]
            got = torch.tensor(result.output_logprobs, device=device)
            worst = max(worst, float((expected - got).abs().max()))
    return worst


def generate_seconds(model, inputs, lengths, batch: int, device) -> float:
    synchronize(device)
    started = time.perf_counter()
    with torch.no_grad():
        for start in range(0, len(inputs), batch):
            chunk = torch.tensor(inputs[start:start + batch], device=device)
            longest = max(lengths[start:start + batch])
            model.generate(input_ids=chunk, attention_mask=torch.ones_like(chunk),
                           do_sample=True, temperature=1.0, top_k=0, max_new_tokens=longest,
                           min_new_tokens=longest, pad_token_id=0, eos_token_id=None)
    synchronize(device)
    return time.perf_counter() - started


def measure(args) -> None:
    device = make_current(args.device)
    shape = args.shape or "qwen2.5-0.5b"
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    model = random_model(shape, device, dtype)
    vocab = model.config.vocab_size
    rng = random.Random(1)
    groups = -(-args.requests // args.responses_per_prompt)
    prompts = [[rng.randrange(10, vocab) for _ in range(args.prompt_tokens)]
               for _ in range(groups)]
    inputs = [p for p in prompts for _ in range(args.responses_per_prompt)][:args.requests]
    longest = 768 if device.type == "cuda" else 64
    # A quarter in the top third of `longest`, the rest in its lower third.
    lengths = long_tail_lengths(len(inputs), short=(max(1, longest // 12), longest // 3),
                                long=(2 * longest // 3, longest))
    tokens = sum(lengths)
    max_length = args.prompt_tokens + longest + 8
    out = dict(shape=shape, parameters_M=round(parameter_count(model) / 1e6),
               device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               dtype=str(dtype).removeprefix("torch."), requests=len(inputs),
               prompt_tokens=args.prompt_tokens, output_tokens=tokens,
               lengths=f"{min(lengths)}..{max(lengths)}")

    engine = TorchEngine(model, max_running_requests=args.requests,
                         max_sequence_length=max_length, seed=0).start()
    started = time.perf_counter()
    run(engine, inputs, lengths)  # captures the graphs this workload needs
    out["first_run_s"] = round(time.perf_counter() - started, 2)
    best = min((run(engine, inputs, lengths) for _ in range(args.repeats)), key=lambda r: r[0])
    seconds, mean_batch, results = best
    out["engine"] = dict(tokens_per_s=round(tokens / seconds), seconds=round(seconds, 3),
                         mean_decode_batch=round(mean_batch, 1))
    out["engine_full_batch_step_ms"] = round(
        full_batch_step_ms(engine, inputs, longest // 24, 5 * longest // 24), 3)
    graphs = engine.cuda_graphs
    if graphs is not None:
        out["graphs"] = dict(captured=len(graphs.captured),
                             capture_s=round(graphs.capture_seconds, 2))
    elif device.type == "cuda":
        out["graphs"] = "off: a step could not be captured (the log says why)"
    out["logprob_max_error"] = round(logprob_error(model, results, device), 4)
    if args.profile and device.type == "cuda":
        from profile_summary import profile_summary

        print(profile_summary(lambda: run(engine, inputs, [64] * len(inputs)),
                              f"{len(inputs)} requests x 64 tokens"), flush=True)
    engine.stop()
    if device.type == "cuda":
        eager = TorchEngine(model, max_running_requests=args.requests,
                            max_sequence_length=max_length, seed=0, cuda_graphs=False).start()
        out["eager_full_batch_step_ms"] = round(full_batch_step_ms(eager, inputs, 8, 24), 2)
        eager.stop()
        bandwidth = copy_bandwidth(device)
        weight_bytes = parameter_count(model) * dtype.itemsize
        out["copy_GB_per_s"] = round(bandwidth / 1e9)
        out["weights_read_floor_ms"] = round(1000 * weight_bytes / bandwidth, 3)
    print(json.dumps(out), flush=True)  # the engine's figures, before the long part
    batch = args.batch or args.requests
    hf = generate_seconds(model, inputs, lengths, batch, device)
    out["generate"] = dict(tokens_per_s=round(tokens / hf), seconds=round(hf, 2), batch=batch)
    out["engine_over_generate"] = round(hf / seconds, 1)
    print(f"{shape} ({out['parameters_M']}M parameters, {out['dtype']}) on {out['device']}: "
          f"{len(inputs)} requests, {args.prompt_tokens}-token prompts, {tokens} output tokens "
          f"({out['lengths']}, long-tailed)")
    print(f"engine: {out['engine']['tokens_per_s']} tokens/s, mean decode batch "
          f"{out['engine']['mean_decode_batch']}; a decode step at batch {args.requests}: "
          f"{out['engine_full_batch_step_ms']} ms"
          + (f" (eager steps: {out['eager_full_batch_step_ms']} ms; weights-read floor "
             f"{out['weights_read_floor_ms']} ms at {out['copy_GB_per_s']} GB/s)"
             if "eager_full_batch_step_ms" in out else ""))
    print(f"transformers generate (batch {batch}): {out['generate']['tokens_per_s']} tokens/s; "
          f"engine / generate: {out['engine_over_generate']}x")
    print(f"log-probs against a full forward: max error {out['logprob_max_error']}")
    print("RESULT " + json.dumps(out), flush=True)
