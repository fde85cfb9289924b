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
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from asyncrl.algorithms.packing import (
    PackedBatch, balance_sharing_prefixes, pack_sharing_prefixes,
)
from asyncrl.algorithms.correction import RolloutCorrection
from asyncrl.algorithms.mismatch import MISMATCH_SUMS, mismatch_sums, mismatch_summary
from asyncrl.algorithms.schedule import learning_rate_factor
from asyncrl.algorithms.ppo import (
    PROXIMAL_MODES,
    decoupled_ppo_loss,
    kl_penalty,
    loglinear_proximal_logprobs,
)
from asyncrl.platform.devices import AUTOCAST_DEVICES, auto_compute_dtype, fast_bf16
from asyncrl.model.lora import adapter_dropout
from asyncrl.model.policy import RECOMPUTED_HEADS, load_policy, packed_token_logprobs
from asyncrl.model.packed_attention import use_packed_attention
from asyncrl.model.recompute import checkpoint_decoder_layers
from asyncrl.trainer.compute_weights import ComputeWeights

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
    # Parameters in the compute dtype for the passes, float32 masters for the optimizer
    # (asyncrl.trainer.compute_weights). None: on a GPU where the compute dtype is bf16 and
    # every parameter trains in this process (not FSDP, another backend, or a LoRA adapter).
    compute_weights: bool | None = None
    activation_checkpointing: bool = False  # recompute the decoder layers in backward
    # The log-probs' logits a block of positions at a time, recomputed in backward, where the
    # model allows it (see PolicyUpdater); False: each micro-batch's logits whole, kept for
    # backward (the same update; for comparing the two, as bench/trainer_step.py does).
    logits_in_blocks: bool = True
    ppo_minibatches: int = 1  # optimizer steps per batch, over its samples split in order
    ppo_epochs: int = 1  # passes over the minibatches
    correction: RolloutCorrection = RolloutCorrection()
    # The schedule's base rate (None: the optimizer's own rate, never changed) and its shape.
    learning_rate: float | None = None
    warmup_steps: int = 0
    lr_decay: str = "constant"
    lr_final_fraction: float = 0.1
    max_steps: int = 1

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
            ppo_minibatches=algorithm.ppo_minibatches,
            ppo_epochs=algorithm.ppo_epochs,
            correction=RolloutCorrection(
                level=algorithm.rollout_correction.level,
                truncate=algorithm.rollout_correction.truncate,
                mask_low=algorithm.rollout_correction.mask_low,
                mask_high=algorithm.rollout_correction.mask_high),
            learning_rate=algorithm.learning_rate,
            warmup_steps=algorithm.learning_rate_schedule.warmup_steps,
            lr_decay=algorithm.learning_rate_schedule.decay,
            lr_final_fraction=algorithm.learning_rate_schedule.final_fraction,
            max_steps=algorithm.max_steps,
        )


_COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

_TOKEN_MEAN_STATS = (
    "clip_fraction", "approx_kl", "behaviour_weight_mean", "behaviour_capped_fraction",
    "correction_truncated_fraction", "correction_masked_fraction",
)


@dataclass(frozen=True)
class _Minibatch:
    """The micro-batches of one optimizer step, and the global batch's count of its loss
    tokens (the denominator of its token mean)."""

    micro_batches: list[PackedBatch]
    global_tokens: Tensor


