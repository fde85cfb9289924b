"""The job's Llama-family policy as a Megatron-Core GPTModel, trained behind the interface the
pytorch backend's model offers the trainer (asyncrl.trainer.step): per-token log-probs of a
packed micro-batch, parameters for the optimizer, and whole Hugging Face state dicts in and
out, so checkpoints and published snapshots are the same files either backend writes.

Built with Megatron-Core's local layer spec (pure torch: runs on a CPU), or its
TransformerEngine spec on a GPU where TransformerEngine is installed. GPTModel is used, not
the HybridModel 0.19 moves to: megatron-core 0.16.1 is the last release that installs on the
project's Python 3.11, and its GPTModel is not deprecated.
"""

from __future__ import annotations

import importlib.util
import logging
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from asyncrl.model.policy import logprobs_at, predicted_positions
from asyncrl.trainer.megatron import hf_layout
from asyncrl.trainer.megatron.compat import (
    MEGATRON_CORE_VERSION,
    import_megatron,
    initialize_parallel,
)
from asyncrl.trainer.megatron.hf_layout import LlamaShape

log = logging.getLogger(__name__)


def _rope_theta(config) -> float:
    parameters = getattr(config, "rope_parameters", None) or {}
    kind = parameters.get("rope_type", "default")
    if kind != "default":
        raise ValueError(f"trainer.backend megatron: the model's RoPE scaling {kind!r} is not "
                         "supported (plain RoPE only); use backend: pytorch for this model")
    return float(parameters.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


def _layer_spec(device: torch.device):
    """("transformer-engine" or "local", the spec): TransformerEngine's fused layers on a GPU
    where it is installed, else Megatron-Core's pure torch ones."""
    from megatron.core.models.gpt import gpt_layer_specs

    if device.type == "cuda" and importlib.util.find_spec("transformer_engine") is not None:
        return "transformer-engine", gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    return "local", gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")


class MegatronPolicy(torch.nn.Module):
    """A GPTModel with a Llama's shape and weights; `gpt` is the Megatron-Core module.

    Megatron's process groups must be up (compat.initialize_parallel). Under tensor parallel
    each rank holds its share of the weights (hf_layout.shard).
    """

    #: Its linear layers take bf16 autocast on CUDA only (see spec/job.py's _check_megatron):
    #: trainer.computeDtype auto stays float32 on a CPU.
    autocast_devices = ("cuda",)

    def __init__(self, hf_config, hf_parameter_names: list[str], device: torch.device):
        super().__init__()
        import_megatron()
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.transformer import TransformerConfig

        self.shape = LlamaShape.of(hf_config)
        if getattr(hf_config, "mlp_bias", False) or getattr(hf_config, "hidden_act", "silu") != "silu":
            raise ValueError("trainer.backend megatron: only SwiGLU MLPs without bias are "
                             "supported; use backend: pytorch for this model")
        if getattr(hf_config, "attention_bias", False):
            raise ValueError("trainer.backend megatron: attention output biases are not "
                             "supported; use backend: pytorch for this model")
        with warnings.catch_warnings():
            # Megatron-Core's own defaults warn (cuda_graph_scope "full" is deprecated; Apex
            # absent, torch's norm used): nothing a user of this backend can act on.
            warnings.filterwarnings("ignore", message=".*(full scope is deprecated|Apex is not)")
            config = TransformerConfig(
                num_layers=self.shape.layers, hidden_size=self.shape.hidden_size,
                num_attention_heads=self.shape.heads, num_query_groups=self.shape.kv_heads,
                kv_channels=self.shape.head_dim, ffn_hidden_size=self.shape.ffn_hidden_size,
                normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps,
                gated_linear_unit=True, activation_func=F.silu,
                add_bias_linear=False, add_qkv_bias=self.shape.qkv_bias,
                hidden_dropout=0.0, attention_dropout=0.0,
                # The fused kernels are CUDA (or Apex) kernels; the unfused paths are exact.
                bias_activation_fusion=False, masked_softmax_fusion=False,
                persist_layer_norm=False, bias_dropout_fusion=False, apply_rope_fusion=False,
                gradient_accumulation_fusion=False,
                use_cpu_initialization=device.type == "cpu", params_dtype=torch.float32,
                tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
                pipeline_model_parallel_size=(
                    parallel_state.get_pipeline_model_parallel_world_size()),
            )
            self.layer_spec, spec = _layer_spec(device)
            self.gpt = GPTModel(
                config, spec, vocab_size=self.shape.vocab_size,
                max_sequence_length=hf_config.max_position_embeddings,
                # Gathered at run time (runtime_gather_output): gathering in the
                # constructor's way fails in backward on an in-place view of the logits.
                parallel_output=True,
                share_embeddings_and_output_weights=self.shape.tied_embeddings,
                position_embedding_type="rope", rotary_base=_rope_theta(hf_config),
            ).to(device)
        self.device = device
        # The HF model's parameter names in its order, a tied weight once (as torch's full
        # optimizer state dict names them).
        self.hf_parameter_names = hf_parameter_names
        self._tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self._tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self._tp_group = parallel_state.get_tensor_model_parallel_group()
        self._keep: tuple[Tensor, Tensor] | None = None
        self.gpt.decoder.register_forward_hook(self._keep_wanted_positions)

    @classmethod
    def from_hf(cls, hf_model: torch.nn.Module, device: torch.device) -> MegatronPolicy:
        """A GPTModel holding `hf_model`'s weights (this rank's share of them)."""
        policy = cls(hf_model.config, [name for name, _ in hf_model.named_parameters()], device)
        policy.load_hf_state_dict(hf_model.state_dict())
        return policy

    # ------------------------------------------------------------------ weights

    def load_hf_state_dict(self, state: dict[str, Tensor]) -> None:
        """Loads a whole HF state dict (this rank takes its share)."""
        whole = self._spec_names(hf_layout.hf_to_megatron(state, self.shape))
        mine = {name: hf_layout.shard(name, tensor, self._tp_rank, self._tp_size)
                for name, tensor in whole.items()}
        missing, unexpected = self.gpt.load_state_dict(mine, strict=False)
        missing = [name for name in missing if not name.endswith("_extra_state")]
        if missing or unexpected:
            raise ValueError(f"Megatron weights do not match the model: missing {missing}, "
                             f"unexpected {unexpected}")

    def hf_state_dict(self) -> dict[str, Tensor]:
        """The whole model as an HF state dict on the CPU (a collective under tensor
        parallel: every rank of the group calls it)."""
        return hf_layout.megatron_to_hf(self._local_names(
            {name: self._whole(name, tensor.detach())
             for name, tensor in self.gpt.state_dict().items()
             if not name.endswith("_extra_state")}), self.shape)

    def _spec_names(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """Local-spec names (the mapper's) -> this model's layer spec's names."""
        if self.layer_spec == "transformer-engine":
            return hf_layout.to_transformer_engine_names(state)
        return state

    def _local_names(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """_spec_names' inverse."""
        if self.layer_spec == "transformer-engine":
            return hf_layout.from_transformer_engine_names(state)
        return state

    def _whole(self, name: str, tensor: Tensor) -> Tensor:
        """A copy on the CPU of the whole tensor `name`, of which this rank holds `tensor`."""
        if self._tp_size > 1 and hf_layout.split_dim(name) is not None:
            parts = [torch.empty_like(tensor) for _ in range(self._tp_size)]
            dist.all_gather(parts, tensor.contiguous(), group=self._tp_group)
            tensor = hf_layout.unshard(name, parts)
        return tensor.to("cpu", copy=True)

    # ------------------------------------------------------------------ optimizer

    def hf_optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's state in the form the pytorch backend checkpoints (torch's full
        optimizer state dict of the HF model: per-parameter state keyed by HF name, and the
        param groups), so a checkpoint is the same whichever backend wrote it. Each state
        tensor shaped like its parameter (Adam's moments) is gathered and mapped as the
        weights are; a scalar (Adam's step) is the same for every parameter here, since every
        step updates them all. A collective under tensor parallel."""
        names = {id(p): name for name, p in self.gpt.named_parameters()}
        (group,) = optimizer.param_groups  # PolicyUpdater.from_spec: one AdamW group
        per_name = {names[id(p)]: optimizer.state[p] for p in group["params"]
                    if optimizer.state.get(p)}
        hf_names = self.hf_parameter_names
        hyper = {key: value for key, value in group.items() if key != "params"}
        if not per_name:
            return {"state": {}, "param_groups": [{**hyper, "params": hf_names}]}
        first = next(iter(per_name.values()))
        moments = [key for key, value in first.items() if torch.is_tensor(value) and value.dim()]
        scalars = {key: value for key, value in first.items() if key not in moments}
        mapped = {key: hf_layout.megatron_to_hf(self._local_names(
                      {name: self._whole(name, state[key]) for name, state in per_name.items()}),
                      self.shape)
                  for key in moments}
        return {
            "state": {name: {**scalars, **{key: mapped[key][name] for key in moments}}
                      for name in hf_names},
            "param_groups": [{**hyper, "params": hf_names}],
        }

    def load_hf_optimizer_state(self, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """hf_optimizer_state's inverse: this rank takes its share of every moment."""
        (group,) = optimizer.param_groups
        group.update({key: value for key, value in state["param_groups"][0].items()
                      if key != "params"})
        if not state["state"]:
            return
        per_hf = state["state"]
        first = next(iter(per_hf.values()))
        moments = [key for key, value in first.items() if torch.is_tensor(value) and value.dim()]
        scalars = {key: value for key, value in first.items() if key not in moments}
        whole = {}
        for key in moments:
            tensors = {name: entry[key] for name, entry in per_hf.items()}
            if self.shape.tied_embeddings:
                tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
            whole[key] = self._spec_names(hf_layout.hf_to_megatron(tensors, self.shape))
        for name, parameter in self.gpt.named_parameters():
            optimizer.state[parameter] = {
                **{key: torch.as_tensor(value).clone() for key, value in scalars.items()},
                **{key: hf_layout.shard(name, whole[key][name], self._tp_rank, self._tp_size)
                   .to(parameter.device, copy=True) for key in moments},
            }

    # ------------------------------------------------------------------ tensor parallel

    @property
    def data_parallel_group(self):
        """The ranks that hold the same weights and train on different samples: gradients
        and token counts are summed over them (not over the tensor-parallel peers, which see
        the same samples)."""
        from megatron.core import parallel_state
        return parallel_state.get_data_parallel_group()

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """torch.nn.utils.clip_grad_norm_ over the whole model: the squared norms summed over
        the tensor-parallel ranks, each split parameter's part on its rank and each whole
        (replicated) parameter on the first rank only (Megatron-Core's own rule)."""
        from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

        grads = [p.grad for p in self.gpt.parameters() if p.grad is not None]
        squared = sum((p.grad.float().pow(2).sum() for p in self.gpt.parameters()
                       if p.grad is not None and param_is_not_tensor_parallel_duplicate(p)),
                      torch.zeros((), device=self.device))
        if self._tp_size > 1:
            dist.all_reduce(squared, group=self._tp_group)
        total = squared.sqrt()
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for grad in grads:
            grad.mul_(scale)
        return total

    # ------------------------------------------------------------------ log-probs

    def packed_token_logprobs(self, input_ids: Tensor, position_ids: Tensor,
                              cu_seqlens: Tensor, temperature: float = 1.0,
                              needed: Tensor | None = None) -> Tensor:
        """What asyncrl.model.policy.packed_token_logprobs computes for a transformers model: the
        log-probability of every token of a packed row given its prefix in its own sequence
        (0 for a sequence's first token and for tokens not `needed`).

        The row is laid out as a right-padded batch of its sequences, so Megatron's rotary
        embedding (positions 0..S-1 of each row) and a causal mask are all it needs; padding
        sits after each sequence, where no real token attends."""
        del position_ids  # the padded layout has each sequence start at position 0
        if input_ids.numel() == 0:
            return torch.zeros(0, device=input_ids.device)
        bounds = cu_seqlens.to(input_ids.device).long()
        lengths = bounds[1:] - bounds[:-1]
        rows = torch.repeat_interleave(torch.arange(len(lengths), device=input_ids.device),
                                       lengths)
        columns = torch.arange(input_ids.numel(), device=input_ids.device) - bounds[rows]
        longest = int(lengths.max())
        padded = input_ids.new_zeros(len(lengths), longest)
        padded[rows, columns] = input_ids
        targets = predicted_positions(input_ids, bounds, needed)
        causal = torch.triu(torch.ones(longest, longest, dtype=torch.bool,
                                       device=input_ids.device), diagonal=1)
        positions = torch.arange(longest, device=input_ids.device)[None].expand_as(padded)
        # Only the positions that predict a wanted token reach the output layer (the largest
        # matrix of a small model), as logits_to_keep does for transformers.
        self._keep = (columns[targets] - 1, rows[targets])
        try:
            logits = self.gpt(padded, positions, causal[None, None],
                              runtime_gather_output=True)[0].float()
        finally:
            self._keep = None
        if temperature != 1.0:
            # Not in place: the logits are a view of the output layer's custom autograd output.
            logits = logits / temperature
        return logprobs_at(logits, input_ids, targets)

    def _keep_wanted_positions(self, module, inputs, hidden: Tensor) -> Tensor | None:
        """Forward hook on the decoder: its [sequence, batch, hidden] output, reduced to the
        positions packed_token_logprobs needs, as a [positions, 1, hidden] batch of one."""
        if self._keep is None:
            return None
        columns, rows = self._keep
        return hidden[columns, rows][:, None]


def megatron_policy(spec, hf_model: torch.nn.Module, device: torch.device) -> MegatronPolicy:
    """The RLJob's trainer model under `trainer.backend: megatron`: Megatron's process groups
    over this process's world, then a GPTModel with `hf_model`'s weights. A model whose shape
    the spec could not check (a local directory) is checked here, by the same rule."""
    from asyncrl.spec.job import megatron_shape_problem

    sizes = spec.trainer.megatron
    shape = LlamaShape.of(hf_model.config)
    problem = megatron_shape_problem(shape.heads, shape.kv_heads, shape.layers,
                                     sizes.tensor_parallel, sizes.pipeline_parallel)
    if problem is not None:
        field, message, fix = problem
        raise ValueError(f"spec.trainer.megatron.{field}: {message}; fix: {fix}")
    initialize_parallel(sizes.tensor_parallel, sizes.pipeline_parallel, device)
    from megatron.core import parallel_state

    if parallel_state.get_data_parallel_rank() != dist.get_rank() // sizes.tensor_parallel:
        # The trainer's leader gives consecutive ranks the same samples (shares_per_rank).
        raise RuntimeError("Megatron-Core's rank order is not tensor parallel first; "
                           f"megatron-core {MEGATRON_CORE_VERSION} orders them so")
    policy = MegatronPolicy.from_hf(hf_model, device)
    log.info("trainer backend: Megatron-Core %s GPTModel, %s layer spec, tensor parallel %d, "
             "pipeline parallel %d", MEGATRON_CORE_VERSION, policy.layer_spec,
             sizes.tensor_parallel, sizes.pipeline_parallel)
    return policy
