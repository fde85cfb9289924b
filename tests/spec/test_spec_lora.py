"""model.lora in the spec: PEFT's defaults where it is silent, refused naming the field and
the fix where it cannot run."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from asyncrl.spec import parse_manifest
from asyncrl.spec.crd import build_crd
from asyncrl.spec.errors import format_errors

SGLANG = {"engine": "sglang", "placement": {"gpus": 1, "nodeSelector": {"pool": "gpu"}}}


def manifest(**spec_fields) -> dict:
    return {"apiVersion": "asyncrl.io/v1alpha1", "kind": "RLJob", "metadata": {"name": "job"},
            "spec": spec_fields}


def refusal(**spec_fields) -> str:
    with pytest.raises(ValidationError) as refused:
        parse_manifest(manifest(**spec_fields))
    (line,) = format_errors(refused.value)
    return line


def test_an_empty_lora_section_adapts_every_projection():
    lora = parse_manifest(manifest(model={"lora": {}})).spec.model.lora
    assert (lora.rank, lora.alpha, lora.dropout) == (16, 32.0, 0.0)
    assert lora.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                   "up_proj", "down_proj"]
    assert parse_manifest(manifest()).spec.model.lora is None  # full fine-tuning


@pytest.mark.parametrize("lora, field", [
    ({"rank": 0}, "spec.model.lora.rank"),
    ({"alpha": 0}, "spec.model.lora.alpha"),
    ({"dropout": 1.0}, "spec.model.lora.dropout"),
    ({"targetModules": []}, "spec.model.lora.targetModules"),
    ({"targetModules": ["q proj"]}, "spec.model.lora.targetModules[0]"),
    ({"ranks": 8}, "spec.model.lora.ranks"),
])
def test_bad_values_are_refused_naming_the_field(lora, field):
    assert refusal(model={"lora": lora}).startswith(field + ": ")


@pytest.mark.parametrize("spec, lora, field, fix", [
    ({"trainer": {"backend": "megatron"}}, {}, "spec.trainer.backend", "backend: pytorch"),
    ({"trainer": {"sharding": "fsdp"}}, {}, "spec.trainer.sharding", "sharding: none"),
    # SGLang loads adapters from a directory only, and adapts modules by their own names.
    ({"rollout": SGLANG, "trainer": {"weightTransfer": "distributed"}}, {},
     "spec.trainer.weightTransfer", "weightTransfer: disk"),
    ({"rollout": SGLANG, "trainer": {"weightTransfer": "ipc"}}, {},
     "spec.trainer.weightTransfer", "weightTransfer: disk"),
    ({"rollout": SGLANG}, {"targetModules": ["q_proj", "self_attn.v_proj"]},
     "spec.model.lora.targetModules", "engine: torch"),
])
def test_what_lora_does_not_run_with_is_refused_with_the_fix(spec, lora, field, fix):
    line = refusal(model={"lora": lora}, **spec)
    assert line.startswith(field + ": ") and fix in line, line


@pytest.mark.parametrize("transfer", [None, "auto", "disk"])
def test_lora_runs_with_sglang_by_disk(transfer):
    trainer = {"weightTransfer": transfer} if transfer else {}
    spec = parse_manifest(manifest(model={"lora": {"rank": 8}}, rollout=SGLANG,
                                   trainer=trainer)).spec
    assert spec.rollout.engine == "sglang" and spec.model.lora.rank == 8


def test_the_crd_carries_the_lora_section():
    model = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
        "spec"]["properties"]["model"]
    lora = model["properties"]["lora"]["properties"]
    assert set(lora) == {"rank", "alpha", "dropout", "targetModules", "seed"}
    assert lora["rank"]["minimum"] == 1
