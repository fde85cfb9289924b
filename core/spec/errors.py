"""Readable RLJob validation errors: one line per problem, with the field and a fix.

    spec.algorithm.clipEpsilon: unknown field (got 0.3); fix: remove it - did you mean `clipEps`?
    spec.algorithm.groupSize: must be greater than or equal to 1 (got 0); fix: set an integer >= 1

Given the manifest's text (`yaml_lines`), each problem also knows its line in the file.

The field path is in manifest terms (camelCase, as written in YAML). The fix is derived from the
error type and the field's declaration in `asyncrl.spec` (its range, its allowed values, its
description); errors raised by the spec's own rules (`spec.rule_error`) carry their own fix.
"""

from __future__ import annotations

import difflib
import json
import re
import types
import typing
from dataclasses import dataclass
from typing import Any

import annotated_types
import yaml
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from asyncrl.spec import RULE_ERROR, RLJob

Loc = tuple[str | int, ...]


@dataclass(frozen=True)
class SpecIssue:
    """One problem in a manifest."""

    path: str
    problem: str
    fix: str
    value: str | None = None  # the value given, as YAML-ish text; None when there is none
    line: int | None = None  # 1-based line in the manifest file, when its text was given

    def __str__(self) -> str:
        got = f" (got {self.value})" if self.value is not None else ""
        return f"{self.path}: {self.problem}{got}; fix: {self.fix}"


def issues(
    exc: ValidationError,
    model: type[BaseModel] = RLJob,
    prefix: Loc = (),
    lines: dict[Loc, int] | None = None,
) -> list[SpecIssue]:
    """The problems in `exc`, raised while validating `model` found at `prefix` in a manifest.

    For a whole manifest use the defaults; for the spec alone, `issues(exc, RLJobSpec, ("spec",))`.
    `lines` (from `yaml_lines`) adds each problem's line in the file.
    """
    found: list[SpecIssue] = []
    for error in exc.errors(include_url=False):
        issue = _explain(error, model, prefix, lines or {})
        if issue not in found:
            found.append(issue)
    return found


def format_errors(
    exc: ValidationError,
    model: type[BaseModel] = RLJob,
    prefix: Loc = (),
    lines: dict[Loc, int] | None = None,
) -> list[str]:
    """One line per problem in `exc` (see `issues`), led by `line N: ` when lines are known."""
    found = issues(exc, model, prefix, lines)
    if lines:
        found.sort(key=lambda issue: issue.line or 0)
    return [(f"line {issue.line}: " if issue.line else "") + str(issue) for issue in found]


def describe(exc: ValidationError, model: type[BaseModel] = RLJob, prefix: Loc = ()) -> str:
    """All problems as one message, e.g. for a Kubernetes event or condition."""
    lines = format_errors(exc, model, prefix)
    head = f"{len(lines)} problem{'s' if len(lines) != 1 else ''} in the RLJob"
    return head + ":\n" + "\n".join(f"  {line}" for line in lines)


# --------------------------------------------------------------------------- one error


def yaml_lines(text: str) -> dict[Loc, int]:
    """Line number (1-based) of every key and list item in a YAML manifest, by location."""
    try:
        root = next(
            (n for n in yaml.compose_all(text, Loader=yaml.SafeLoader) if n is not None), None
        )
    except yaml.YAMLError:
        return {}
    found: dict[Loc, int] = {}

    def walk(node: yaml.Node, loc: Loc) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                sub = loc + (str(key.value),)
                found.setdefault(sub, key.start_mark.line + 1)
                walk(value, sub)
        elif isinstance(node, yaml.SequenceNode):
            for index, item in enumerate(node.value):
                found[loc + (index,)] = item.start_mark.line + 1
                walk(item, loc + (index,))

    if root is not None:
        walk(root, ())
    return found


def _line(lines: dict[Loc, int], loc: Loc) -> int | None:
    """The line of `loc`, or of its closest enclosing key that the file has."""
    for end in range(len(loc), 0, -1):
        if loc[:end] in lines:
            return lines[loc[:end]]
    return None


def _explain(
    error: dict[str, Any], model: type[BaseModel], prefix: Loc, lines: dict[Loc, int]
) -> SpecIssue:
    kind = error["type"]
    ctx = error.get("ctx") or {}
    loc: Loc = tuple(seg for seg in error["loc"] if not (isinstance(seg, str) and "[" in seg))
    value: Any = error.get("input")

    if kind == RULE_ERROR and ctx.get("field"):
        sub = tuple(ctx["field"].split("."))
        value = _dig(value, sub)
        loc = loc + sub
    target = _resolve(model, loc)
    path = format_path(prefix + loc)
    line = _line(lines, prefix + loc)

    problem = _problem(kind, error["msg"])
    show_value = kind not in ("missing",) and _is_shown(value)
    given = _show(value) if show_value else None

    if kind == RULE_ERROR:
        return SpecIssue(path, problem, ctx["fix"], given, line)
    if kind == "extra_forbidden":
        return SpecIssue(path, "unknown field", _fix_unknown(loc, model, prefix), given, line)
    return SpecIssue(path, problem, _fix(kind, ctx, target, value), given, line)


