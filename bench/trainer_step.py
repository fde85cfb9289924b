"""How long one decoupled-PPO trainer step takes on this machine (SmolLM2-135M, or a published
model's shape with random weights), in fp32 and in bf16 autocast, and what memory it needs.

On the CPU (the default) it times full steps (forward/backward per micro-batch + AdamW) on a
batch of random token sequences; in the same run, a no-grad forward pass over the same batch,
so each step is also reported as a ratio to a forward pass (robust to machine noise). That
forward is also what a step would cost on top if it ran the proximal policy as a pass of its
own: it takes the proximal log-probs from its training forward instead (asyncrl.trainer.step).
The fp32 step is also timed with each micro-batch's logits whole (kept for backward) instead
of a block of positions at a time (asyncrl.model.recompute), with transformers' SDPA over the
whole packed row (a block-diagonal mask) instead of the trainer's per-sequence attention
(asyncrl.model.packed_attention), and with activation checkpointing
(trainer.activationCheckpointing); each configuration's first step also counts the bytes
autograd keeps for backward. The batch's sequences come in groups of --group-size responses to
one prompt, as a GRPO job's do, which the trainer packs with the prompt once
(asyncrl.algorithms.packing); the fp32 step is also timed on the same shapes with every
sequence's prompt its own, which nothing shares (and so is the block-diagonal mask's step).

With --device cuda it times the step in bf16 autocast (fp32 without --bf16), with the logits
in blocks and whole, and prints each one's time, tokens/s through the model, MFU (6 x
parameters x tokens through the model / step time / --peak-tflops; 790 by default, an
H100/H200's dense bf16 figure rounded down; an H100 SXM's datasheet says 989) and peak GPU
memory (torch.cuda.max_memory_allocated over the timed steps); the CPU comparisons are not run.

With --megatron (CPU), the fp32 step is also timed with the Megatron-Core backend, which
computes every sequence whole: on the batch whose prompts are each their own, beside that step.

    .venv/bin/python bench/trainer_step.py [--sequences 8] [--group-size 8] [--prompt 64]
        [--response 128] [--bf16] [--megatron] [--shape smollm2-135m]
    .venv/bin/python bench/trainer_step.py --device cuda --shape qwen2.5-0.5b --sequences 64 \
        --group-size 8 --prompt 256 --response 512 --bf16

With --lora RANK it compares, on the same batch, full fine-tuning (float32 master weights, AdamW
over every weight) with a LoRA adapter of that rank on every projection (model.lora: the base
frozen in the compute dtype, AdamW over the adapter): each one's step time, MFU (6 x parameters
x tokens for full fine-tuning; 4 x for LoRA, whose base takes no weight gradients) and peak
memory (GPU memory on CUDA; the process's peak RSS on the CPU, where LoRA runs first). A
configuration that does not fit says so (Qwen2.5-7B's full fine-tuning needs ~120 GB of
weights, gradients and AdamW state alone).

    .venv/bin/python bench/trainer_step.py --device cuda --shape qwen2.5-7b --sequences 64 \
        --group-size 8 --prompt 256 --response 512 --bf16 --lora 16
"""

from __future__ import annotations

import argparse
import copy
import gc
import resource
import statistics
import time

import torch

from asyncrl.algorithms.packing import pack_sequences, pack_sharing_prefixes
from asyncrl.platform.devices import make_current, fast_bf16
from asyncrl.model.policy import SMOLLM2, load_model, packed_token_logprobs
from asyncrl.model.packed_attention import PACKED_SDPA
from asyncrl.model.lora import trained_model, with_adapter
from asyncrl.model.shapes import SHAPES, parameter_count, random_model
from asyncrl.spec.job import LoraSpec
from asyncrl.trainer.step import PolicyUpdater, TrainSample, UpdateConfig, fused_adamw

