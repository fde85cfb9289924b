"""How long one decoupled-PPO trainer step takes for SmolLM2-135M on this machine, in fp32 and
in bf16 autocast, and what memory it needs.

Times full steps (forward/backward per micro-batch + AdamW) on a batch of random token
sequences; in the same run, a no-grad forward pass over the same batch, so each step is also
reported as a ratio to a forward pass (robust to machine noise). That forward is also what a
step would cost on top if it ran the proximal policy as a pass of its own: it takes the
proximal log-probs from its training forward instead (asyncrl.trainer.step). The fp32 step is
also timed with transformers' SDPA over the whole packed row (a block-diagonal mask) instead
of the trainer's per-sequence attention (asyncrl.model.packed_attention), and with activation
checkpointing (trainer.activationCheckpointing); each configuration's first step also counts
the bytes autograd keeps for backward. The batch's sequences come in groups of --group-size
responses to one prompt, as a GRPO job's do, which the trainer packs with the prompt once
(asyncrl.algorithms.packing); the fp32 step is also timed on the same shapes with every
sequence's prompt its own, which nothing shares (and so is the block-diagonal mask's step).

With --megatron, the fp32 step is also timed with the Megatron-Core backend, which computes
every sequence whole: on the batch whose prompts are each their own, beside that step.

    .venv/bin/python bench/trainer_step.py [--sequences 8] [--group-size 8] [--prompt 64]
        [--response 128] [--bf16] [--megatron]
"""

from __future__ import annotations

import argparse
import copy
import resource
import statistics
import time

import torch

from asyncrl.algorithms.packing import pack_sequences
from asyncrl.platform.devices import native_bf16
from asyncrl.model.policy import SMOLLM2, load_model, packed_token_logprobs
from asyncrl.model.packed_attention import PACKED_SDPA
from asyncrl.trainer.step import PolicyUpdater, TrainSample, UpdateConfig


def peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8,
                        help="sequences per prompt (1: every prompt its own)")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    parser.add_argument("--response", type=int, default=128, help="response tokens per sequence")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--micro-batch-max-tokens", type=int, default=2048)
    parser.add_argument("--bf16", action="store_true",
                        help="time bf16 autocast also where the CPU emulates bf16")
    parser.add_argument("--megatron", action="store_true",
                        help="also time the step with the Megatron-Core backend")
    args = parser.parse_args()

    model = load_model(SMOLLM2)
    parameters = sum(p.numel() for p in model.parameters())
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    length = args.prompt + args.response
    mask = torch.arange(length) >= args.prompt
    behaviour = torch.where(mask, torch.full((length,), -10.0), torch.zeros(length))
    samples, unshared = [], []
    for i in range(args.sequences):
        if i % args.group_size == 0:
            prompt = torch.randint(0, vocab, (args.prompt,), generator=generator)
        response = torch.randint(0, vocab, (args.response,), generator=generator)
        own_prompt = torch.randint(0, vocab, (args.prompt,), generator=generator)
        advantage = 1.0 if i % 2 else -1.0
        samples.append(TrainSample(torch.cat([prompt, response]), mask, behaviour, advantage))
        unshared.append(TrainSample(torch.cat([own_prompt, response]), mask, behaviour,
                                    advantage))
    packed = pack_sequences([s.input_ids for s in samples])

    def forward() -> float:
        started = time.perf_counter()
        with torch.no_grad():
            packed_token_logprobs(model, packed.input_ids, packed.position_ids, packed.cu_seqlens)
        return time.perf_counter() - started

    saved = {}  # bytes kept for backward by one step, by configuration

    def timed_steps(dtype: str, attention: str = PACKED_SDPA, checkpointing: bool = False,
                    policy: torch.nn.Module = model, batch: list[TrainSample] = samples) -> float:
        updater = PolicyUpdater(
            policy, torch.optim.AdamW(policy.parameters(), lr=1e-6),
            UpdateConfig(micro_batch_max_tokens=args.micro_batch_max_tokens,
                         compute_dtype=dtype, activation_checkpointing=checkpointing))
        policy.set_attn_implementation(attention)  # the updater chose packed attention
        kept_bytes = saved_for_backward(updater, batch)  # warm-up
        if batch is samples:
            saved[dtype, attention, checkpointing] = kept_bytes
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            updater.step(batch)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    forward()
    fwd = statistics.median(forward() for _ in range(args.repeats))
    fp32 = timed_steps("float32")
    fp32_unshared = timed_steps("float32", batch=unshared)
    # transformers' SDPA knows nothing of shared prompts: both attentions on whole sequences.
    fp32_block_mask = timed_steps("float32", attention="sdpa", batch=unshared)
    # Where the CPU emulates bf16 a step takes minutes and means nothing (auto: float32).
    bf16 = timed_steps("bfloat16") if args.bf16 or native_bf16(torch.device("cpu")) else None
    # Last, on a copy: checkpointing wraps the model's layers for good.
    checkpointed = timed_steps("float32", checkpointing=True, policy=copy.deepcopy(model))
    megatron = megatron_step(model, unshared, args) if args.megatron else None

    total_tokens, trained_tokens = args.sequences * length, args.sequences * args.response
    print(f"SmolLM2-135M, {torch.get_num_threads()} threads, batch {args.sequences} x "
          f"({args.prompt} prompt + {args.response} response) tokens, in groups of "
          f"{args.group_size} sharing a prompt")
    print(f"no-grad forward of the batch, each sequence whole (fp32): {fwd:.2f} s")
    for name, seconds in (("fp32", fp32), ("fp32, every prompt its own", fp32_unshared),
                          ("fp32, every prompt its own, block-diagonal mask", fp32_block_mask),
                          ("bf16 autocast", bf16)):
        if seconds is None:
            print(f"trainer step, {name}: not run, this CPU emulates bf16 (--bf16 runs it)")
            continue
        print(f"trainer step, {name}: {seconds:.2f} s ({trained_tokens / seconds:.0f} trained "
              f"tokens/s, {total_tokens / seconds:.0f} through the model; "
              f"{seconds / fwd:.1f} forwards)")
    print(f"trainer step, fp32, activation checkpointing: {checkpointed:.2f} s "
          f"({trained_tokens / checkpointed:.0f} trained tokens/s; "
          f"{checkpointed / fp32:.2f}x the fp32 step's time)")
    kept = {key: value / 2**20 for key, value in saved.items()}
    bf16_kept = (f"bf16 autocast {kept['bfloat16', PACKED_SDPA, False]:.0f} MB, "
                 if bf16 is not None else "")
    print(f"kept for backward by one step: fp32 {kept['float32', PACKED_SDPA, False]:.0f} MB, "
          f"{bf16_kept}fp32 with activation "
          f"checkpointing {kept['float32', PACKED_SDPA, True]:.0f} MB "
          f"({kept['float32', PACKED_SDPA, False] / kept['float32', PACKED_SDPA, True]:.1f}x "
          f"less; micro-batches of at most {args.micro_batch_max_tokens} tokens)")
    if megatron is not None:
        print(f"trainer step, fp32, Megatron-Core backend (local layer spec): {megatron:.2f} s "
              f"({trained_tokens / megatron:.0f} trained tokens/s, every prompt its own); its "
              f"time / the pytorch backend's fp32 step on that batch: "
              f"{megatron / fp32_unshared:.2f}")
    if bf16 is not None:
        print(f"bf16 / fp32 step speed: {fp32 / bf16:.2f}x")
    print(f"prompts shared / every prompt its own, step speed (fp32): "
          f"{fp32_unshared / fp32:.2f}x")
    print(f"a proximal pass of its own would add {fwd:.2f} s to the fp32 step: taking the "
          f"proximal log-probs from the training forward is {(fp32 + fwd) / fp32:.2f}x")
    print(f"per-sequence / block-diagonal attention step speed (fp32, every prompt its own): "
          f"{fp32_block_mask / fp32_unshared:.2f}x")
    weights_grads_adam = parameters * 4 * 4 / 2**30
    print(f"peak resident memory: {peak_rss_gb():.2f} GB (fp32 weights + gradients + AdamW's two "
          f"moments: {weights_grads_adam:.2f} GB)")


def saved_for_backward(updater: PolicyUpdater, samples) -> int:
    """Runs one step; the bytes of the tensors autograd kept for backward in it, the
    parameters themselves left out (what a step's activation memory is, summed over its
    micro-batches; a tensor kept twice counts twice)."""
    total = 0
    weights = {p.untyped_storage().data_ptr() for p in updater.model.parameters()}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if tensor.untyped_storage().data_ptr() not in weights:
            total += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        updater.step(samples)
    return total


def megatron_step(model, samples, args) -> float:
    """The median fp32 step of the same batch with the Megatron-Core backend (needs the
    `megatron` dependency group)."""
    from asyncrl.trainer.megatron.compat import initialize_parallel
    from asyncrl.trainer.megatron.policy import MegatronPolicy

    initialize_parallel(1, 1, torch.device("cpu"))
    policy = MegatronPolicy.from_hf(model, torch.device("cpu"))
    updater = PolicyUpdater(
        policy, torch.optim.AdamW(policy.parameters(), lr=1e-6),
        UpdateConfig(micro_batch_max_tokens=args.micro_batch_max_tokens))
    updater.step(samples)  # warm-up
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        updater.step(samples)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


if __name__ == "__main__":
    main()
