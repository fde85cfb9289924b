"""Published model shapes, randomly initialised: what the benches measure speed on.

Speed does not depend on the weights' values, only on the shapes, so a bench can run the
shape of a model it cannot download (no network at run time) and say what that model's
throughput would be. `random_model("qwen2.5-0.5b", "cuda", torch.bfloat16)` is Qwen2.5-0.5B's
architecture (494M parameters, vocabulary 151,936) with seeded random weights.
"""

from __future__ import annotations

import torch

#: Decoder shapes of published checkpoints (their config.json values that set the cost).
SHAPES: dict[str, dict] = {
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0),
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896,
                         intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6),
    "qwen2.5-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536,
                         intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6),
    "qwen2.5-3b": dict(model_type="qwen2", vocab_size=151936, hidden_size=2048,
                       intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1e6),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584,
                       intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, tie_word_embeddings=False, rope_theta=1e6),
}


def random_model(shape: str, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Module:
    """A causal LM of `shape` (a key of SHAPES) with random weights, built on `device`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; choose one of {sorted(SHAPES)}")
    fields = dict(SHAPES[shape])
    config = AutoConfig.for_model(fields.pop("model_type"), max_position_embeddings=32768,
                                  rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, **fields)
    with torch.random.fork_rng(devices=[]), torch.device(device):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def parameter_count(model: torch.nn.Module) -> int:
    """Parameters, tied ones counted once."""
    return sum(p.numel() for p in model.parameters())
