"""model.source by Hub id: the spelling rule that tells a Hub id from a path
(asyncrl.spec.model_source), model.revision and model.hubTokenSecret, and the CRD's fields."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from asyncrl.spec import parse_manifest
from asyncrl.spec.crd import build_crd
from asyncrl.spec.errors import format_errors
from asyncrl.spec.model_source import hub_repo_id


def manifest(**model) -> dict:
    return {"apiVersion": "asyncrl.io/v1alpha1", "kind": "RLJob", "metadata": {"name": "job"},
            "spec": {"model": model}}


@pytest.mark.parametrize("source, repo_id", [
    ("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ("smollm2-135m-instruct", None),        # builtin
    ("tiny-random", None),                  # builtin
    ("/models/qwen", None),                 # absolute path
    ("./Qwen/Qwen2.5-0.5B-Instruct", None),  # a path, by its prefix
    ("~/models/qwen", None),
    ("../Qwen/Qwen2.5", None),
    ("models/export", "models/export"),  # spelled like a Hub id: where it exists, a path
    ("runs/job/step-3", None),              # two folders: a path
    ("model.gguf", None),                   # no org
    ("org/has space", None),                # not a valid Hub name
    ("org/a--b", None),
    ("org/name.git", None),
])
def test_a_hub_id_is_org_slash_name_by_the_hubs_rule(source, repo_id):
    assert hub_repo_id(source) == repo_id


@pytest.mark.parametrize("name", [
    "Qwen/Qwen2.5-0.5B-Instruct", "a/b", "org/x" + "y" * 95, "org/x" + "y" * 96,
    "o" * 96 + "/name", "o" * 97 + "/name", "org/.name", "org/name.", "org/-name", "org/name-",
    "org/_name_", "org/na..me", "org/na--me", "org/name.git", "org/näme", "org/na me",
    "org/na+me", "org/", "/name", "-org/name", "org/name\n", "org/名前", "org.x/name",
])
def test_the_hub_id_rule_is_huggingface_hubs(name):
    """The rule is written out (the operator's image has no huggingface_hub): it gives
    huggingface_hub's answer for every org/name."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
        valid = True
    except HFValidationError:
        valid = False
    prefixed = name.startswith(("/", ".", "~"))
    assert (hub_repo_id(name) == name) == (valid and not prefixed), name


def test_telling_a_hub_id_needs_no_huggingface_hub():
    """The operator reads model.source without huggingface_hub (its image has none)."""
    import subprocess
    import sys

    code = ("import sys; from asyncrl.spec import parse_manifest; "
            "from asyncrl.operator.builders.model import ready_file; "
            "job = parse_manifest({'apiVersion': 'asyncrl.io/v1alpha1', 'kind': 'RLJob', "
            "'metadata': {'name': 'j'}, 'spec': {'model': {'source': 'org/name'}}}); "
            "assert job.spec.model.hub_id == 'org/name' and ready_file(job); "
            "assert 'huggingface_hub' not in sys.modules, 'huggingface_hub imported'")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_a_hub_job_takes_a_revision_and_a_token_secret():
    model = parse_manifest(manifest(source="Qwen/Qwen2.5-0.5B-Instruct", revision="v1.0",
                                    hubTokenSecret={"name": "hf", "key": "token"})).spec.model
    assert (model.hub_id, model.revision) == ("Qwen/Qwen2.5-0.5B-Instruct", "v1.0")
    assert (model.hub_token_secret.name, model.hub_token_secret.key) == ("hf", "token")
    defaults = parse_manifest(manifest(source="Qwen/Qwen2.5-0.5B-Instruct")).spec.model
    assert (defaults.revision, defaults.hub_token_secret) == ("main", None)
    assert parse_manifest(manifest()).spec.model.hub_id is None  # the builtin


@pytest.mark.parametrize("model, expected", [
    ({"source": "/models/qwen", "revision": "v1"},
     "spec.model.revision: revision 'v1' is read only for a Hub model, and source "
     "'/models/qwen' is not a Hub id <org>/<name> (got \"v1\"); fix: remove model.revision, or set "
     "model.source to the Hub id"),
    ({"source": "tiny-random", "hubTokenSecret": {"name": "hf", "key": "token"}},
     "spec.model.hubTokenSecret: hubTokenSecret is read only for a Hub model, and source "
     "'tiny-random' is not a Hub id <org>/<name> (got {\"name\": \"hf\", \"key\": \"token\"}); "
     "fix: remove model.hubTokenSecret, or set "
     "model.source to the Hub id"),
])
def test_hub_settings_without_a_hub_id_are_refused_naming_the_field(model, expected):
    with pytest.raises(ValidationError) as refused:
        parse_manifest(manifest(**model))
    (line,) = format_errors(refused.value)
    assert line == expected


def test_the_crd_has_the_hub_fields():
    schema = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    model = schema["properties"]["spec"]["properties"]["model"]["properties"]
    assert model["revision"]["default"] == "main"
    assert set(model["hubTokenSecret"]["properties"]) == {"name", "key"}
    assert "<org>/<name>" in model["source"]["description"]
