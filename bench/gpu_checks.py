"""Checks, on a GPU, what CPU tests can only check with stand-ins: the variable-length flash
kernel against the reference kernel in bf16 (values and gradients, prompts shared), the
trainer's log-probs through it against padded batches, overlapped decode steps against steps
one after another, and bf16 compute weights against autocast. One line per check; exits 1 if
one fails. About a minute on an H200 (the first section of bench/gpu_figures.sh).

    python3 bench/gpu_checks.py                   # on a CUDA machine
    python3 bench/gpu_checks.py --device cpu --shape smollm2-135m   # a dry run: float32,
                                                                    # the reference kernel
"""

from __future__ import annotations

import argparse
import inspect
import sys

import torch

import asyncrl.model.packed_attention as packed_attention
from asyncrl.algorithms.packing import pack_sharing_prefixes
from asyncrl.engine.torch_engine import TorchEngine
from asyncrl.engine.types import SamplingParams
from asyncrl.model.policy import packed_token_logprobs
from asyncrl.model.shapes import random_model
from asyncrl.model.varlen_attention import installed_kernel, varlen_reference
from asyncrl.platform.devices import make_current
from asyncrl.trainer.step import PolicyUpdater, TrainSample, UpdateConfig

failures: list[str] = []


def check(name: str, value: float, limit: float) -> None:
    ok = value <= limit
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {value:.3g} (at most {limit:g})", flush=True)
    if not ok:
        failures.append(name)


def kernel_against_reference(device, dtype, kernel) -> None:
    """Values and gradients of one layer's attention over a row of 4 prompts with 8
    responses each (lengths 40 to 300), kernel against reference."""
    generator = torch.Generator().manual_seed(0)
    edges, continues = [0], []
    for _ in range(4):
        edges.append(edges[-1] + 128)
        continues.append(-1)
        parent = len(edges) - 2
        for _ in range(8):
            edges.append(edges[-1] + int(torch.randint(40, 300, (1,), generator=generator)))
            continues.append(parent)
    length, heads, kv_heads, dim = edges[-1], 14, 2, 64
    tensors = [torch.randn(1, h, length, dim, device=device, dtype=dtype, requires_grad=True)
               for h in (heads, kv_heads, kv_heads)]
    weights = torch.randn(1, length, heads, dim, generator=generator).to(device, dtype)
    results = []
    for chosen in (kernel, varlen_reference):
        layout = packed_attention.VarlenLayout.build(edges, continues, device, chosen)
        out = layout.attend(*tensors, 0.0, dim ** -0.5)
        results.append((out.detach(), torch.autograd.grad((out * weights).sum(), tensors)))
    (got, got_grads), (expected, expected_grads) = results
    check("varlen kernel against reference, values", float((got - expected).abs().max()), 2e-2)
    for name, grad, expected_grad in zip("qkv", got_grads, expected_grads):
        check(f"varlen kernel against reference, d{name}",
              float((grad - expected_grad).abs().max()), 5e-2)


def trainer_logprobs(device, dtype, shape: str) -> None:
    """A random model's (Qwen2.5-0.5B's shape on a GPU) log-probs of 2 groups of 8 responses, packed sharing prompts,
    by variable-length attention against padded batches, under the trainer's autocast."""
    model = packed_attention.use_packed_attention(random_model(shape, device))
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    sequences, prompts = [], []
    for _ in range(2):
        prompt = torch.randint(0, vocab, (200,), generator=generator)
        for _ in range(8):
            response = torch.randint(0, vocab, (int(torch.randint(50, 400, (1,),
                                                                   generator=generator)),),
                                     generator=generator)
            sequences.append(torch.cat([prompt, response]))
            prompts.append(200)
    packed = pack_sharing_prefixes(sequences, prompts)
    results = []
    for devices in (("cuda", "cpu"), ()):  # varlen; batched
        packed_attention.VARLEN_DEVICES = devices
        packed_attention.BATCHED_DEVICES = ("cuda", "cpu")
        with torch.no_grad(), torch.autocast(device.type, dtype=dtype,
                                             enabled=dtype != torch.float32):
            results.append(packed_token_logprobs(
                model, packed.input_ids.to(device), packed.position_ids.to(device),
                packed.cu_seqlens.to(device), continues=packed.continues.to(device)))
    packed_attention.VARLEN_DEVICES = ("cuda",)
    packed_attention.BATCHED_DEVICES = ("cuda",)
    check("trainer log-probs, varlen against batched", float((results[0] - results[1]).abs().max()),
          5e-2)


def overlapped_decode(device, dtype, shape: str) -> None:
    """Greedy tokens of 24 requests to a random model with the overlap on and off."""
    outputs = []
    for overlap in (False, True):
        model = random_model(shape, device, dtype)
        vocab = model.config.vocab_size
        engine = TorchEngine(model, max_running_requests=16, max_sequence_length=512, seed=0,
                             overlap=overlap)
        generator = torch.Generator().manual_seed(2)
        futures = [engine.submit(torch.randint(0, vocab, (int(n),), generator=generator).tolist(),
                                 SamplingParams(max_new_tokens=int(m), temperature=0,
                                                ignore_eos=True))
                   for n, m in zip(torch.randint(8, 64, (24,), generator=generator),
                                   torch.randint(4, 96, (24,), generator=generator))]
        engine.run_until_idle()
        outputs.append([f.result().output_ids for f in futures])
        engine.stop()
    same = sum(a == b for a, b in zip(*outputs)) / len(outputs[0])
    # bf16 may flip a rare near-tie where batch shapes differ by a stopped row.
    check("overlapped decode, share of requests with other greedy tokens", 1 - same, 0.1)


def compute_weights(device, shape: str, count: int = 16) -> None:
    """One bf16 step of a random model with bf16 weights against autocast over float32."""
    generator = torch.Generator().manual_seed(3)
    samples = []
    for _ in range(count):
        ids = torch.randint(0, 49152, (256 + 128,), generator=generator)
        mask = torch.zeros(len(ids), dtype=torch.bool)
        mask[256:] = True
        samples.append(TrainSample(ids, mask, torch.where(mask, -11.0, 0.0),
                                   float(torch.randn(1, generator=generator))))
    norms = []
    for kept in (False, True):
        model = random_model(shape, device)
        updater = PolicyUpdater(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                                UpdateConfig(compute_dtype="bfloat16", compute_weights=kept))
        norms.append(updater.step(samples)["grad_norm"])
    check("bf16 weights against autocast, relative grad-norm difference",
          abs(norms[1] - norms[0]) / abs(norms[0]), 5e-2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="qwen2.5-0.5b",
                        help="the random model's shape (asyncrl.model.shapes.SHAPES)")
    args = parser.parse_args()
    device = make_current(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kernel = installed_kernel() if device.type == "cuda" else varlen_reference
    print(f"torch {torch.__version__}, {device}, varlen_attn "
          f"{inspect.signature(kernel) if kernel else 'missing'}", flush=True)
    if kernel is None:
        failures.append("this PyTorch has no varlen_attn: the trainer attends in batches")
    else:
        kernel_against_reference(device, dtype, kernel)
        if device.type != "cuda":
            packed_attention.VARLEN_KERNEL = varlen_reference
        trainer_logprobs(device, dtype, args.shape)
    overlapped_decode(device, dtype, args.shape)
    if device.type == "cuda":
        compute_weights(device, args.shape)
    if failures:
        print("failed:", "; ".join(failures))
        sys.exit(1)


if __name__ == "__main__":
    main()
