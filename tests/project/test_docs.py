"""The README and docs/ stay true to the tree: every relative link reaches a file (and a
heading, for a #anchor, by GitHub's anchor rule), every command the README shows exists (an
`asyncrl` subcommand and its options, a Makefile target, a script or path, a tool in .venv),
and the README's layer diagram follows the import-linter contract in pyproject.toml.

Fast and offline: files are read, the CLI is asked through typer's app object, nothing runs."""

from __future__ import annotations

import re
import shlex
import tomllib
import unicodedata
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import typer

from support import ROOT


README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]

#: Top-level folders of the repository: a token in a command that starts with one of them is
#: a path into the tree, and must exist (run folders, data and caches start elsewhere).
TREE_FOLDERS = ("bench", "charts", "core", "docker", "docs", "examples", "operator", "protos",
                "scripts", "services", "tests")
#: Languages of fenced blocks outside the README whose lines are commands.
SHELL_BLOCKS = {"bash", "sh", "shell", "console"}


def where(page: Path, line: int) -> str:
    return f"{page.relative_to(ROOT)}:{line}"


# ------------------------------------------------------------------------ reading pages

@dataclass(frozen=True)
class Block:
    """A fenced code block: its language and its lines with their line numbers."""

    language: str
    lines: list[tuple[int, str]]


def split_page(text: str) -> tuple[list[tuple[int, str]], list[Block]]:
    """The page's prose lines (outside fenced code blocks) and its fenced code blocks."""
    prose: list[tuple[int, str]] = []
    blocks: list[Block] = []
    fence = None
    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.lstrip()
        if fence is None:
            opening = re.match(r"(`{3,}|~{3,})\s*([\w+-]*)", stripped)
            if opening:
                fence = opening.group(1)
                blocks.append(Block(opening.group(2).lower(), []))
            else:
                prose.append((number, line))
        elif stripped.startswith(fence) and not stripped[len(fence):].strip():
            fence = None
        else:
            blocks[-1].lines.append((number, line))
    return prose, blocks


def without_code_spans(line: str) -> str:
    return re.sub(r"(`+).*?\1", "", line)


# ------------------------------------------------------------------------ anchors

