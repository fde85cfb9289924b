"""The tiny random models tests run on, built and written in one place; what a test varies
(seed, vocabulary, sizes, architecture) is an argument.

`tiny_model` is the job's own tiny model (asyncrl.model.policy.build_tiny_model: SmolLM2's
Llama architecture with tied embeddings, deterministic by seed) and `write_snapshot` writes one
as a safetensors file, the new weights an engine loads. `tiny_transformers_model` builds what
build_tiny_model does not, for the weight mappings and the engine's layers: projection biases,
Qwen2 and Qwen3, untied embeddings, other head counts."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from safetensors.torch import save_model

from asyncrl.model.policy import TinyModelConfig, build_tiny_model

#: The vocabulary where a test does not choose one.
VOCAB = 256

#: tiny_transformers_model's configuration where a test does not choose: build_tiny_model's
#: sizes (but a narrower MLP) and its wide initialisation, which keeps generation from
#: repeating one token.
TRANSFORMERS_SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          initializer_range=0.3, tie_word_embeddings=True)

_ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}


def tiny_model(seed: int = 0, vocab_size: int = VOCAB, **sizes) -> transformers.LlamaForCausalLM:
    """The job's tiny model for `seed`; `sizes` are TinyModelConfig's (hidden_size, ...)."""
    return build_tiny_model(TinyModelConfig(seed=seed, **sizes), vocab_size=vocab_size)


def write_snapshot(path: Path, seed: int, vocab_size: int = VOCAB, **sizes) -> Path:
    """tiny_model(seed, ...) as one safetensors file at `path`, its folder made (tied embeddings
    are saved once: save_model drops the shared duplicate, which the engine accepts). The
    trainer's snapshots are directories (asyncrl.weights.disk); engines read either."""
    path.parent.mkdir(parents=True, exist_ok=True)
    save_model(tiny_model(seed, vocab_size, **sizes), str(path))
    return path


def tiny_transformers_model(architecture: str = "llama", seed: int = 0, *,
                            bias_std: float | None = None,
                            **config) -> transformers.PreTrainedModel:
    """A tiny random transformers model of `architecture` (llama, qwen2 or qwen3) for `seed`,
    without touching the caller's random state; `config` is that architecture's configuration
    over TRANSFORMERS_SIZES. With `bias_std`, the projections' biases (zero-initialised by
    transformers) are drawn from N(0, bias_std²) so that they change the outputs."""
    config_class, model_class = _ARCHITECTURES[architecture]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_class(config_class(**{**TRANSFORMERS_SIZES, **config}))
        if bias_std is not None:
            for name, parameter in model.named_parameters():
                if name.endswith(".bias"):
                    torch.nn.init.normal_(parameter, std=bias_std)
    return model
