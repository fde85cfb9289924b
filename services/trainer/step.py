"""One policy update: proximal log-probs (the training forward's own, or approximated with
`loglinear`), decoupled PPO over token-balanced micro-batches, gradients summed across
data-parallel ranks, one optimizer step.

Precision: the model's parameters (the master weights) and the optimizer state stay float32;
with bfloat16 (`trainer.computeDtype`, else `model.dtype`) the forward passes run under bf16
autocast (on CPU and GPU), so matmuls are bf16 while updates are never rounded to bf16 (a 5e-6
learning rate would vanish in a bf16 weight). The published snapshot is cast to `model.dtype`.

The trainer service wraps this in its GetBatch -> update -> Ack -> publish loop; this module
knows nothing about the buffer, Redis or gRPC.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from asyncrl.algorithms.packing import (
    PackedBatch, balance_sharing_prefixes, pack_sharing_prefixes,
)
from asyncrl.algorithms.ppo import (
    PROXIMAL_MODES,
    decoupled_ppo_loss,
    kl_penalty,
    loglinear_proximal_logprobs,
)
from asyncrl.platform.devices import AUTOCAST_DEVICES, auto_compute_dtype, native_bf16
from asyncrl.model.policy import RECOMPUTED_HEADS, load_policy, packed_token_logprobs
from asyncrl.model.packed_attention import use_packed_attention
from asyncrl.model.recompute import checkpoint_decoder_layers

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainSample:
    """One prompt + response, token-aligned.

    `loss_mask` is True on generated tokens; `behaviour_logprobs` holds the rollout engine's
    log-probability of each generated token (0 elsewhere); `advantage` is the sequence's
    advantage, applied to each of its generated tokens; `version` is the policy version that
    generated every one of its tokens (None when several did, or it is not known);
    `token_versions` holds the version of each token (token-aligned, read only where
    `loss_mask` is set; None: every generated token has `version`).
    """

    input_ids: Tensor
    loss_mask: Tensor
    behaviour_logprobs: Tensor
    advantage: float
    version: int | None = None
    token_versions: Tensor | None = None


@dataclass(frozen=True)
class UpdateConfig:
    """The algorithm settings one update needs (from the RLJob's algorithm/trainer sections)."""

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    dual_clip: float | None = None
    behaviour_weight_cap: float | None = 5.0
    behaviour_cap_mode: str = "mask"
    decoupled: bool = True
    proximal: str = "recompute"  # loglinear: approximated, no proximal forward pass
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    max_grad_norm: float = 1.0
    temperature: float = 1.0
    micro_batch_max_tokens: int = 4096
    compute_dtype: str = "float32"  # bfloat16: forward passes under bf16 autocast; auto
    activation_checkpointing: bool = False  # recompute the decoder layers in backward
    # The log-probs' logits a block of positions at a time, recomputed in backward, where the
    # model allows it (see PolicyUpdater); False: each micro-batch's logits whole, kept for
    # backward (the same update; for comparing the two, as bench/trainer_step.py does).
    logits_in_blocks: bool = True

    @classmethod
    def from_spec(cls, spec) -> "UpdateConfig":
        algorithm = spec.algorithm
        return cls(
            clip_eps=algorithm.clip_eps,
            clip_eps_high=algorithm.clip_eps_high,
            dual_clip=algorithm.dual_clip,
            behaviour_weight_cap=algorithm.behaviour_weight_cap,
            behaviour_cap_mode=algorithm.behaviour_cap_mode,
            decoupled=algorithm.decoupled,
            proximal=algorithm.proximal,
            kl_coef=algorithm.kl.coef,
            kl_estimator=algorithm.kl.estimator,
            max_grad_norm=algorithm.max_grad_norm,
            temperature=spec.rollout.temperature,
            micro_batch_max_tokens=spec.trainer.micro_batch_max_tokens,
            compute_dtype=spec.trainer_compute_dtype,
            activation_checkpointing=spec.trainer.activation_checkpointing,
        )


_COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

_TOKEN_MEAN_STATS = (
    "clip_fraction", "approx_kl", "behaviour_weight_mean", "behaviour_capped_fraction",
)


class PolicyUpdater:
    """Applies decoupled-PPO updates to a model; data parallel when torch.distributed is up.

    Each rank passes its own share of the global batch (possibly none). The loss is a token
    mean over the whole global batch, so per-rank gradients are summed (not averaged) before
    the step; this makes N ranks give the same update as one rank with all the samples.

    A model sharded with FSDP2 (`fully_shard`, see asyncrl.trainer.distributed) reduces its
    own gradients during backward, averaging them, so the loss it back-propagates is scaled
    by the world size; every forward pass is then a collective, so all ranks run the same
    number of micro-batches (a rank short of work runs empty ones).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        config: UpdateConfig,
        reference_model: torch.nn.Module | None = None,
    ):
        if config.kl_coef > 0 and reference_model is None:
            raise ValueError("algorithm.kl.coef > 0 needs a reference model")
        if config.compute_dtype not in (*_COMPUTE_DTYPES, "auto"):
            raise ValueError(f"compute_dtype must be auto or one of {sorted(_COMPUTE_DTYPES)}, "
                             f"got {config.compute_dtype!r}")
        if config.proximal not in PROXIMAL_MODES:
            raise ValueError(f"proximal must be one of {PROXIMAL_MODES}, got {config.proximal!r}")
        # A transformers model computes a group's prompt once for all of its responses (the
        # micro-batches are packed sharing prefixes); another backend's model, each time.
        self._share_prompts = not any(hasattr(policy, "packed_token_logprobs")
                                      for policy in filter(None, (model, reference_model)))
        for policy in filter(None, (model, reference_model)):
            if not hasattr(policy, "packed_token_logprobs"):
                # A transformers model: packed micro-batches attend within each sequence only
                # (same results as the block-diagonal mask, a fraction of its work).
                use_packed_attention(policy)
        if config.activation_checkpointing:
            if hasattr(model, "packed_token_logprobs"):
                raise ValueError("activation checkpointing is implemented for transformers "
                                 "models (the pytorch backend) only")
            checkpoint_decoder_layers(model)  # the reference model runs without gradients
        # Logits in blocks, recomputed in backward (never the whole [tokens x vocabulary]),
        # where the model's logits are its head's output and the head can be called outside
        # the model's forward: not under FSDP, whose root unshards the head's weights only
        # within that forward.
        self._recompute_logits = (config.logits_in_blocks
                                  and not hasattr(model, "packed_token_logprobs")
                                  and model.config.model_type in RECOMPUTED_HEADS
                                  and not isinstance(model, FSDPModule))
        if (config.logits_in_blocks and not self._recompute_logits
                and not hasattr(model, "packed_token_logprobs")):
            log.info("the logits of each micro-batch are kept whole for backward (made a "
                     "block at a time for unsharded %s models)", ", ".join(RECOMPUTED_HEADS))
        self.model = model
        self.device = next(model.parameters()).device
        if config.compute_dtype == "auto":
            # A backend whose layers autocast on some devices only (Megatron-Core's: CUDA)
            # says which.
            resolved = auto_compute_dtype(
                self.device, getattr(model, "autocast_devices", AUTOCAST_DEVICES))
            log.info("the trainer computes in %s (trainer.computeDtype auto, on %s)",
                     resolved, self.device)
            config = dataclasses.replace(config, compute_dtype=resolved)
        elif config.compute_dtype == "bfloat16" and not native_bf16(self.device):
            log.warning("the trainer computes in bfloat16, which this %s emulates: slower than "
                        "float32 here (set trainer.computeDtype: auto or float32)",
                        self.device.type)
        # The ranks whose samples make up the global batch (None: all of them); a backend
        # that splits layers across ranks (Megatron's tensor parallel) names its own.
        self.data_group = getattr(model, "data_parallel_group", None)
        self.sharded = isinstance(model, FSDPModule)
        self._gradient_scale = dist.get_world_size() if self.sharded else 1
        self.optimizer = optimizer
        self.config = config
        self.reference_model = reference_model

    @classmethod
    def from_spec(cls, spec, model: torch.nn.Module,
                  reference_model: torch.nn.Module | None = None) -> PolicyUpdater:
        """The job's optimizer (AdamW over `model`, already sharded if it is to be) and
        update rule; what the trainer service and train-demo both train with."""
        optimizer = torch.optim.AdamW(model.parameters(), lr=spec.algorithm.learning_rate,
                                      weight_decay=spec.algorithm.weight_decay,
                                      **fused_adamw(model))
        return cls(model, optimizer, UpdateConfig.from_spec(spec), reference_model)

    def step(self, samples: Sequence[TrainSample], version: int | None = None) -> dict[str, float]:
        """One update with this rank's `samples`; `version` is the policy version of the
        weights the model holds now (None: unknown)."""
        started = time.perf_counter()
        loglinear = self.config.decoupled and self.config.proximal == "loglinear"
        if loglinear and (version is None or any(
                s.version is None and s.token_versions is None for s in samples)):
            raise ValueError("proximal loglinear needs the version of the weights being updated "
                             "and of every sample's tokens")
        prompt_lengths = [_prompt_length(s) if self._share_prompts else 0 for s in samples]
        groups = balance_sharing_prefixes(
            [s.input_ids for s in samples], prompt_lengths, self.config.micro_batch_max_tokens)
        micro_batches = [_to_device(_pack([samples[i] for i in indices],
                                          [prompt_lengths[i] for i in indices]), self.device)
                         for indices in groups]
        if self.sharded:
            # Every forward is a collective under FSDP: pad to the most micro-batches any
            # rank has with empty ones (one token, no loss).
            most = _all_reduce(torch.tensor(len(micro_batches), device=self.device),
                               dist.ReduceOp.MAX, self.data_group)
            micro_batches += [_empty_micro_batch(self.device)] * (int(most) - len(micro_batches))
        local_tokens = sum(int(s.loss_mask.sum()) for s in samples)
        global_tokens = _all_reduce_sum(
            torch.tensor(float(local_tokens), device=self.device), self.data_group)

        # The model runs without dropout (eval mode) throughout: the proximal policy of the
        # decoupled objective is the weights before this update, and with one optimizer step
        # per batch those are the weights of the training forward. Its log-probs, detached,
        # are the proximal ones exactly, so no micro-batch needs a forward pass of its own.
        self.model.eval()
        reference = None
        if self.config.kl_coef > 0:
            with torch.no_grad(), self._autocast():
                reference = [self._logprobs(self.reference_model, mb) for mb in micro_batches]

        self.optimizer.zero_grad(set_to_none=True)
        # Token-weighted sums of the per-micro-batch stats, normalised once at the end.
        # The same keys on every rank (one with no samples too): they are all-reduced together.
        # Summed on the device in float64: reading them each micro-batch would make the host
        # wait for the GPU's backward before queueing the next forward.
        names = sorted(("loss", *_TOKEN_MEAN_STATS, *(("kl",) if reference is not None else ())))
        sums = torch.zeros(len(names), dtype=torch.float64, device=self.device)
        for index, mb in enumerate(micro_batches):
            with self._autocast():
                logprobs = self._logprobs(self.model, mb)
            mask = mb.fields["loss_mask"]
            if not self.config.decoupled:
                proximal = mb.fields["behaviour_logprobs"]  # standard PPO: not used
            elif loglinear:
                # The current version is the proximal one (see above): exact for every token
                # older than it, and tokens it generated keep their behaviour log-probs.
                proximal = loglinear_proximal_logprobs(
                    mb.fields["behaviour_logprobs"], logprobs, mb.fields["token_versions"],
                    proximal_version=version, current_version=version)
            else:
                proximal = logprobs.detach()
            loss, stats = decoupled_ppo_loss(
                logprobs,
                proximal,
                mb.fields["behaviour_logprobs"],
                mb.fields["advantages"],
                mask,
                clip_eps=self.config.clip_eps,
                clip_eps_high=self.config.clip_eps_high,
                dual_clip=self.config.dual_clip,
                behaviour_weight_cap=self.config.behaviour_weight_cap,
                behaviour_cap_mode=self.config.behaviour_cap_mode,
                decoupled=self.config.decoupled,
                num_global_tokens=global_tokens,
            )
            values = {name: stats[name].double() * stats["num_tokens"].double()
                      for name in _TOKEN_MEAN_STATS}
            if reference is not None:
                kl = (kl_penalty(logprobs, reference[index], self.config.kl_estimator) * mask).sum()
                loss = loss + self.config.kl_coef * kl / global_tokens
                values["kl"] = kl.detach()
            # FSDP averages the gradients across ranks: scaled, the average is the sum.
            (loss * self._gradient_scale).backward()
            values["loss"] = loss.detach()  # already divided by the global token count
            sums += torch.stack([values[name].double() for name in names])

        if not self.sharded:  # FSDP reduced them (summed, see distributed.shard_model)
            _all_reduce_gradients(self.model, self.data_group)
        # A model split across ranks knows how to take its whole norm.
        clip = getattr(self.model, "clip_grad_norm_", None) or functools.partial(
            torch.nn.utils.clip_grad_norm_, self.model.parameters())
        grad_norm = clip(self.config.max_grad_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        self.optimizer.step()

        # Sum across ranks so every rank reports the figures of the global batch.
        summed = _all_reduce_sum(sums, self.data_group).tolist()
        tokens = float(global_tokens)
        result = {
            name: value if name == "loss" else value / max(tokens, 1.0)
            for name, value in zip(names, summed)
        }
        result.update(
            trained_tokens=tokens,
            micro_batches=float(len(micro_batches)),  # on this rank
            grad_norm=float(grad_norm),
            step_seconds=time.perf_counter() - started,
        )
        return result

    def _autocast(self):
        dtype = _COMPUTE_DTYPES[self.config.compute_dtype]
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def _logprobs(self, model: torch.nn.Module, mb: PackedBatch) -> Tensor:
        """Per-token log-probs of a micro-batch: a transformers model's through
        asyncrl.model.policy, another backend's model (the Megatron-Core one) through its own
        `packed_token_logprobs`, which computes the same thing."""
        # In blocks without gradients too (the reference model's pass): a micro-batch's
        # whole logits would be the largest tensor of the step even when not kept.
        compute = getattr(model, "packed_token_logprobs", None) or functools.partial(
            packed_token_logprobs, model, recompute_logits=self._recompute_logits)
        shared = {} if mb.continues is None else {"continues": mb.continues}
        return compute(mb.input_ids, mb.position_ids, mb.cu_seqlens, self.config.temperature,
                       needed=mb.fields["loss_mask"], **shared)


def fused_adamw(model: torch.nn.Module) -> dict[str, bool]:
    """AdamW's keyword for its fused CUDA kernel (one launch for every parameter's update,
    instead of several per parameter) where every parameter is a plain CUDA tensor; {} (the
    default implementation) elsewhere: on the CPU, and for sharded (DTensor) parameters."""
    parameters = list(model.parameters())
    plain_cuda = bool(parameters) and all(
        p.device.type == "cuda" and not isinstance(p, DTensor) for p in parameters)
    return {"fused": True} if plain_cuda else {}


def _prompt_length(sample: TrainSample) -> int:
    """The tokens before the first generated one: what the responses to one prompt share."""
    generated = sample.loss_mask.nonzero()
    return int(generated[0]) if len(generated) else 0


def _pack(samples: Sequence[TrainSample], prompt_lengths: Sequence[int] | None = None
          ) -> PackedBatch:
    """`samples` in one row, those with the same prompt (`prompt_lengths` tokens) holding one
    copy of it (None: no sharing)."""
    return pack_sharing_prefixes(
        [s.input_ids for s in samples],
        prompt_lengths or [0] * len(samples),
        fields={
            "loss_mask": [s.loss_mask.bool() for s in samples],
            "behaviour_logprobs": [s.behaviour_logprobs.float() for s in samples],
            "advantages": [
                torch.full(s.input_ids.shape, float(s.advantage)) for s in samples
            ],
            # -1: not known (the empty micro-batch of FSDP padding has no version).
            "token_versions": [
                torch.full(s.input_ids.shape, -1 if s.version is None else s.version)
                if s.token_versions is None else s.token_versions.long()
                for s in samples
            ],
        },
    )


def _to_device(mb: PackedBatch, device: torch.device) -> PackedBatch:
    return dataclasses.replace(
        mb, input_ids=mb.input_ids.to(device), position_ids=mb.position_ids.to(device),
        cu_seqlens=mb.cu_seqlens.to(device),
        fields={name: value.to(device) for name, value in mb.fields.items()},
        continues=None if mb.continues is None else mb.continues.to(device),
    )


def _empty_micro_batch(device: torch.device) -> PackedBatch:
    """Two tokens with no loss: a forward and backward that add nothing to the gradients."""
    return _to_device(_pack([TrainSample(torch.zeros(2, dtype=torch.long),
                                         torch.zeros(2, dtype=torch.bool), torch.zeros(2), 0.0)]),
                      device)


def _distributed(group=None) -> bool:
    return (dist.is_available() and dist.is_initialized()
            and dist.get_world_size(group) > 1)


def _all_reduce(tensor: Tensor, op, group=None) -> Tensor:
    """All-reduce over `group` (None: every rank)."""
    if _distributed(group):
        dist.all_reduce(tensor, op=op, group=group)
    return tensor


def _all_reduce_sum(tensor: Tensor, group=None) -> Tensor:
    return _all_reduce(tensor, dist.ReduceOp.SUM, group)


def _all_reduce_gradients(model: torch.nn.Module, group=None) -> None:
    if not _distributed(group):
        return
    for param in model.parameters():
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)


def reference_policy(spec, device: torch.device | str = "cpu") -> torch.nn.Module | None:
    """The frozen reference model of the KL penalty (float32, like the trained weights), or
    None when algorithm.kl.coef is 0."""
    if spec.algorithm.kl.coef <= 0:
        return None
    reference, _ = load_policy(spec.model, dtype="float32", device=device)
    return reference.eval().requires_grad_(False)
