"""Hugging Face Llama weights <-> Megatron-Core GPTModel weights (local layer spec).

Names and layouts, per decoder layer i (HF `model.layers.i.` -> Megatron `decoder.layers.i.`):

- q_proj, k_proj, v_proj -> self_attention.linear_qkv: one matrix whose rows are grouped per
  key/value head: for each of the kv_heads groups, its heads/kv_heads query heads, then its
  key head, then its value head (head_dim rows each). Both use rotate-half RoPE, so Q and K
  rows need no permutation.
- o_proj -> self_attention.linear_proj; gate_proj and up_proj -> mlp.linear_fc1 (gate rows,
  then up rows); down_proj -> mlp.linear_fc2.
- input_layernorm -> input_layernorm; post_attention_layernorm -> pre_mlp_layernorm.

And model.embed_tokens -> embedding.word_embeddings, model.norm -> decoder.final_layernorm,
lm_head -> output_layer (absent in Megatron when the embeddings are tied; HF's state dict
then names the one tensor twice, and so does megatron_to_hf's).

Tensor parallel splits each matrix the way Megatron's parallel layers hold it: column-
parallel ones (embedding, output layer, linear_qkv, linear_fc1) by rows, row-parallel ones
(linear_proj, linear_fc2) by columns; linear_fc1's gate and up halves are split separately,
so a rank holds its gate rows then its up rows. Norms are whole on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class LlamaShape:
    """What the mapping needs to know of a Llama-family model."""

    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool = False  # Qwen2's query/key/value projections have biases


    @classmethod
    def of(cls, config) -> LlamaShape:
        """From a transformers LlamaConfig (or any config with its field names)."""
        heads = config.num_attention_heads
        return cls(
            layers=config.num_hidden_layers, hidden_size=config.hidden_size, heads=heads,
            kv_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            ffn_hidden_size=config.intermediate_size, vocab_size=config.vocab_size,
            tied_embeddings=bool(config.tie_word_embeddings),
            qkv_bias=getattr(config, "model_type", "") == "qwen2",
        )


_LAYER_COPIES = {  # HF name in a layer -> Megatron name in a layer, same tensor
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
_TOP_COPIES = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "model.norm.weight": "decoder.final_layernorm.weight",
}


def hf_to_megatron(state: dict[str, Tensor], shape: LlamaShape) -> dict[str, Tensor]:
    """A whole HF Llama state dict as a whole (tensor parallel 1) Megatron state dict."""
    out = {megatron: state[hf] for hf, megatron in _TOP_COPIES.items()}
    if not shape.tied_embeddings:
        out["output_layer.weight"] = state["lm_head.weight"]
    for i in range(shape.layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_name, mg_name in _LAYER_COPIES.items():
            out[mg + mg_name] = state[hf + hf_name]
        for kind in ("weight", "bias") if shape.qkv_bias else ("weight",):
            out[mg + f"self_attention.linear_qkv.{kind}"] = _group_qkv(
                [state[hf + f"self_attn.{p}_proj.{kind}"] for p in "qkv"], shape)
        out[mg + "mlp.linear_fc1.weight"] = torch.cat(
            [state[hf + "mlp.gate_proj.weight"], state[hf + "mlp.up_proj.weight"]])
    return out


def megatron_to_hf(state: dict[str, Tensor], shape: LlamaShape) -> dict[str, Tensor]:
    """The inverse of hf_to_megatron: HF names, in the layout transformers loads."""
    out = {hf: state[megatron] for hf, megatron in _TOP_COPIES.items()}
    out["lm_head.weight"] = (out["model.embed_tokens.weight"] if shape.tied_embeddings
                             else state["output_layer.weight"])
    for i in range(shape.layers):
        hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_name, mg_name in _LAYER_COPIES.items():
            out[hf + hf_name] = state[mg + mg_name]
        for kind in ("weight", "bias") if shape.qkv_bias else ("weight",):
            q, k, v = _ungroup_qkv(state[mg + f"self_attention.linear_qkv.{kind}"], shape)
            out[hf + f"self_attn.q_proj.{kind}"] = q
            out[hf + f"self_attn.k_proj.{kind}"] = k
            out[hf + f"self_attn.v_proj.{kind}"] = v
        gate, up = state[mg + "mlp.linear_fc1.weight"].chunk(2)
        out[hf + "mlp.gate_proj.weight"] = gate
        out[hf + "mlp.up_proj.weight"] = up
    return out


#: Megatron-Core's TransformerEngine layer spec has no norm modules of its own in a layer: each
#: norm is fused into the linear layer after it (TELayerNormColumnParallelLinear).
_TRANSFORMER_ENGINE_NORMS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
}


def to_transformer_engine_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """A local-spec Megatron state dict under the TransformerEngine spec's names."""
    return {_renamed(name, _TRANSFORMER_ENGINE_NORMS): tensor for name, tensor in state.items()}


def from_transformer_engine_names(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """to_transformer_engine_names' inverse."""
    back = {fused: local for local, fused in _TRANSFORMER_ENGINE_NORMS.items()}
    return {_renamed(name, back): tensor for name, tensor in state.items()}


def _renamed(name: str, suffixes: dict[str, str]) -> str:
    for old, new in suffixes.items():
        if name.startswith("decoder.layers.") and name.endswith("." + old):
            return name[: -len(old)] + new
    return name


def _group_qkv(qkv: list[Tensor], shape: LlamaShape) -> Tensor:
    """q, k, v projections (weights or biases) -> rows grouped per key/value head."""
    per_group = shape.heads // shape.kv_heads
    q, k, v = (t.reshape(shape.kv_heads, heads * shape.head_dim, *t.shape[1:])
               for t, heads in zip(qkv, (per_group, 1, 1)))
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])


def _ungroup_qkv(fused: Tensor, shape: LlamaShape) -> tuple[Tensor, Tensor, Tensor]:
    """_group_qkv's inverse."""
    per_group = shape.heads // shape.kv_heads
    grouped = fused.reshape(shape.kv_heads, (per_group + 2) * shape.head_dim, *fused.shape[1:])
    parts = grouped.split([per_group * shape.head_dim, shape.head_dim, shape.head_dim], dim=1)
    return tuple(part.reshape(-1, *fused.shape[1:]) for part in parts)


def split_dim(name: str) -> int | None:
    """The dimension tensor parallel splits a Megatron tensor along (None: whole on every
    rank)."""
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return 1
    if name.endswith(("word_embeddings.weight", "output_layer.weight", "linear_qkv.weight",
                      "linear_qkv.bias", "linear_fc1.weight")):
        return 0
    return None


def shard(name: str, tensor: Tensor, rank: int, size: int) -> Tensor:
    """Rank `rank`'s part of a whole Megatron tensor under tensor parallel `size`."""
    dim = split_dim(name)
    if dim is None or size == 1:
        return tensor
    if name.endswith("linear_fc1.weight"):
        gate, up = tensor.chunk(2)
        return torch.cat([gate.chunk(size)[rank], up.chunk(size)[rank]])
    return tensor.chunk(size, dim=dim)[rank]


def unshard(name: str, parts: list[Tensor]) -> Tensor:
    """The whole Megatron tensor from every rank's part, in rank order (shard's inverse)."""
    dim = split_dim(name)
    if dim is None or len(parts) == 1:
        return parts[0]
    if name.endswith("linear_fc1.weight"):
        halves = [part.chunk(2) for part in parts]
        return torch.cat([gate for gate, _ in halves] + [up for _, up in halves])
    return torch.cat(parts, dim=dim)
