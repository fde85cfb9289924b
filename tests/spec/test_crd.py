"""The generated CRD: valid for Kubernetes, structural, and agreeing with the pydantic models."""

from __future__ import annotations

import copy
import re

import jsonschema
import kubernetes_validate
import pytest
from kubernetes_validate.utils import latest_version

from asyncrl import spec
from asyncrl.spec.crd import build_crd, structural_schema
from asyncrl.spec import read_manifest
from support import ROOT

EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


@pytest.fixture(scope="module")
def crd() -> dict:
    return build_crd()


@pytest.fixture(scope="module")
def schema(crd) -> dict:
    return crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def test_crd_is_a_valid_kubernetes_object(crd):
    kubernetes_validate.validate(crd, latest_version(), strict=True)


def test_names_scope_and_version(crd):
    assert crd["apiVersion"] == "apiextensions.k8s.io/v1"
    assert crd["metadata"]["name"] == "rljobs.asyncrl.io"
    body = crd["spec"]
    assert body["group"] == "asyncrl.io" and body["scope"] == "Namespaced"
    assert body["names"] == {"kind": "RLJob", "listKind": "RLJobList", "plural": "rljobs",
                             "singular": "rljob", "shortNames": ["rlj"], "categories": ["asyncrl"]}
    (version,) = body["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1alpha1", True, True)
    assert version["subresources"] == {"status": {}, "scale": {
        "specReplicasPath": ".spec.rollout.replicas",
        "statusReplicasPath": ".status.rolloutReplicas"}}


# --------------------------------------------------------------------------- structural

_FORBIDDEN = {"$ref", "$defs", "anyOf", "oneOf", "allOf", "title", "const", "discriminator",
              "examples", "uniqueItems"}


def _walk(node: dict, path: str = "<root>"):
    """Yield (path, node) for every schema node, not descending into value-only `not`."""
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}[*]")
    if "items" in node:
        yield from _walk(node["items"], f"{path}[]")


def test_schema_is_structural(schema):
    nodes = list(_walk(schema))
    assert len(nodes) > 100
    for path, node in nodes:
        assert "type" in node or node.get("x-kubernetes-int-or-string") is True, path
        if node.get("x-kubernetes-int-or-string"):
            assert "type" not in node, path
        assert not _FORBIDDEN & node.keys(), (path, _FORBIDDEN & node.keys())
        assert not ("properties" in node and "additionalProperties" in node), path
        assert node.get("additionalProperties") is not False, path
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            if bound in node:
                assert node[bound] is True, (path, node)
                assert ("minimum" if bound == "exclusiveMinimum" else "maximum") in node, path
        if "not" in node:  # value validations only
            assert not {"type", "description", "default", "nullable",
                        "properties", "additionalProperties"} & node["not"].keys(), path
        if node.get("type") == "array":
            assert "items" in node, path
        if "default" in node:
            assert node["default"] is not None, path
        if "required" in node:
            assert set(node["required"]) <= set(node.get("properties", {})), path


