"""trainer.weightTransfer ipc in the spec: taken by `asyncrl run` (one machine), refused with
the SGLang engine everywhere and by the API server in a cluster (where trainer and rollout are
different pods)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from asyncrl.spec import parse_manifest
from asyncrl.spec.crd import build_crd
from asyncrl.spec.errors import format_errors


def manifest(**spec_fields) -> dict:
    return {"apiVersion": "asyncrl.io/v1alpha1", "kind": "RLJob", "metadata": {"name": "job"},
            "spec": spec_fields}


def test_ipc_is_a_weight_transfer_of_the_torch_engine():
    job = parse_manifest(manifest(trainer={"weightTransfer": "ipc"}))
    assert job.spec.trainer.weight_transfer == "ipc"
    with pytest.raises(ValidationError) as refused:
        parse_manifest(manifest(trainer={"weightTransfer": "ipc"},
                                rollout={"engine": "sglang", "placement": {
                                    "gpus": 1, "nodeSelector": {"pool": "gpu"}}}))
    (line,) = format_errors(refused.value)
    assert line.startswith("spec.trainer.weightTransfer: ")
    assert "set rollout.engine: torch, or trainer.weightTransfer: distributed" in line


def test_the_cluster_refuses_ipc_naming_the_field_and_the_fix():
    trainer = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"]["trainer"]
    assert "ipc" in trainer["properties"]["weightTransfer"]["enum"]
    (rule,) = trainer["x-kubernetes-validations"]
    assert rule["rule"] == "!has(self.weightTransfer) || self.weightTransfer != 'ipc'"
    assert rule["fieldPath"] == ".weightTransfer"
    assert "set weightTransfer distributed or disk" in rule["message"]
