"""A whole RLJob manifest, and reading one from YAML with the line of each problem."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
import re
from typing import Any, Literal

import yaml
from pydantic import Field, field_validator

from asyncrl.spec.base import MAX_NAME_LENGTH, NAME_PATTERN, SpecModel, rule_error
from asyncrl.spec.job import RLJobSpec
from asyncrl.spec.status import RLJobStatus

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

    def resolved(self) -> dict[str, Any]:
        """The job as its services run it, the one form both the operator (the job's
        ConfigMap) and `asyncrl run` (the run folder's job.yaml) hand them: every default
        filled in, camelCase keys, no status and no server-set metadata."""
        data = self.model_dump(mode="json", by_alias=True, exclude={"status", "metadata"})
        metadata = {"name": self.metadata.name}
        if self.metadata.namespace:
            metadata["namespace"] = self.metadata.namespace
        return {"apiVersion": data.pop("apiVersion"), "kind": data.pop("kind"),
                "metadata": metadata, **data}


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
    `asyncrl.spec.errors.format_errors` makes the latter readable.
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
