"""A decode step through a Llama-family model's own weights in fewer, larger kernels.

A decode step feeds one token per running request. At the batch sizes of a rollout worker
its matrix multiplies are small, and on a CPU the model's own layers spend about as long
again on hundreds of small kernels around them (three projections where one would do, the
rotary embedding built from slices and a concatenation, one mask conversion per layer). This
step computes the same function with:

- one matrix multiply for q, k and v, and one for gate and up: the model's own projection
  weights become row ranges of one tensor each (views: a weight update copied into the model's
  parameters lands in the fused tensors, and no memory is added);
- the rotary embedding of q and k together, as `q * cos + swap_halves(q) * signed_sin`;
- the attention mask made additive once per step, and grouped-query attention with the query
  heads of one key/value head packed as its queries (what transformers does for one token).

Prefill, and models of other architectures, run the model's own layers (`TorchEngine`). The
engine's tests compare both paths' log-probabilities with the trainer's forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from asyncrl.engine.kv_cache import SlotKVCache, head_dim

#: Decoder layers whose forward is exactly: norm, attention (q/k/v/o projections, rotary
#: embedding, softmax attention), residual, norm, SiLU-gated MLP, residual.
_LAYERS = {"LlamaDecoderLayer", "Qwen2DecoderLayer"}
_NORMS = {"LlamaRMSNorm", "Qwen2RMSNorm"}


@dataclass
class _Layer:
    input_norm: nn.Module
    qkv: nn.Linear  # q, k and v projections, fused
    o_proj: nn.Linear
    post_norm: nn.Module
    gate_up: nn.Linear  # gate and up projections, fused
    down_proj: nn.Linear
    scaling: float


class FusedDecoder:
    """Logits of one decode step, for models `for_model` accepts."""

    def __init__(self, model: nn.Module):
        config = model.config
        self._model = model.model
        self._lm_head = model.lm_head
        self._heads = config.num_attention_heads
        self._kv_heads = config.num_key_value_heads
        self._head_dim = head_dim(config)
        self._layers = [
            _Layer(
                input_norm=layer.input_layernorm,
                qkv=_fused_linear([layer.self_attn.q_proj, layer.self_attn.k_proj,
                                   layer.self_attn.v_proj]),
                o_proj=layer.self_attn.o_proj,
                post_norm=layer.post_attention_layernorm,
                gate_up=_fused_linear([layer.mlp.gate_proj, layer.mlp.up_proj]),
                down_proj=layer.mlp.down_proj,
                scaling=layer.self_attn.scaling,
            )
            for layer in model.model.layers
        ]

    @classmethod
    def for_model(cls, model: nn.Module) -> FusedDecoder | None:
        """A fused decoder for `model`, or None where its layers are not the ones this step
        computes (the engine then decodes through the model's own layers)."""
        config = model.config
        layers = getattr(getattr(model, "model", None), "layers", None)
        if (
            not layers
            or getattr(config, "hidden_act", None) != "silu"
            or any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ())
            or not all(_fusable(layer) for layer in layers)
        ):
            return None
        return cls(model)

    def logits(self, ids: Tensor, positions: Tensor, cache: SlotKVCache, read_length: int,
               mask: Tensor) -> Tensor:
        """Logits [n, vocab] for one new token per row: `ids` and `positions` [n, 1], rows
        0..n-1 of `cache` attended over `[:read_length]` where `mask` [n, 1, 1, read_length]
        is True (as TorchEngine._decode builds them)."""
        n, heads, kv_heads, dim = ids.shape[0], self._heads, self._kv_heads, self._head_dim
        cache.prepare(slice(0, n), positions, read_length)
        hidden = self._model.embed_tokens(ids[:, 0])
        cos, sin = self._model.rotary_emb(hidden, positions)  # [n, 1, dim]
        half = dim // 2
        # swap_halves(x) * signed_sin is transformers' rotate_half(x) * sin.
        signed_sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
        additive = torch.zeros(mask.shape, dtype=hidden.dtype, device=hidden.device)
        additive.masked_fill_(~mask, float("-inf"))
        q_and_k = heads + kv_heads
        for index, layer in enumerate(self._layers):
            qkv = layer.qkv(layer.input_norm(hidden))
            qk = qkv[:, : q_and_k * dim].view(n, q_and_k, dim)
            swapped = qk.roll(half, dims=-1)
            qk = torch.addcmul(qk * cos, swapped, signed_sin)
            value = qkv[:, q_and_k * dim :].view(n, kv_heads, 1, dim)
            keys, values = cache.update(qk[:, heads:, None], value, index)
            # The query heads that share a key/value head are that head's queries.
            query = qk[:, :heads].reshape(n, kv_heads, heads // kv_heads, dim)
            attended = F.scaled_dot_product_attention(query, keys, values, attn_mask=additive,
                                                      scale=layer.scaling)
            hidden = hidden + layer.o_proj(attended.reshape(n, heads * dim))
            gate_up = layer.gate_up(layer.post_norm(hidden))
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = hidden + layer.down_proj(F.silu(gate) * up)
        return self._lm_head(self._model.norm(hidden))


def _fusable(layer: nn.Module) -> bool:
    attention, mlp = layer.self_attn, layer.mlp
    return (
        type(layer).__name__ in _LAYERS
        and type(layer.input_layernorm).__name__ in _NORMS
        and type(layer.post_attention_layernorm).__name__ in _NORMS
        and _same_bias([attention.q_proj, attention.k_proj, attention.v_proj])
        and _same_bias([mlp.gate_proj, mlp.up_proj])
    )


def _same_bias(projections: list[nn.Linear]) -> bool:
    """All with a bias or all without: what one fused projection can compute."""
    return len({p.bias is None for p in projections}) == 1


def _fused_linear(projections: list[nn.Linear]) -> nn.Linear:
    """One linear layer computing `projections` side by side; each projection's weight (and
    bias) becomes a view of the fused one, so they keep sharing whatever is copied in."""
    biased = projections[0].bias is not None
    fused = nn.Linear(projections[0].in_features, sum(p.out_features for p in projections),
                      bias=biased, device="meta")
    fused.weight = nn.Parameter(_joined([p.weight for p in projections]), requires_grad=False)
    if biased:
        fused.bias = nn.Parameter(_joined([p.bias for p in projections]), requires_grad=False)
    return fused


def _joined(tensors: list[Tensor]) -> Tensor:
    """The tensors concatenated along dim 0; each then points into the result."""
    joined = torch.cat([t.detach() for t in tensors])
    start = 0
    for tensor in tensors:
        tensor.data = joined[start : start + tensor.shape[0]]
        start += tensor.shape[0]
    return joined