class _Diagnostics:
    """What the weights before an update say about its batch, summed over micro-batches on
    the device and read once: the policy's entropy over the loss tokens, and the
    engine/trainer mismatch over the tokens of the version those weights are
    (asyncrl.algorithms.mismatch)."""

    def __init__(self, device: torch.device, version: int | None, group=None):
        self.version, self.group = version, group
        self.entropy = torch.zeros(2, dtype=torch.float64, device=device)  # sum, tokens
        self.entropy_measured = False
        self.mismatch = torch.zeros(len(MISMATCH_SUMS), dtype=torch.float64, device=device)
        self._largest = MISMATCH_SUMS.index("abs_diff_max")

    def add(self, mb: PackedBatch, logprobs: Tensor, entropy: Tensor | None) -> None:
        mask = mb.fields["loss_mask"]
        if entropy is not None:
            self.entropy_measured = True
            self.entropy += torch.stack([(entropy.double() * mask).sum(), mask.sum().double()])
        if self.version is None:
            return
        current = mask & (mb.fields["token_versions"] == self.version)
        sums = mismatch_sums(logprobs, mb.fields["behaviour_logprobs"], current)
        largest = torch.maximum(self.mismatch[self._largest], sums[self._largest])
        self.mismatch += sums
        self.mismatch[self._largest] = largest

    def summary(self) -> dict:
        """Every rank's sums together: the record's entropy and mismatch figures."""
        entropy = _all_reduce_sum(self.entropy, self.group).tolist()
        largest = _all_reduce(self.mismatch[self._largest].clone(), dist.ReduceOp.MAX,
                              self.group)
        mismatch = _all_reduce_sum(self.mismatch, self.group)
        mismatch[self._largest] = largest
        result = mismatch_summary(mismatch.tolist())
        if self.entropy_measured:
            result["entropy"] = entropy[0] / max(entropy[1], 1.0)
        return result


def split_in_order(samples: Sequence[TrainSample], parts: int) -> list[list[TrainSample]]:
    """`samples` in `parts` consecutive runs of sizes differing by at most one (the first
    ones larger); the responses to one prompt are consecutive, so they mostly stay together."""
    size, extra = divmod(len(samples), parts)
    runs, start = [], 0
    for index in range(parts):
        end = start + size + (index < extra)
        runs.append(list(samples[start:end]))
        start = end
    return runs


def _compute_weights(model: torch.nn.Module, config: UpdateConfig,
                     device: torch.device) -> ComputeWeights | None:
    """Compute-dtype copies of `model`'s parameters for the passes (config.compute_weights,
    its compute dtype resolved), or None: autocast casts the float32 weights in each pass.
    By default on a GPU only: a CPU's rollout engine computes in float32, and bf16 weights
    would widen the engine/trainer mismatch there."""
    dtype = _COMPUTE_DTYPES[config.compute_dtype]
    wanted = config.compute_weights
    if wanted is None:
        wanted = (dtype != torch.float32 and device.type == "cuda"
                  and not hasattr(model, "packed_token_logprobs")  # another backend's model
                  and not isinstance(model, FSDPModule)
                  and all(p.requires_grad for p in model.parameters()))  # not an adapter
    return ComputeWeights(model, dtype) if wanted else None


def _split_entropy(output) -> tuple[Tensor, Tensor | None]:
    return output if isinstance(output, tuple) else (output, None)