def test_schema_details(schema):
    s = schema["properties"]["spec"]["properties"]
    clip = s["algorithm"]["properties"]["clipEps"]
    assert (clip["minimum"], clip["exclusiveMinimum"], clip["default"]) == (0, True, 0.2)
    high = s["algorithm"]["properties"]["clipEpsHigh"]
    assert high["type"] == "number" and high["nullable"] is True and "default" not in high
    cap = s["algorithm"]["properties"]["behaviourWeightCap"]
    assert cap["nullable"] is True and cap["default"] == 5.0
    assert s["algorithm"]["properties"]["advantageEstimator"]["enum"] == ["grpo", "dr_grpo", "rloo"]
    assert s["rollout"]["properties"]["maxConcurrentRollouts"]["description"].startswith("Job-wide")
    cpu = s["rollout"]["properties"]["resources"]["properties"]["requests"]["additionalProperties"]
    assert cpu["x-kubernetes-int-or-string"] is True and cpu["pattern"] == spec.QUANTITY_PATTERN
    assert s["reward"]["properties"]["math"]["properties"]["extract"]["default"] == ["boxed"]
    assert schema["properties"]["metadata"]["type"] == "object"
    assert schema["properties"]["status"]["x-kubernetes-preserve-unknown-fields"] is True
    conditions = schema["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map"
    assert conditions["items"]["required"] == ["type", "status"]


def test_cel_rules_read_and_name_fields_of_their_own_object(schema):
    """Each x-kubernetes-validations rule (the CRD half of a model rule that spans fields)
    sits on the object whose fields it reads, and names one of them in its error."""
    rules = {path: node for path, node in _walk(schema) if "x-kubernetes-validations" in node}
    assert {"<root>.spec.dataset", "<root>.spec.buffer.redis",
            "<root>.spec.rollout.workflow"} <= set(rules)
    for path, node in rules.items():
        for rule in node["x-kubernetes-validations"]:
            assert set(re.findall(r"self\.(\w+)", rule["rule"])) <= set(node["properties"]), path
            assert rule["fieldPath"].removeprefix(".") in node["properties"], path
            assert rule["reason"] in {"FieldValueRequired", "FieldValueInvalid",
                                      "FieldValueForbidden", "FieldValueDuplicate"}, path
            assert rule["message"], path
    file_needs_path, file_fields_need_kind = rules["<root>.spec.dataset"][
        "x-kubernetes-validations"]
    assert file_needs_path["fieldPath"] == ".path"
    assert file_fields_need_kind["fieldPath"] == ".kind"
    episode_needs_function, episode_fields_need_kind = rules["<root>.spec.rollout.workflow"][
        "x-kubernetes-validations"]
    assert episode_needs_function["fieldPath"] == ".function"
    assert episode_fields_need_kind["fieldPath"] == ".kind"


def test_every_field_is_described(schema):
    for path, node in _walk(schema["properties"]["spec"]):
        if path.endswith("[*]") or path.endswith("[]"):
            continue
        assert node.get("description"), path


def test_unions_without_structural_form_are_refused():
    from asyncrl.spec.crd import SchemaError

    with pytest.raises(SchemaError, match="x"):
        structural_schema({"properties": {"x": {"anyOf": [{"type": "string"},
                                                          {"type": "boolean"}]}}})


# --------------------------------------------------------------------------- agreement

def _to_jsonschema(node, key=""):
    """OpenAPI 3.0 (Kubernetes flavour) -> draft 4 JSON Schema, which shares its boolean
    exclusiveMinimum/Maximum: translate nullable and int-or-string, and reject unknown fields
    as the API server does (metadata aside: the API server checks it itself)."""
    if isinstance(node, list):
        return [_to_jsonschema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: _to_jsonschema(v, k) for k, v in node.items()
           if not k.startswith("x-kubernetes-") and k not in ("nullable", "default")}
    if key == "properties":  # a mapping of field names, not a schema node
        return out
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if node.get("nullable"):
        out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def validator(schema):
    converted = _to_jsonschema(schema)
    converted["properties"]["metadata"].pop("additionalProperties")
    return jsonschema.Draft4Validator(converted)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_against_the_crd_schema(validator, path):
    data = read_manifest(path)
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(data)]
    assert not errors


def test_dumped_manifest_with_status_validates(validator):
    job = spec.load_manifest(ROOT / "examples" / "gpu-cluster.yaml")
    data = job.to_manifest()
    data["status"] = spec.RLJobStatus(
        phase="Running", policy_version=3, tokens_per_second=812.5,
        conditions=[spec.Condition(type="Ready", status="True", reason="AllReady",
                                   last_transition_time="2025-01-01T00:00:00Z")],
    ).model_dump(mode="json", by_alias=True)
    assert not [e.message for e in validator.iter_errors(data)]