#: Tokens per micro-batch by device: a GPU runs fewer, larger micro-batches faster (fewer
#: launches). 12,288: Qwen2.5-0.5B's activations in bf16 autocast are about 1.3 MB a token,
#: so with 7.4 GB of fp32 weights, gradients and AdamW a step stays near the 20 GB target; two
#: of the bench's groups (256 + 8 x 512 tokens each) fit one micro-batch.
MICRO_BATCH_TOKENS = {"cpu": 2048, "cuda": 12288}


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
    parser.add_argument("--micro-batch-max-tokens", type=int, default=None,
                        help=f"default by device: {MICRO_BATCH_TOKENS}")
    parser.add_argument("--bf16", action="store_true",
                        help="time bf16 autocast also where the CPU emulates bf16 (on CUDA: "
                             "the step in bf16 autocast rather than fp32)")
    parser.add_argument("--megatron", action="store_true",
                        help="also time the step with the Megatron-Core backend (CPU)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None,
                        help="a published model's shape with random weights (default: "
                             "SmolLM2-135M-Instruct's own weights)")
    parser.add_argument("--profile", action="store_true",
                        help="with --device cuda: also profile one step (logits in blocks)")
    parser.add_argument("--peak-tflops", type=float, default=790.0,
                        help="the GPU's dense peak for MFU (default 790: H100/H200 bf16)")
    parser.add_argument("--lora", type=int, default=0, metavar="RANK",
                        help="compare full fine-tuning with a LoRA adapter of this rank")
    args = parser.parse_args()
    if args.micro_batch_max_tokens is None:
        args.micro_batch_max_tokens = MICRO_BATCH_TOKENS[args.device]

    device = make_current(args.device)  # as every CUDA service process (select_device)
    if args.lora:
        lora_report(device, args)
        return
    # float32 master weights, as the trainer keeps them.
    model = (load_model(SMOLLM2, device=device) if args.shape is None
             else random_model(args.shape, device, torch.float32))
    name = args.shape or "SmolLM2-135M"
    samples, unshared = make_batch(model.config.vocab_size, args)
    if device.type == "cuda":
        gpu_report(model, name, samples, args)
    else:
        cpu_report(model, name, samples, unshared, args)


def make_batch(vocab: int, args) -> tuple[list[TrainSample], list[TrainSample]]:
    """Random sequences in groups sharing a prompt, and the same with every prompt its own."""
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
    return samples, unshared


def gpu_report(model: torch.nn.Module, name: str, samples: list[TrainSample], args) -> None:
    """Step time, tokens/s, MFU and peak memory on CUDA, logits in blocks and whole."""
    dtype = "bfloat16" if args.bf16 else "float32"
    parameters = parameter_count(model)
    # What goes through the model: each group's prompt once (asyncrl.algorithms.packing).
    through = pack_sharing_prefixes([s.input_ids for s in samples],
                                    [args.prompt] * len(samples)).num_tokens
    weights_grads_adam = parameters * 4 * 4 / 2**30
    print(f"{name} ({parameters / 1e6:.0f}M parameters, vocabulary {model.config.vocab_size}) "
          f"on {torch.cuda.get_device_name()}, {dtype} "
          f"{'(bf16 weights, float32 masters)' if args.bf16 else ''}; "
          f"batch {args.sequences} x ({args.prompt} prompt + "
          f"{args.response} response) tokens in groups of {args.group_size} sharing a prompt: "
          f"{through} tokens through the model; micro-batches of at most "
          f"{args.micro_batch_max_tokens} tokens; MFU against {args.peak_tflops:.0f} TFLOP/s")
    print(f"fp32 weights + gradients + AdamW's two moments: {weights_grads_adam:.2f} GiB")
    results = {}
    runs = [(True, None), (False, None)] + ([(True, False)] if args.bf16 else [])
    for blocks, compute_weights in runs:
        label = ("logits in blocks" if blocks else "logits whole") + (
            ", autocast over float32 weights" if compute_weights is False else "")
        try:
            seconds, peak = gpu_steps(model, samples, dtype, blocks, args, compute_weights)
        except torch.cuda.OutOfMemoryError:
            print(f"trainer step, {label}: out of GPU memory")
            continue
        finally:
            gc.collect()
            torch.cuda.empty_cache()
        results[blocks, compute_weights] = seconds, peak
        mfu = 6 * parameters * through / seconds / (args.peak_tflops * 1e12)
        print(f"trainer step, {label}: {seconds:.3f} s, {through / seconds:,.0f} tokens/s "
              f"through the model, MFU {mfu:.1%}, peak GPU memory {peak / 2**30:.2f} GiB")
    if (True, None) in results and (False, None) in results:
        (fast, fast_peak), (slow, slow_peak) = results[True, None], results[False, None]
        print(f"logits in blocks / whole: step speed {slow / fast:.2f}x, peak memory "
              f"{fast_peak / slow_peak:.2f}x")
    if (True, None) in results and (True, False) in results:
        (fast, fast_peak), (slow, slow_peak) = results[True, None], results[True, False]
        print(f"bf16 weights / autocast over float32 weights: step speed {slow / fast:.2f}x, "
              f"peak memory {fast_peak / slow_peak:.2f}x")
    if args.profile:
        from profile_summary import profile_summary

        updater = gpu_updater(model, dtype, True, args)
        updater.step(samples)  # warm-up
        print(profile_summary(lambda: updater.step(samples), "one trainer step"))