def _problem(kind: str, msg: str) -> str:
    if kind == "missing":
        return "is required"
    msg = re.sub(r"^Value error, ", "", msg)
    msg = re.sub(r"^Input should be\b", "must be", msg)
    msg = re.sub(r"^Input should\b", "must", msg)
    return msg if msg[1:2].isupper() else msg[:1].lower() + msg[1:]


def _fix(kind: str, ctx: dict[str, Any], target: _Target, value: Any) -> str:
    description = _sentence(target.field.description) if target.field else ""
    literal = _literal_values(target.annotation)
    if kind == "missing":
        return f"add it ({description})" if description else "add it"
    if kind in ("literal_error", "enum") and literal:
        choices = [str(v) for v in literal]
        fix = f"use one of: {', '.join(choices)}" if len(choices) > 1 else f"use {choices[0]}"
        return fix + _did_you_mean(value, choices)
    if kind in ("greater_than", "greater_than_equal", "less_than", "less_than_equal"):
        return "set " + _range_text(target, ctx)
    if kind in ("int_type", "int_parsing", "int_from_float"):
        return "use a whole number" + _example(target)
    if kind in ("float_type", "float_parsing", "finite_number"):
        return "use a number" + _example(target)
    if kind in ("bool_type", "bool_parsing"):
        return "use true or false"
    if kind in ("string_type", "string_sub_type"):
        return "use a string (quote the value)"
    if kind in ("dict_type", "model_type", "model_attributes_type", "mapping_type"):
        return "write it as a mapping (indented `key: value` lines)"
    if kind in ("list_type", "tuple_type", "iterable_type"):
        return "write it as a list (lines starting with `- `)"
    if kind == "too_short":
        n = ctx.get("min_length", 1)
        return f"give at least {n} item{'s' if n != 1 else ''}"
    if kind == "too_long":
        return f"give at most {ctx.get('max_length')} items"
    if kind == "string_too_short":
        return "give a non-empty value" if ctx.get("min_length") == 1 else (
            f"use at least {ctx.get('min_length')} characters")
    if kind == "string_too_long":
        return f"use at most {ctx.get('max_length')} characters"
    if kind == "string_pattern_mismatch":
        fix = f"use a value matching {ctx.get('pattern')}"
        return fix + (f" ({description})" if description and len(description) < 60 else "")
    if kind.startswith(("datetime", "date_")):
        return "use an RFC 3339 time such as 2025-01-31T12:00:00Z"
    if description:
        return f"see the field's description: {description}"
    return "check the value against `asyncrl crd`"


# --------------------------------------------------------------------------- unknown fields


def _fix_unknown(loc: Loc, model: type[BaseModel], prefix: Loc) -> str:
    key = loc[-1] if loc else ""
    parent = _resolve(model, loc[:-1])
    fix = "remove it"
    if not isinstance(key, str):
        return fix
    siblings = _aliases(parent.model) if parent.model else []
    by_letters = {_letters(alias): alias for alias in siblings}
    if _letters(key) in by_letters:  # clip_eps, ClipEps, clip-eps -> clipEps
        return f"{fix} - did you mean `{by_letters[_letters(key)]}`?"
    close = difflib.get_close_matches(key, siblings, n=1, cutoff=0.6)
    if close:
        return f"{fix} - did you mean `{close[0]}`?"
    elsewhere = [
        p for p in _field_paths(model, prefix) if _letters(p.rsplit(".", 1)[-1]) == _letters(key)
    ]
    if elsewhere:
        return f"{fix} - it belongs at {' or '.join(elsewhere)}"
    if siblings:
        return f"{fix} (known fields here: {', '.join(siblings)})"
    return fix


def _letters(name: str) -> str:
    return name.lower().replace("_", "").replace("-", "")


def _did_you_mean(value: Any, choices: list[str]) -> str:
    if not isinstance(value, str) or not value:
        return ""
    folded = {c.lower(): c for c in choices}
    if value.lower() in folded:
        return f" - did you mean `{folded[value.lower()]}`?"
    close = difflib.get_close_matches(value, choices, n=1, cutoff=0.6)
    return f" - did you mean `{close[0]}`?" if close else ""


def _aliases(model: type[BaseModel]) -> list[str]:
    return [field.alias or name for name, field in model.model_fields.items()]