@pytest.mark.parametrize(
    "change",
    [
        {"algorithm": {"clipEps": 0}},
        {"algorithm": {"advantageEstimator": "ppo"}},
        {"algorithm": {"clipEpsilon": 0.2}},
        {"dataset": {"evalFraction": 0.9}},
        {"rollout": {"topK": 0}},
        {"rollout": {"resources": {"requests": {"cpu": "two"}}}},
        {"rollout": {"resources": {"requests": {"cpu": "-1"}}}},
        {"reward": {"math": {"extract": []}}},
        {"buffer": {"redis": {"url": "http://r"}}},
        {"trainer": {"backend": "deepspeed"}},  # no such backend: refused, never run as pytorch
        {"trainer": {"megatron": {"tensorParallel": 0}}},
        {"algorithm": {"groupSize": 1}},  # every advantage would be 0
        {"rollout": {"temperature": 0}},  # greedy: a group's responses are identical
        {"rollout": {"topK": 1}},
        {"dataset": {"kind": "jsonl"}},  # no prompt reader for it
        {"dataset": {"kind": "file", "path": ""}},
        {"dataset": {"kind": "file", "path": "/data/p.jsonl", "preset": "squad"}},
        {"dataset": {"kind": "file", "path": "/data/p.jsonl", "volume": "My_Claim"}},
        {"dataset": {"kind": "file", "path": "/data/p.jsonl", "maxPromptTokens": 0}},
        {"dataset": {"kind": "file", "path": "/data/p.jsonl", "fields": {"question": "q"}}},
        {"reward": {"kind": "python", "python": {"function": "module_without_a_function"}}},
        {"reward": {"kind": "python", "python": {"function": "m:f", "volume": "Bad_Claim"}}},
        {"reward": {"kind": "http", "http": {"url": "ftp://judge"}}},
        {"rollout": {"workflow": {"kind": "multi_turn"}}},
        {"rollout": {"workflow": {"kind": "episode", "function": "no_function_named"}}},
        {"rollout": {"workflow": {"kind": "episode", "function": "m:f", "maxTurns": 0}}},
        {"rollout": {"workflow": {"kind": "episode", "function": "m:f", "turnDiscount": 1.5}}},
        {"rollout": {"workflow": {"kind": "episode", "function": "m:f", "timeoutSeconds": 0}}},
        {"rollout": {"workflow": {"kind": "episode", "function": "m:f", "path": "/e/m",
                                  "volume": "Bad_Claim"}}},
        {"rollout": {"workflow": {"kind": "episode", "function": "m:f", "egress": "10.0.0.0/8"}}},
    ],
)
def test_the_crd_and_the_model_reject_the_same_field_values(validator, change):
    data = copy.deepcopy(read_manifest(ROOT / "examples" / "tiny.yaml"))
    for section, fields in change.items():
        data["spec"].setdefault(section, {}).update(fields)
    assert list(validator.iter_errors(data)), change
    with pytest.raises(Exception):
        spec.parse_manifest(data)


def test_the_crd_rejects_bad_names_like_the_model(validator):
    data = read_manifest(ROOT / "examples" / "tiny.yaml")
    data["metadata"]["name"] = "My_Job"
    assert list(validator.iter_errors(data))


def test_printer_columns_point_at_status_fields(crd, schema):
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    assert [c["name"] for c in columns][:7] == ["Phase", "Version", "Step", "Tokens/s",
                                                "Staleness", "Reward", "Eval"]
    status_fields = schema["properties"]["status"]["properties"]
    assert {f.alias for f in spec.RLJobStatus.model_fields.values()} == set(status_fields)
    for column in columns:
        if column["jsonPath"] == ".metadata.creationTimestamp":
            assert column["type"] == "date"
            continue
        prefix, _, field = column["jsonPath"].partition(".status.")
        assert prefix == "" and field in status_fields, column
        assert status_fields[field]["type"] == column["type"], column
