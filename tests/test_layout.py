"""The package layout: deployable folders install under `asyncrl`, nothing shadows the
standard library, and the console script lists its commands."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


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