def _sequence_ids(mb: PackedBatch) -> Tensor:
    """The sequence each position of a packed row belongs to."""
    bounds = mb.cu_seqlens.long()
    # output_size: no read-back of the total on a GPU.
    return torch.repeat_interleave(torch.arange(len(bounds) - 1, device=bounds.device),
                                   bounds[1:] - bounds[:-1], output_size=mb.input_ids.numel())


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
        reference_off: Callable[[], contextlib.AbstractContextManager] | None = None,
        before_pass: Callable[[], None] | None = None,
    ):
        """`reference_off`: a context in which `model` computes the reference policy (a LoRA
        model's adapter off: peft's `disable_adapter`), instead of a `reference_model`.
        `before_pass` runs before each forward, backward and optimizer step (the trainer fits
        its thread count to the cores lent to it there: asyncrl.platform.core_lending)."""
        self._before_pass = before_pass or (lambda: None)
        if before_pass is not None:
            _before_each_layer(model, before_pass)
        if reference_off is not None:
            reference_model = model
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
        elif config.compute_dtype == "bfloat16" and not fast_bf16(self.device):
            log.warning("the trainer computes in bfloat16, which this %s computes more slowly "
                        "than float32 (set trainer.computeDtype: auto or float32)",
                        self.device.type)
        self._compute_weights = _compute_weights(model, config, self.device)
        # The ranks whose samples make up the global batch (None: all of them); a backend
        # that splits layers across ranks (Megatron's tensor parallel) names its own.
        self.data_group = getattr(model, "data_parallel_group", None)
        self.sharded = isinstance(model, FSDPModule)
        self._gradient_scale = dist.get_world_size() if self.sharded else 1
        self.optimizer = optimizer
        self.config = config
        self.reference_model = reference_model
        self._reference_off = reference_off or contextlib.nullcontext
        # The entropy comes with the log-probs of a transformers model (not another backend's).
        self._entropy = not hasattr(model, "packed_token_logprobs")

    @classmethod
    def from_spec(cls, spec, model: torch.nn.Module,
                  reference_model: torch.nn.Module | None = None,
                  reference_off: Callable[[], contextlib.AbstractContextManager] | None = None,
                  before_pass: Callable[[], None] | None = None) -> PolicyUpdater:
        """The job's optimizer (AdamW over the trainable parameters of `model`, already
        sharded if it is to be: a LoRA model's adapter) and update rule; what the trainer
        service and train-demo both train with."""
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                      lr=spec.algorithm.learning_rate,
                                      weight_decay=spec.algorithm.weight_decay,
                                      **fused_adamw(model))
        return cls(model, optimizer, UpdateConfig.from_spec(spec), reference_model,
                   reference_off, before_pass)

    def step(self, samples: Sequence[TrainSample], version: int | None = None,
             step: int | None = None) -> dict[str, float]:
        """One update with this rank's `samples`; `version` is the policy version of the
        weights the model holds now (None: unknown), `step` the index of this training step
        in the job (0 first; None: the learning rate is left as it is)."""
        started = time.perf_counter()
        config = self.config
        loglinear = config.decoupled and config.proximal == "loglinear"
        passes = config.ppo_minibatches * config.ppo_epochs
        if loglinear and passes > 1:
            raise ValueError("proximal loglinear needs one optimizer step per batch "
                             "(ppo_minibatches and ppo_epochs 1)")
        if loglinear and (version is None or any(
                s.version is None and s.token_versions is None for s in samples)):
            raise ValueError("proximal loglinear needs the version of the weights being updated "
                             "and of every sample's tokens")
        learning_rate = self._set_learning_rate(step)
        minibatches = [self._minibatch(part) for part in split_in_order(samples,
                                                                       config.ppo_minibatches)]

        # The model runs without dropout (eval mode) throughout. The proximal policy of the
        # decoupled objective is the weights before this batch's first optimizer step. With one
        # step per batch those are the weights of the training forward, whose log-probs,
        # detached, are the proximal ones exactly, so no micro-batch needs a pass of its own;
        # with several steps the later minibatches need them from before the first, so one
        # pass without gradients computes them up front.
        self.model.eval()
        reference = None
        if config.kl_coef > 0:
            with torch.no_grad(), self._autocast(), self._reference_off():
                reference = [[self._logprobs(self.reference_model, mb)
                              for mb in part.micro_batches] for part in minibatches]
        diagnostics = _Diagnostics(self.device, version, self.data_group)
        proximal = None  # per minibatch, per micro-batch; None: the training forward's
        if passes > 1:
            proximal = []
            with torch.no_grad(), self._autocast(), self._computing():
                for part in minibatches:
                    proximal.append([])
                    for mb in part.micro_batches:
                        logprobs, entropy = _split_entropy(
                            self._logprobs(self.model, mb, entropy=self._entropy))
                        diagnostics.add(mb, logprobs, entropy)
                        proximal[-1].append(logprobs)

        steps = []
        for _ in range(config.ppo_epochs):
            for index, part in enumerate(minibatches):
                steps.append(self._optimizer_step(
                    part, version, loglinear,
                    None if proximal is None else proximal[index],
                    None if reference is None else reference[index],
                    None if proximal is not None or steps else diagnostics))

        # Each optimizer step's figures are token means over its minibatch; the step's are
        # token-weighted means over all of them (the loss: the mean of their losses).
        tokens = sum(part_tokens for part_tokens, _, _ in steps)
        names = steps[0][1].keys()
        result = {name: sum(stats[name] * t for t, stats, _ in steps) / max(tokens, 1.0)
                  for name in names if name != "loss"}
        result["loss"] = sum(stats["loss"] for _, stats, _ in steps) / len(steps)
        result.update(diagnostics.summary())
        result.update(
            trained_tokens=float(sum(float(part.global_tokens) for part in minibatches)),
            micro_batches=float(sum(len(part.micro_batches) for part in minibatches)),  # this rank
            optimizer_steps=float(len(steps)),
            clip_fraction_per_minibatch=[stats["clip_fraction"] for _, stats, _ in steps],
            grad_norm=sum(norm for _, _, norm in steps) / len(steps),
            step_seconds=time.perf_counter() - started,
        )
        if learning_rate is not None:
            result["learning_rate"] = learning_rate
        return result

    def _set_learning_rate(self, step: int | None) -> float | None:
        """The scheduled rate of training step `step`, set on every parameter group."""
        config = self.config
        if step is None or config.learning_rate is None:
            return None
        rate = config.learning_rate * learning_rate_factor(
            step, config.max_steps, warmup_steps=config.warmup_steps, decay=config.lr_decay,
            final_fraction=config.lr_final_fraction)
        for group in self.optimizer.param_groups:
            group["lr"] = rate
        return rate

    def _minibatch(self, samples: Sequence[TrainSample]) -> _Minibatch:
        """`samples` packed into micro-batches on the device, with the global batch's count of
        their loss tokens (the token mean's denominator)."""
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
        return _Minibatch(micro_batches, global_tokens)

    def _optimizer_step(self, part: _Minibatch, version: int | None, loglinear: bool,
                        proximal: list[Tensor] | None, reference: list[Tensor] | None,
                        diagnostics: _Diagnostics | None) -> tuple[float, dict, float]:
        """Forward and backward over one minibatch's micro-batches and one optimizer step.
        `proximal`: each micro-batch's proximal log-probs (None: the training forward's own);
        `diagnostics`: where this forward's entropy and mismatch go (None: measured already).
        Returns the minibatch's global token count, its token-mean stats and the grad norm."""
        config = self.config
        self.optimizer.zero_grad(set_to_none=True)
        global_tokens = part.global_tokens
        # Token-weighted sums of the per-micro-batch stats, normalised once at the end.
        # The same keys on every rank (one with no samples too): they are all-reduced together.
        # Summed on the device in float64: reading them each micro-batch would make the host
        # wait for the GPU's backward before queueing the next forward.
        names = sorted(("loss", *_TOKEN_MEAN_STATS, *(("kl",) if reference is not None else ())))
        sums = torch.zeros(len(names), dtype=torch.float64, device=self.device)
        # The gradients come out float32 where the passes compute with copies (ComputeWeights).
        with self._computing():
            for index, mb in enumerate(part.micro_batches):
                # The passes that take gradients are the only ones with the adapter's dropout
                # (model.lora.dropout; the model runs in eval mode, see step).
                with self._autocast(), adapter_dropout(self.model, True):
                    output = self._logprobs(self.model, mb,
                                            entropy=diagnostics is not None and self._entropy)
                logprobs, entropy = _split_entropy(output)
                if diagnostics is not None:
                    diagnostics.add(mb, logprobs, entropy)
                mask = mb.fields["loss_mask"]
                if not config.decoupled:
                    current = mb.fields["behaviour_logprobs"]  # standard PPO: not used
                elif loglinear:
                    # The current version is the proximal one (see step): exact for every token
                    # older than it, and tokens it generated keep their behaviour log-probs.
                    current = loglinear_proximal_logprobs(
                        mb.fields["behaviour_logprobs"], logprobs, mb.fields["token_versions"],
                        proximal_version=version, current_version=version)
                elif proximal is not None:
                    current = proximal[index]
                else:
                    current = logprobs.detach()
                loss, stats = decoupled_ppo_loss(
                    logprobs,
                    current,
                    mb.fields["behaviour_logprobs"],
                    mb.fields["advantages"],
                    mask,
                    clip_eps=config.clip_eps,
                    clip_eps_high=config.clip_eps_high,
                    dual_clip=config.dual_clip,
                    behaviour_weight_cap=config.behaviour_weight_cap,
                    behaviour_cap_mode=config.behaviour_cap_mode,
                    decoupled=config.decoupled,
                    num_global_tokens=global_tokens,
                    correction=config.correction,
                    sequence_ids=_sequence_ids(mb) if config.correction.per_sequence else None,
                    num_sequences=len(mb.cu_seqlens) - 1,
                )
                values = {name: stats[name].double() * stats["num_tokens"].double()
                          for name in _TOKEN_MEAN_STATS}
                if reference is not None:
                    kl = (kl_penalty(logprobs, reference[index], config.kl_estimator) * mask).sum()
                    loss = loss + config.kl_coef * kl / global_tokens
                    values["kl"] = kl.detach()
                # FSDP averages the gradients across ranks: scaled, the average is the sum.
                self._before_pass()
                (loss * self._gradient_scale).backward()
                values["loss"] = loss.detach()  # already divided by the global token count
                sums += torch.stack([values[name].double() for name in names])

        tokens = float(global_tokens)  # the same on every rank (all-reduced)
        if not self.sharded:  # FSDP reduced them (summed, see distributed.shard_model)
            _all_reduce_gradients(self.model, self.data_group)
        # A model split across ranks knows how to take its whole norm.
        clip = getattr(self.model, "clip_grad_norm_", None) or functools.partial(
            torch.nn.utils.clip_grad_norm_, self.model.parameters())
        grad_norm = clip(config.max_grad_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        if tokens > 0:
            # A minibatch with no tokens on any rank (more minibatches than a small batch's
            # samples) steps nothing: AdamW would move the weights on momentum alone.
            self._before_pass()
            self.optimizer.step()

        # Sum across ranks so every rank reports the figures of the global batch.
        summed = _all_reduce_sum(sums, self.data_group).tolist()
        stats = {name: value if name == "loss" else value / max(tokens, 1.0)
                 for name, value in zip(names, summed)}
        return tokens, stats, float(grad_norm)

    def _computing(self):
        """The passes' weights: the compute dtype's copies where kept (ComputeWeights)."""
        if self._compute_weights is None:
            return contextlib.nullcontext()
        return self._compute_weights.computing()

    def _autocast(self):
        dtype = _COMPUTE_DTYPES[self.config.compute_dtype]
        if dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=dtype)

    def _logprobs(self, model: torch.nn.Module, mb: PackedBatch, entropy: bool = False):
        """Per-token log-probs of a micro-batch: a transformers model's through
        asyncrl.model.policy, another backend's model (the Megatron-Core one) through its own
        `packed_token_logprobs`, which computes the same thing. `entropy` (a transformers
        model only): (log-probs, entropies)."""
        self._before_pass()
        # In blocks without gradients too (the reference model's pass): a micro-batch's
        # whole logits would be the largest tensor of the step even when not kept.
        compute = getattr(model, "packed_token_logprobs", None) or functools.partial(
            packed_token_logprobs, model, recompute_logits=self._recompute_logits,
            **({"entropy": True} if entropy else {}))
        shared = {} if mb.continues is None else {"continues": mb.continues}
        return compute(mb.input_ids, mb.position_ids, mb.cu_seqlens, self.config.temperature,
                       needed=mb.fields["loss_mask"], **shared)