def gpu_updater(model, dtype: str, blocks: bool, args,
                compute_weights: bool | None = None) -> PolicyUpdater:
    """The trainer's step as the GPU report times and profiles it: fused AdamW, the
    micro-batches of --micro-batch-max-tokens, the logits in blocks or whole; in bf16 the
    passes compute with bf16 copies of the weights (compute_weights False: autocast over
    the float32 weights instead)."""
    return PolicyUpdater(
        model, torch.optim.AdamW(model.parameters(), lr=1e-6, **fused_adamw(model)),
        UpdateConfig(micro_batch_max_tokens=args.micro_batch_max_tokens, compute_dtype=dtype,
                     logits_in_blocks=blocks, compute_weights=compute_weights))


def gpu_steps(model, samples, dtype: str, blocks: bool, args,
              compute_weights: bool | None = None) -> tuple[float, int]:
    """Median step time over --repeats steps after one warm-up, and the peak GPU memory
    allocated during them (model, gradients and optimizer state included)."""
    updater = gpu_updater(model, dtype, blocks, args, compute_weights)
    try:
        return timed_steps_on(updater, samples, args.repeats)
    finally:
        updater.optimizer.zero_grad(set_to_none=True)
        updater.optimizer.state.clear()


def timed_steps_on(updater: PolicyUpdater, samples, repeats: int) -> tuple[float, int]:
    """Median step time over `repeats` steps after one warm-up (kernels chosen, optimizer
    state made), and on CUDA the peak memory allocated during them (0 on the CPU)."""
    cuda = updater.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    updater.step(samples)
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        updater.step(samples)
        sync()
        times.append(time.perf_counter() - started)
    return statistics.median(times), torch.cuda.max_memory_allocated() if cuda else 0


def lora_report(device: torch.device, args) -> None:
    """Full fine-tuning and a LoRA adapter of rank --lora, one after the other on one batch."""
    dtype = "bfloat16" if args.bf16 else "float32"
    name = args.shape or "SmolLM2-135M"

    def model_in(parameter_dtype: torch.dtype) -> torch.nn.Module:
        return (load_model(SMOLLM2, dtype=str(parameter_dtype).removeprefix("torch."),
                           device=device) if args.shape is None
                else random_model(args.shape, device, parameter_dtype))

    # LoRA first: on the CPU the peak RSS only grows, so full fine-tuning's comes after.
    for lora in (True, False):
        label = f"LoRA rank {args.lora}" if lora else "full fine-tuning"
        try:
            if lora:
                base = model_in(getattr(torch, dtype))
                model = trained_model(with_adapter(base, LoraSpec(rank=args.lora,
                                                                  alpha=2 * args.lora),
                                                   getattr(torch, dtype)))
            else:
                model = model_in(torch.float32)
            samples, _ = make_batch(model.config.vocab_size, args)
            through = pack_sharing_prefixes([s.input_ids for s in samples],
                                            [args.prompt] * len(samples)).num_tokens
            trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
            total = parameter_count(model)
            updater = PolicyUpdater(
                model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                         lr=1e-6, **fused_adamw(model)),
                UpdateConfig(micro_batch_max_tokens=args.micro_batch_max_tokens,
                             compute_dtype=dtype))
            seconds, peak_bytes = timed_steps_on(updater, samples, args.repeats)
            peak = peak_bytes / 2**30 if device.type == "cuda" else peak_rss_gb()
            flops = (4 if lora else 6) * total * through
            mfu = (f", MFU {flops / seconds / (args.peak_tflops * 1e12):.1%}"
                   if device.type == "cuda" else "")
            print(f"RESULT {name} {label}: {trained / 1e6:.1f}M of {total / 1e6:.0f}M "
                  f"parameters trained, {dtype}; step {seconds:.3f} s, "
                  f"{through / seconds:,.0f} tokens/s through the model{mfu}, peak "
                  f"{'GPU memory' if device.type == 'cuda' else 'RSS'} {peak:.2f} GiB")
        except torch.cuda.OutOfMemoryError:
            print(f"RESULT {name} {label}: out of GPU memory")
        finally:
            model = base = updater = None
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()