def _field_paths(model: type[BaseModel], prefix: Loc, depth: int = 6) -> list[str]:
    """Every field path below `model`, e.g. spec.algorithm.groupSize (models only, no lists)."""
    paths: list[str] = []
    for name, field in model.model_fields.items():
        path = prefix + (field.alias or name,)
        paths.append(format_path(path))
        sub = _model_in(field.annotation)
        if sub is not None and depth > 0:
            paths.extend(_field_paths(sub, path, depth - 1))
    return paths


# --------------------------------------------------------------------------- field lookup


@dataclass(frozen=True)
class _Target:
    """What a location names: the field declaring it, its type, and the model it is in."""

    field: FieldInfo | None = None
    annotation: Any = None
    model: type[BaseModel] | None = None


def _resolve(root: type[BaseModel], loc: Loc) -> _Target:
    field: FieldInfo | None = None
    tp: Any = root
    model: type[BaseModel] | None = None
    for seg in loc:
        tp = _unwrap(tp)
        origin = typing.get_origin(tp)
        if isinstance(tp, type) and issubclass(tp, BaseModel):
            found = _field_named(tp, seg)
            if found is None:
                return _Target(model=tp)
            model, field, tp = tp, found, found.annotation
        elif origin in (list, tuple, set, frozenset) and isinstance(seg, int):
            tp = typing.get_args(tp)[0] if typing.get_args(tp) else Any
        elif origin is dict:
            tp = typing.get_args(tp)[1] if typing.get_args(tp) else Any
        else:
            return _Target()
    unwrapped = _unwrap(tp)
    return _Target(field, unwrapped, unwrapped if _is_model(unwrapped) else model)


def _field_named(model: type[BaseModel], seg: str | int) -> FieldInfo | None:
    for name, field in model.model_fields.items():
        if seg in (field.alias, name):
            return field
    return None


def _unwrap(tp: Any) -> Any:
    """Strip Annotated[...] and Optional[...] (X | None with a single X)."""
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(tp) if a is not type(None)]
            if len(args) != 1:
                return tp
            tp = args[0]
        else:
            return tp


def _is_model(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, BaseModel)


def _model_in(tp: Any) -> type[BaseModel] | None:
    tp = _unwrap(tp)
    return tp if _is_model(tp) else None


def _literal_values(tp: Any) -> tuple[Any, ...]:
    tp = _unwrap(tp)
    return typing.get_args(tp) if typing.get_origin(tp) is typing.Literal else ()


def _range_text(target: _Target, ctx: dict[str, Any]) -> str:
    """'a number > 0', 'an integer from 1 to 5', from the field's bounds (or the error's)."""
    lower = upper = None
    for meta in target.field.metadata if target.field else ():
        if isinstance(meta, annotated_types.Gt):
            lower = (">", meta.gt)
        elif isinstance(meta, annotated_types.Ge):
            lower = (">=", meta.ge)
        elif isinstance(meta, annotated_types.Lt):
            upper = ("<", meta.lt)
        elif isinstance(meta, annotated_types.Le):
            upper = ("<=", meta.le)
    if lower is None and upper is None:  # a bound inside a nested type: use the error's own
        for key, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if key in ctx:
                return f"{_noun(target)} {op} {_num(ctx[key])}"
    noun = _noun(target)
    if lower and upper and lower[0] == ">=" and upper[0] == "<=":
        return f"{noun} from {_num(lower[1])} to {_num(upper[1])}"
    parts = [f"{bound[0]} {_num(bound[1])}" for bound in (lower, upper) if bound]
    return f"{noun} {' and '.join(parts)}"


def _noun(target: _Target) -> str:
    return "an integer" if _unwrap(target.annotation) is int else "a number"


def _example(target: _Target) -> str:
    default = target.field.default if target.field else None
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        return f", e.g. {_num(default)} (the default)"
    return ""


def _sentence(text: str | None) -> str:
    return (text or "").strip().rstrip(".")


# --------------------------------------------------------------------------- formatting


_PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")


def format_path(loc: Loc) -> str:
    """('spec', 'rollout', 'resources', 'limits', 'nvidia.com/gpu') ->
    spec.rollout.resources.limits["nvidia.com/gpu"]; list indexes as [0]."""
    out = ""
    for seg in loc:
        if isinstance(seg, int):
            out += f"[{seg}]"
        elif _PLAIN_KEY.match(seg):
            out += f".{seg}" if out else seg
        else:
            out += f"[{json.dumps(seg)}]"
    return out or "<top level>"


def _dig(value: Any, keys: tuple[str, ...]) -> Any:
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return _Missing
        value = value[key]
    return value


class _Missing:
    """Marker: the field a rule is about was not given."""


def _is_shown(value: Any) -> bool:
    if value is _Missing:
        return False
    if isinstance(value, (dict, list)):
        return len(json.dumps(value, default=str)) <= 60
    return True


def _show(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, (int, float)):
        return _num(value)
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def _num(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return f"{value:g}" if isinstance(value, float) else str(value)