def _before_each_layer(model: torch.nn.Module, hook: Callable[[], None]) -> None:
    """`hook` also before each decoder layer's forward and backward, where the model has
    them as `model.model.layers` (a transformers model): a pass is seconds long on a CPU, and
    cores lent for it must go back within a fraction of that once their owner needs them."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        return

    def before_backward(grad: Tensor) -> None:
        hook()

    def after_forward(module, args, output) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if isinstance(hidden, Tensor) and hidden.requires_grad:
            # Runs when the gradient reaches this layer's output, before its backward.
            hidden.register_hook(before_backward)

    for layer in layers:
        layer.register_forward_pre_hook(lambda module, args: hook())
        layer.register_forward_hook(after_forward)


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
        if not param.requires_grad:
            continue  # frozen (a LoRA model's base)
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=group)


def reference_policy(spec, device: torch.device | str = "cpu") -> torch.nn.Module | None:
    """The frozen reference model of the KL penalty (float32, like the trained weights), or
    None when algorithm.kl.coef is 0 or the model trains a LoRA adapter (whose reference is
    its own base, the adapter off)."""
    if spec.algorithm.kl.coef <= 0 or spec.model.lora is not None:
        return None
    reference, _ = load_policy(spec.model, dtype="float32", device=device)
    return reference.eval().requires_grad_(False)
