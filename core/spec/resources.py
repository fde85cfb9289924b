"""Kubernetes quantities, per-pod resources and placement (node selectors, tolerations, GPUs)
of a job's components."""

from __future__ import annotations

from decimal import Decimal
import re
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, PlainValidator, WithJsonSchema, model_validator

from asyncrl.spec.base import GPU_RESOURCE, SpecModel, rule_error

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
