"""The RLJob spec: one typed model for the cluster and the laptop.

In parts: `base` (API names, the base model, `rule_error`), `resources` (Kubernetes
quantities, resources, placement), `job` (the spec's sections), `status`, `manifest` (the
whole object and loading it from YAML). Import from `asyncrl.spec` itself.

Everything that decides what a valid job is lives here: field names (camelCase in YAML,
snake_case in Python), defaults, ranges, cross-field rules and their descriptions. The CRD's
OpenAPI schema (`asyncrl.spec.crd`), the local runner's config parsing, the operator's validation and
the error messages (`asyncrl.spec.errors`) are all derived from these models.

Python code reads the resolved job as attributes, e.g.::

    job = load_manifest("examples/arith.yaml")
    job.spec.algorithm.group_size, job.spec.rollout.max_new_tokens, job.spec.buffer.redis.url

Rules that involve more than one field raise `rule_error(...)`, which carries the field it is
about and a fix; `asyncrl.spec.errors` turns it into one readable line.
"""

from __future__ import annotations

from asyncrl.spec.base import (
    API_VERSION,
    BUILTIN_MODELS,
    GPU_RESOURCE,
    GROUP,
    KIND,
    MAX_NAME_LENGTH,
    NAME_PATTERN,
    PLURAL,
    RULE_ERROR,
    SINGULAR,
    SpecModel,
    VERSION,
    rule_error,
)
from asyncrl.spec.resources import (
    Placement,
    QUANTITY_PATTERN,
    Quantity,
    Resources,
    Toleration,
    parse_quantity,
)
from asyncrl.spec.job import (
    AlgorithmSpec,
    BufferSpec,
    CodeReward,
    DATASET_PRESETS,
    DatasetFields,
    DatasetSpec,
    HttpReward,
    PRESET_REWARD,
    PythonReward,
    KLSpec,
    MathReward,
    ModelSpec,
    RLJobSpec,
    RedisSpec,
    RewardSpec,
    RolloutSpec,
    AutoscaleSpec,
    SecretKeyRef,
    TinyModel,
    TrainerSpec,
    TrackingSpec,
)
from asyncrl.spec.status import (
    Condition,
    RLJobStatus,
)
from asyncrl.spec.manifest import (
    ManifestError,
    ObjectMeta,
    RLJob,
    load_manifest,
    parse_manifest,
    parse_spec,
    read_manifest,
)

__all__ = [
    "API_VERSION",
    "BUILTIN_MODELS",
    "GPU_RESOURCE",
    "GROUP",
    "KIND",
    "MAX_NAME_LENGTH",
    "NAME_PATTERN",
    "PLURAL",
    "RULE_ERROR",
    "SINGULAR",
    "SpecModel",
    "VERSION",
    "rule_error",
    "Placement",
    "QUANTITY_PATTERN",
    "Quantity",
    "Resources",
    "Toleration",
    "parse_quantity",
    "AlgorithmSpec",
    "BufferSpec",
    "CodeReward",
    "DATASET_PRESETS",
    "DatasetFields",
    "DatasetSpec",
    "HttpReward",
    "PRESET_REWARD",
    "PythonReward",
    "KLSpec",
    "MathReward",
    "ModelSpec",
    "RLJobSpec",
    "RedisSpec",
    "RewardSpec",
    "RolloutSpec",
    "AutoscaleSpec",
    "SecretKeyRef",
    "TinyModel",
    "TrainerSpec",
    "TrackingSpec",
    "Condition",
    "RLJobStatus",
    "ManifestError",
    "ObjectMeta",
    "RLJob",
    "load_manifest",
    "parse_manifest",
    "parse_spec",
    "read_manifest",
]