def cpu_report(model: torch.nn.Module, name: str, samples: list[TrainSample],
               unshared: list[TrainSample], args) -> None:
    parameters = sum(p.numel() for p in model.parameters())
    length = args.prompt + args.response
    packed = pack_sequences([s.input_ids for s in samples])

    def forward() -> float:
        started = time.perf_counter()
        with torch.no_grad():
            packed_token_logprobs(model, packed.input_ids, packed.position_ids, packed.cu_seqlens)
        return time.perf_counter() - started

    saved = {}  # bytes kept for backward by one step, by configuration

    def timed_steps(dtype: str, attention: str = PACKED_SDPA, checkpointing: bool = False,
                    policy: torch.nn.Module = model, batch: list[TrainSample] = samples,
                    blocks: bool = True) -> float:
        updater = PolicyUpdater(
            policy, torch.optim.AdamW(policy.parameters(), lr=1e-6),
            UpdateConfig(micro_batch_max_tokens=args.micro_batch_max_tokens,
                         compute_dtype=dtype, activation_checkpointing=checkpointing,
                         logits_in_blocks=blocks))
        policy.set_attn_implementation(attention)  # the updater chose packed attention
        kept_bytes = saved_for_backward(updater, batch)  # warm-up
        if batch is samples:
            saved[dtype, attention, checkpointing, blocks] = kept_bytes
        times = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            updater.step(batch)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    forward()
    fwd = statistics.median(forward() for _ in range(args.repeats))
    fp32 = timed_steps("float32")
    fp32_whole = timed_steps("float32", blocks=False)
    fp32_unshared = timed_steps("float32", batch=unshared)
    # transformers' SDPA knows nothing of shared prompts: both attentions on whole sequences.
    fp32_block_mask = timed_steps("float32", attention="sdpa", batch=unshared)
    # Where the CPU emulates bf16 a step takes minutes and means nothing (auto: float32).
    bf16 = timed_steps("bfloat16") if args.bf16 or fast_bf16(torch.device("cpu")) else None
    # Last, on a copy: checkpointing wraps the model's layers for good.
    checkpointed = timed_steps("float32", checkpointing=True, policy=copy.deepcopy(model))
    megatron = megatron_step(model, unshared, args) if args.megatron else None

    total_tokens, trained_tokens = args.sequences * length, args.sequences * args.response
    print(f"{name}, {torch.get_num_threads()} threads, batch {args.sequences} x "
          f"({args.prompt} prompt + {args.response} response) tokens, in groups of "
          f"{args.group_size} sharing a prompt; micro-batches of at most "
          f"{args.micro_batch_max_tokens} tokens")
    print(f"no-grad forward of the batch, each sequence whole (fp32): {fwd:.2f} s")
    for label, seconds in (("fp32", fp32), ("fp32, logits whole", fp32_whole),
                           ("fp32, every prompt its own", fp32_unshared),
                           ("fp32, every prompt its own, block-diagonal mask", fp32_block_mask),
                           ("bf16 autocast", bf16)):
        if seconds is None:
            print(f"trainer step, {label}: not run, this CPU emulates bf16 (--bf16 runs it)")
            continue
        print(f"trainer step, {label}: {seconds:.2f} s ({trained_tokens / seconds:.0f} trained "
              f"tokens/s, {total_tokens / seconds:.0f} through the model; "
              f"{seconds / fwd:.1f} forwards)")
    print(f"trainer step, fp32, activation checkpointing: {checkpointed:.2f} s "
          f"({trained_tokens / checkpointed:.0f} trained tokens/s; "
          f"{checkpointed / fp32:.2f}x the fp32 step's time)")
    kept = {key: value / 2**20 for key, value in saved.items()}
    plain = kept["float32", PACKED_SDPA, False, True]
    bf16_kept = (f"bf16 autocast {kept['bfloat16', PACKED_SDPA, False, True]:.0f} MB, "
                 if bf16 is not None else "")
    print(f"kept for backward by one step: fp32 {plain:.0f} MB (logits whole: "
          f"{kept['float32', PACKED_SDPA, False, False]:.0f} MB), {bf16_kept}fp32 with "
          f"activation checkpointing {kept['float32', PACKED_SDPA, True, True]:.0f} MB "
          f"({plain / kept['float32', PACKED_SDPA, True, True]:.1f}x less)")
    if megatron is not None:
        print(f"trainer step, fp32, Megatron-Core backend (local layer spec): {megatron:.2f} s "
              f"({trained_tokens / megatron:.0f} trained tokens/s, every prompt its own); its "
              f"time / the pytorch backend's fp32 step on that batch: "
              f"{megatron / fp32_unshared:.2f}")
    if bf16 is not None:
        print(f"bf16 / fp32 step speed: {fp32 / bf16:.2f}x")
    print(f"logits in blocks / whole, step speed (fp32): {fp32_whole / fp32:.2f}x")
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
