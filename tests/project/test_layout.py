"""The package layout: deployable folders install under `asyncrl`, nothing shadows the
standard library, and the console script lists its commands."""

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

from support import ROOT


def test_every_package_folder_is_installed():
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(tool["packages"])
    found = set()
    for package, folder in tool["package-dir"].items():
        for source in (ROOT / folder).rglob("*.py"):
            found.add(".".join([package, *source.parent.relative_to(ROOT / folder).parts]))
    assert found <= listed, f"add to [tool.setuptools] packages: {sorted(found - listed)}"


def test_operator_folder_never_shadows_the_stdlib_operator():
    assert not (ROOT / "operator" / "__init__.py").exists()
    # -S skips site (which may import operator early); cwd is first on sys.path with -c.
    out = subprocess.run(
        [sys.executable, "-S", "-c", "import operator; print(operator.__file__)"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout
    assert "site-packages" not in out and not out.startswith(str(ROOT))


def test_service_packages_import_as_asyncrl_parts():
    out = subprocess.run(
        [sys.executable, "-c", "import asyncrl.trainer.step, asyncrl.spec, asyncrl.v1.buffer_pb2"],
        cwd=ROOT, capture_output=True, text=True,
    )
    assert out.returncode == 0, out.stderr


def test_console_script_lists_its_commands():
    out = subprocess.run(
        [str(Path(sys.executable).parent / "asyncrl"), "--help"],
        capture_output=True, text=True, check=True,
    ).stdout
    for command in ("validate", "crd", "train-demo"):
        assert command in out


# ------------------------------------------------------------------------- the layers

def _module_names_on_disk() -> set[str]:
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    names = set()
    for package, folder in tool["package-dir"].items():
        for source in (ROOT / folder).rglob("*.py"):
            parts = source.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names.add(".".join([package, *parts]))
    return names


def test_the_import_graph_sees_every_module():
    """grimp (import-linter's graph) silently skips folders without __init__.py: a module it
    does not see is a module no contract checks."""
    import grimp

    seen = set(grimp.build_graph("asyncrl", cache_dir=None).modules)
    missing = _module_names_on_disk() - seen
    assert not missing, f"not in the import graph (re-run scripts/setup.sh?): {sorted(missing)}"


def test_the_layers_import_downwards_only():
    out = subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
                         cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


def _lint_with_extra_module(tmp_path: Path, module: str, source: str):
    """lint-imports on the installed package plus one module: a copy of the editable install's
    link tree (links, not files) first on PYTHONPATH, with `module` written into it."""
    import asyncrl

    tree = tmp_path / "asyncrl"
    shutil.copytree(Path(asyncrl.__file__).parent, tree, symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path.joinpath(*module.split(".")).with_suffix(".py")
    target.write_text(source)
    return subprocess.run([str(Path(sys.executable).parent / "lint-imports"), "--no-cache"],
                          cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)})


def test_an_upward_import_breaks_the_layers(tmp_path):
    # The settings' layer reaching up into a service: what the layers exist to stop.
    out = _lint_with_extra_module(tmp_path, "asyncrl.platform.upward",
                                  "import asyncrl.rollout.server\n")
    assert out.returncode != 0
    assert "asyncrl.platform.upward -> asyncrl.rollout.server" in out.stdout


def test_a_service_importing_another_service_breaks_the_layers(tmp_path):
    out = _lint_with_extra_module(tmp_path, "asyncrl.trainer.sideways",
                                  "from asyncrl.rollout import server\n")
    assert out.returncode != 0
    assert "asyncrl.trainer.sideways -> asyncrl.rollout.server" in out.stdout
    # the shared engine below both services is allowed
    out = _lint_with_extra_module(tmp_path / "again", "asyncrl.trainer.downward",
                                  "from asyncrl.engine import torch_engine\n")
    assert out.returncode == 0, out.stdout
