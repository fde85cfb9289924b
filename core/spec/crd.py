"""The RLJob CustomResourceDefinition, generated from the pydantic models in `asyncrl.spec`.

`build_crd()` turns pydantic's JSON Schema (draft 2020-12) into a Kubernetes *structural*
OpenAPI v3 schema: every node has a type, `$ref`s are inlined, `Optional[X]` becomes X with
`nullable: true`, quantities become `x-kubernetes-int-or-string`, numeric exclusive bounds take
the OpenAPI 3.0 boolean form, and keywords Kubernetes rejects are dropped.
"""

from __future__ import annotations

import copy
from typing import Any

from asyncrl import spec

# Keywords a structural schema node may carry (everything else pydantic emits is dropped).
_KEEP = {
    "type", "description", "default", "nullable", "format", "enum", "pattern",
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf",
    "minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
    "required", "properties", "additionalProperties", "items", "not",
}

# Key order in the generated YAML, for readers of `kubectl get crd -o yaml`.
_ORDER = {key: i for i, key in enumerate([
    "type", "x-kubernetes-int-or-string", "description", "nullable", "default", "enum", "format",
    "pattern", "minLength", "maxLength", "minimum", "exclusiveMinimum", "maximum",
    "exclusiveMaximum", "multipleOf", "not", "minItems", "maxItems", "required", "properties",
    "additionalProperties", "items",
])}

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Version", "type": "integer", "jsonPath": ".status.policyVersion",
     "description": "Policy version the trainer has published."},
    {"name": "Step", "type": "integer", "jsonPath": ".status.trainerStep"},
    {"name": "Tokens/s", "type": "number", "jsonPath": ".status.tokensPerSecond"},
    {"name": "Staleness", "type": "number", "jsonPath": ".status.stalenessMean"},
    {"name": "Reward", "type": "number", "jsonPath": ".status.rewardMean"},
    {"name": "Eval", "type": "number", "jsonPath": ".status.evalAccuracy"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


#: `kubectl scale rljob/NAME --replicas=N` scales the rollout workers live.
SCALE: dict[str, str] = {
    "specReplicasPath": ".spec.rollout.replicas",
    "statusReplicasPath": ".status.rolloutReplicas",
}


class SchemaError(ValueError):
    """A model uses a type that has no structural OpenAPI form."""


def structural_schema(json_schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON Schema (with `$defs`) as a structural OpenAPI v3 schema."""
    defs = json_schema.get("$defs", {})
    root = {k: v for k, v in json_schema.items() if k != "$defs"}
    return _convert(root, defs, path="")


def _convert(node: dict[str, Any], defs: dict[str, Any], path: str) -> dict[str, Any]:
    node = _inline(node, defs)

    if "anyOf" in node or "oneOf" in node:
        node = _collapse_union(node, defs, path)

    if node.get("x-kubernetes-int-or-string"):
        node.pop("type", None)

    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "const":
            out["enum"] = [value]
        elif key in ("exclusiveMinimum", "exclusiveMaximum") and not isinstance(value, bool):
            out["minimum" if key == "exclusiveMinimum" else "maximum"] = value
            out[key] = True
        elif key == "properties":
            out[key] = {
                name: _convert(sub, defs, f"{path}.{name}") for name, sub in value.items()
            }
        elif key == "additionalProperties":
            if isinstance(value, dict):
                out[key] = _convert(value, defs, f"{path}[*]")
            elif value is True:
                out["x-kubernetes-preserve-unknown-fields"] = True
            # False (extra="forbid") is the structural default: unknown fields are rejected.
        elif key == "items":
            out[key] = _convert(value, defs, f"{path}[]")
        elif key == "default" and value is None:
            continue  # absent and null mean the same; Kubernetes would not default to null
        elif key in _KEEP or key.startswith("x-kubernetes-"):
            out[key] = copy.deepcopy(value)

    if "enum" in out and "type" not in out and not out.get("x-kubernetes-int-or-string"):
        out["type"] = _json_type(out["enum"][0])
    if "properties" in out:
        out.setdefault("type", "object")
    if "type" not in out and not out.get("x-kubernetes-int-or-string"):
        raise SchemaError(f"{path or '<root>'}: no structural type for {node!r}")
    return dict(sorted(out.items(), key=lambda item: _ORDER.get(item[0], len(_ORDER))))


def _inline(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """Resolve `$ref` (and pydantic's single-member allOf wrapper); siblings win."""
    node = dict(node)
    if "allOf" in node and len(node["allOf"]) == 1:
        node = {**node.pop("allOf")[0], **node}
    ref = node.pop("$ref", None)
    if ref is not None:
        target = defs[ref.rsplit("/", 1)[-1]]
        node = {**_inline(target, defs), **node}
    return node


def _collapse_union(node: dict[str, Any], defs: dict[str, Any], path: str) -> dict[str, Any]:
    members = [_inline(m, defs) for m in node.pop("anyOf", None) or node.pop("oneOf")]
    nullable = any(m.get("type") == "null" for m in members)
    members = [m for m in members if m.get("type") != "null"]
    types = {m.get("type") for m in members}
    if len(members) == 1:
        merged = {**members[0], **node}
    elif types == {"integer", "string"}:
        merged = {**node, "x-kubernetes-int-or-string": True}
    else:
        kinds = sorted(map(str, types))
        raise SchemaError(f"{path or '<root>'}: a union of {kinds} is not structural")
    if nullable:
        merged["nullable"] = True
    return merged


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    return "string"


def openapi_schema() -> dict[str, Any]:
    """The openAPIV3Schema of an RLJob object."""
    spec_schema = structural_schema(spec.RLJobSpec.model_json_schema(by_alias=True))
    status_schema = structural_schema(spec.RLJobStatus.model_json_schema(by_alias=True))
    # kopf (and other tools) may keep their own bookkeeping under status.
    status_schema["x-kubernetes-preserve-unknown-fields"] = True
    name = spec.ObjectMeta.model_fields["name"]
    return {
        "type": "object",
        "description": spec.RLJob.__doc__,
        "properties": {
            "apiVersion": {"type": "string", "description": "Always asyncrl.io/v1alpha1."},
            "kind": {"type": "string", "description": "Always RLJob."},
            # Kubernetes validates metadata itself; a CRD may only restrict name.
            "metadata": {
                "type": "object",
                "properties": {
                    "name": {
                        "type": "string",
                        "description": name.description,
                        "pattern": spec.NAME_PATTERN,
                        "maxLength": spec.MAX_NAME_LENGTH,
                    }
                },
            },
            "spec": spec_schema,
            "status": status_schema,
        },
    }


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition (apiextensions.k8s.io/v1) for RLJob."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": f"{spec.PLURAL}.{spec.GROUP}",
            "labels": {"app.kubernetes.io/name": "asyncrl", "app.kubernetes.io/part-of": "asyncrl"},
        },
        "spec": {
            "group": spec.GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": spec.KIND,
                "listKind": f"{spec.KIND}List",
                "plural": spec.PLURAL,
                "singular": spec.SINGULAR,
                "shortNames": ["rlj"],
                "categories": ["asyncrl"],
            },
            "versions": [
                {
                    "name": spec.VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                    "subresources": {"status": {}, "scale": copy.deepcopy(SCALE)},
                    "additionalPrinterColumns": copy.deepcopy(PRINTER_COLUMNS),
                }
            ],
        },
    }