def github_anchor(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lower-cased, every character that is
    not a letter, digit, space, hyphen or underscore removed, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = re.sub(r"(\*\*|__|\*)", "", text)  # emphasis
    kept = []
    for char in text.strip().lower():
        category = unicodedata.category(char)
        if char in " -_" or category[0] in "LN" or category == "Mn":
            kept.append(char)
    return "".join(kept).replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    """Every anchor of a page's headings; a repeated heading gets -1, -2, ... as on GitHub."""
    prose, _ = split_page(page.read_text())
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose:
        heading = re.match(r" {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        anchor = github_anchor(heading.group(1))
        count = seen.get(anchor, 0)
        seen[anchor] = count + 1
        found.add(anchor if count == 0 else f"{anchor}-{count}")
    return frozenset(found)


def test_github_anchor_rule():
    assert github_anchor("The Megatron-Core trainer backend") == "the-megatron-core-trainer-backend"
    assert github_anchor("Code rewards in Kubernetes") == "code-rewards-in-kubernetes"
    assert github_anchor("`asyncrl run`: one job, one machine") == "asyncrl-run-one-job-one-machine"
    assert github_anchor("Weights: trainer → rollout") == "weights-trainer--rollout"
    assert github_anchor("[Images](x.md) and **pods**") == "images-and-pods"
    assert github_anchor("η = 0, 1, 4") == "η--0-1-4"


# ------------------------------------------------------------------------ links

LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")


def relative_links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every link on the page that is not to another site."""
    return links_in(page.read_text())


def links_in(text: str) -> list[tuple[int, str]]:
    """(line, target) of every link in Markdown `text`, outside code, not to another site."""
    prose, _ = split_page(text)
    links = []
    for number, line in prose:
        line = without_code_spans(line)
        targets = [m.group(1) for m in LINK.finditer(line)]
        if reference := REFERENCE.match(line):
            targets.append(reference.group(1))
        for target in targets:
            if not re.match(r"[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
                links.append((number, target))
    return links


def link_problem(page: Path, target: str) -> str | None:
    path, _, anchor = target.partition("#")
    file = (page.parent / path).resolve() if path else page
    if path and not file.exists():
        return f"no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}"
    if not file.is_relative_to(ROOT):
        return "points outside the repository"
    if anchor:
        if file.is_dir() or file.suffix != ".md":
            return f"#{anchor} on a file that is not a Markdown page"
        if anchor not in anchors(file):
            return f"no heading with anchor #{anchor} in {file.relative_to(ROOT)}"
    return None


def test_links_are_read_as_github_renders_them():
    text = ("See [a](docs/a.md#x) and ![img](b.png), not `[c](c.md)`.\n"
            "```\n[d](d.md)\n```\n"
            "[e]: e.md\n[site](https://example.com) [mail](mailto:x@example.com) [here](#top)\n")
    assert links_in(text) == [(1, "docs/a.md#x"), (1, "b.png"), (5, "e.md"), (6, "#top")]


@pytest.mark.parametrize("target, expected", [
    ("docs/testing.md", None),
    ("docs/testing.md#markers", None),
    ("#layout", None),
    ("docs/nothing.md", "no file docs/nothing.md"),
    ("docs/testing.md#no-such-heading", "no heading with anchor #no-such-heading in docs/testing.md"),
    ("#no-such-heading", "no heading with anchor #no-such-heading in README.md"),
])
def test_the_link_check_itself(target, expected):
    assert link_problem(README, target) == expected


def test_pages_exist():
    assert README.is_file() and DOCS, "README.md and docs/*.md"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    problems = [f"{where(page, number)}: link {target}: {problem}"
                for number, target in relative_links(page)
                if (problem := link_problem(page, target))]
    assert not problems, "\n".join(problems)


def test_every_page_is_reachable_from_the_readme():
    linked = {(README.parent / target.partition("#")[0]).resolve()
              for _, target in relative_links(README)}
    unlinked = [str(page.relative_to(ROOT)) for page in DOCS if page.resolve() not in linked]
    assert not unlinked, f"README.md's documentation index misses: {unlinked}"


# ------------------------------------------------------------------------ commands

@cache
def cli() -> Any:
    """The `asyncrl` command as typer builds it: a group has `commands`, a command `params`."""
    from asyncrl.cli import app

    return typer.main.get_command(app)


def is_group(command: Any) -> bool:
    return hasattr(command, "commands")


@cache
def make_targets() -> frozenset[str]:
    text = (ROOT / "Makefile").read_text()
    return frozenset(re.findall(r"^([A-Za-z0-9_.-]+)\s*:(?!=)", text, re.M))


def unknown_options(command: Any, words: list[str]) -> list[str]:
    names = {"--help", "-h"}
    for param in command.params:
        names.update(param.opts)
        names.update(param.secondary_opts)
    return [word.split("=")[0] for word in words
            if word.startswith("-") and word.split("=")[0] not in names]


def asyncrl_problem(words: list[str]) -> str | None:
    """`asyncrl <sub> [<sub>] [args] [--options]`: every subcommand exists (alternatives
    written `a|b`, each checked), and every option named is one of its command's."""
    commands = [("asyncrl", cli())]
    rest = words
    while all(is_group(command) for _, command in commands) and rest \
            and not rest[0].startswith("-"):
        group_path, group = commands[0]
        names = rest[0].split("|")
        missing = [name for name in names if name not in group.commands]
        if missing:
            return f"`{group_path}` has no subcommand {', '.join(missing)}"
        commands = [(f"{group_path} {name}", group.commands[name]) for name in names]
        rest = rest[1:]
    for path, command in commands:
        if unknown := unknown_options(command, rest):
            return f"`{path}` has no option {', '.join(unknown)}"
    return None


def tree_path_problems(words: list[str]) -> list[str]:
    problems = []
    for word in words:
        word = word.split("=", 1)[-1]
        if re.fullmatch(r"[\w.-]+(/[\w.-]*)*", word) and "/" in word and \
                word.split("/")[0] in TREE_FOLDERS and not (ROOT / word).exists():
            problems.append(f"no path {word}")
    return problems


def command_problems(line: str) -> list[str]:
    """What is wrong with one shell line: each command of it (split at ;, &&, ||, |) is
    checked by its first word."""
    line = line.strip()
    if line.startswith("$ "):
        line = line[2:]
    line = re.sub(r"(^|\s)#.*$", "", line).rstrip("\\ ")  # a comment; a continuation
    try:
        words = shlex.split(line, comments=False)
    except ValueError:
        words = line.split()
    commands: list[list[str]] = [[]]
    for word in words:
        if word in (";", "&&", "||", "|"):
            commands.append([])
        else:
            commands[-1].append(word)
    problems = []
    for command in filter(None, commands):
        first, args = command[0], command[1:]
        if first in ("asyncrl", ".venv/bin/asyncrl"):
            if problem := asyncrl_problem(args):
                problems.append(problem)
        elif first == "make":
            targets = [arg for arg in args if not arg.startswith("-") and "=" not in arg]
            problems += [f"no Makefile target {target!r}" for target in targets
                         if target not in make_targets()]
        elif first == "bash":
            scripts = [arg for arg in args if not arg.startswith("-")][:1]
            problems += [f"no script {script}" for script in scripts
                         if not (ROOT / script).is_file()]
        elif first.startswith(".venv/bin/"):
            if not (ROOT / first).exists():
                problems.append(f"no {first} (made by scripts/setup.sh)")
        else:
            continue
        problems += tree_path_problems(args)
    return problems


def command_lines(page: Path) -> list[tuple[int, str]]:
    """The lines of a page that are commands: in the README, every line of every code block
    that starts with a command this test knows (asyncrl, make, bash, .venv/bin/...); on other
    pages, those lines of shell blocks. `$ ` prompts mark commands in any block."""
    _, blocks = split_page(page.read_text())
    lines = []
    for block in blocks:
        for number, line in block.lines:
            text = line.strip()
            if text.startswith("$ "):
                lines.append((number, text))
            elif (page == README or block.language in SHELL_BLOCKS) and \
                    re.match(r"(asyncrl|\.venv/bin/\S+|make|bash)(\s|$)", text):
                lines.append((number, text))
    return lines


def test_the_readme_shows_commands():
    shown = [line for _, line in command_lines(README)]
    assert any(line.startswith("make run") for line in shown)
    assert any(line.startswith("make test") for line in shown)
    assert any(line.startswith("asyncrl run") for line in shown)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_command_shown_exists(page):
    problems = [f"{where(page, number)}: {line!r}: {problem}"
                for number, line in command_lines(page)
                for problem in command_problems(line)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("line, expected", [
    ("asyncrl run FILE --steps 5", None),
    ("asyncrl serve buffer|trainer|rollout|reward", None),
    ("asyncrl serve buffer|tranier", "no subcommand tranier"),
    ("asyncrl fly FILE", "no subcommand fly"),
    ("asyncrl serve buffer|trainer --job-file job.yaml", None),
    ("asyncrl serve trainer|rollout --run-dir runs/x", "`asyncrl serve rollout` has no option --run-dir"),
    ("asyncrl run FILE --stpes 5", "no option --stpes"),
    ("make run     # a comment", None),
    ("make deploy", "no Makefile target 'deploy'"),
    ("bash scripts/setup.sh megatron", None),
    ("bash scripts/nothing.sh", "no script scripts/nothing.sh"),
    (".venv/bin/python bench/nothing.py", "no path bench/nothing.py"),
    ("$ asyncrl validate tests/data/broken-rljob.yaml", None),
])
def test_the_command_check_itself(line, expected):
    problems = command_problems(line)
    if expected is None:
        assert problems == []
    else:
        assert any(expected in problem for problem in problems), problems


# ------------------------------------------------------------------------ the layer diagram

def test_the_readme_draws_the_layers_of_the_contract():
    """The Layout section's diagram names the layers of pyproject.toml's contract, top to
    bottom, each row one layer (siblings on one row)."""
    contract = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in contract["contracts"] if c["type"] == "layers")["layers"]
    expected = [sorted(part.strip().removeprefix("asyncrl.") for part in layer.split("|"))
                for layer in layers]
    text = README.read_text()
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    _, blocks = split_page(section)
    diagram = blocks[0].lines
    drawn = []
    for _, line in diagram:
        names = re.findall(r"\basyncrl\.(\w+)", line)
        if names:
            drawn.append(sorted(names))
    assert drawn == expected, (
        "README.md's Layout diagram, one row per layer (asyncrl.<name>), must follow "
        f"pyproject.toml's layers contract:\n  drawn    {drawn}\n  contract {expected}")
