"""The `asyncrl` command.

Each command is a small function registered on `app`; command groups (e.g. `serve rollout`)
are sub-apps added with `app.add_typer(...)`. Commands import heavy modules inside their body so
`asyncrl --help` and `asyncrl validate` stay fast.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Annotated

import typer

import asyncrl

app = typer.Typer(
    name="asyncrl",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"asyncrl {asyncrl.__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Fully asynchronous RL for language models: run jobs locally or on Kubernetes."""


@app.command()
def validate(
    files: Annotated[
        list[Path],
        typer.Argument(metavar="FILE...", help="RLJob manifests (YAML), one job per file."),
    ],
) -> None:
    """Check RLJob manifests: every problem on one line with its field and a fix."""
    from pydantic import ValidationError

    from asyncrl.spec import ManifestError, parse_manifest, read_manifest
    from asyncrl.spec_errors import format_errors, yaml_lines

    failed = 0
    for path in files:
        try:
            parse_manifest(read_manifest(path))
        except ManifestError as exc:
            failed += 1
            typer.secho(f"{exc}", fg=typer.colors.RED)
        except ValidationError as exc:
            failed += 1
            problems = format_errors(exc, lines=yaml_lines(path.read_text(encoding="utf-8")))
            count = f"{len(problems)} problem{'s' if len(problems) != 1 else ''}"
            typer.secho(f"{path}: invalid ({count})", fg=typer.colors.RED)
            for problem in problems:
                typer.echo(f"  {problem}")
        else:
            typer.secho(f"{path}: valid", fg=typer.colors.GREEN)
    if failed:
        raise typer.Exit(code=1)


class OutputFormat(str, enum.Enum):
    yaml = "yaml"
    json = "json"


@app.command()
def crd(
    output: Annotated[
        OutputFormat, typer.Option("--output", "-o", help="Output format.")
    ] = OutputFormat.yaml,
) -> None:
    """Print the RLJob CustomResourceDefinition (kubectl apply -f - takes it)."""
    from asyncrl.crd import build_crd

    definition = build_crd()
    if output is OutputFormat.json:
        typer.echo(json.dumps(definition, indent=2))
    else:
        import yaml

        typer.echo(yaml.safe_dump(definition, sort_keys=False, width=100).rstrip("\n"))


if __name__ == "__main__":  # pragma: no cover
    app()
