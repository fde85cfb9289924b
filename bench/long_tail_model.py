"""A random model whose response lengths follow a geometric tail, for bench/async_vs_sync.py
on a GPU: throughput does not depend on the weights, only on the shapes and on how long the
responses are, and a trained model cannot be downloaded here.

Every position's logits are 0 but EOS's, which is `a`: each token ends the response with
probability p = e^a / (e^a + V - 1), whatever came before, so lengths are geometric with mean
1/p (cut at the job's maxNewTokens), the long tail a synchronous step waits for. It is done
with weights only, in any dtype:

- one coordinate `c` of every token's embedding is a large constant B, so the residual stream
  at `c` stays B through the layers (their outputs are small beside it);
- the final norm keeps coordinate `c` only: its output is sqrt(d) there (B over the stream's
  root mean square, B / sqrt(d)) and 0 elsewhere;
- the head (untied from the embedding) reads coordinate `c` for EOS alone.

    .venv/bin/python bench/long_tail_model.py OUT [--mean-tokens 150] [--size 0.4b|tiny]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from asyncrl.model.policy import SMOLLM2, load_tokenizer

#: Llama bodies on SmolLM2's vocabulary (its tokenizer serves the arith prompts).
SIZES = {
    "0.4b": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=20,
                 num_attention_heads=16, num_key_value_heads=4),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2),
}
#: The embedding's constant coordinate: large beside what the layers add (their inputs are
#: normalised), small enough that its square is far from float32's and bf16's range.
STREAM_CONSTANT = 1e4


def eos_logit(mean_tokens: float, vocab: int) -> float:
    """The EOS logit `a` that ends a response with probability 1 / mean_tokens a token."""
    p = 1 / mean_tokens
    return math.log(p / (1 - p) * (vocab - 1))


def write_long_tail_model(out: Path, mean_tokens: float = 150, size: str = "0.4b",
                          dtype: torch.dtype = torch.bfloat16) -> Path:
    tokenizer = load_tokenizer(SMOLLM2)
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=4096,
                         tie_word_embeddings=False, rope_theta=100000.0,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **SIZES[size])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    d, c = config.hidden_size, 0
    with torch.no_grad():
        model.model.embed_tokens.weight[:, c] = STREAM_CONSTANT
        model.model.norm.weight.zero_()
        model.model.norm.weight[c] = 1.0
        model.lm_head.weight[:, c] = 0.0
        model.lm_head.weight[tokenizer.eos_token_id, c] = (
            eos_logit(mean_tokens, config.vocab_size) / math.sqrt(d))
    model.to(dtype).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--mean-tokens", type=float, default=150)
    parser.add_argument("--size", choices=sorted(SIZES), default="0.4b")
    args = parser.parse_args()
    write_long_tail_model(args.out, args.mean_tokens, args.size)
    print(f"wrote {args.out}: lengths geometric with mean {args.mean_tokens:g} tokens")


if __name__ == "__main__":
    main()
