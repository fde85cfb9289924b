#!/usr/bin/env bash
# A separate virtual environment in which SGLang's own request models can be imported on a
# CPU-only machine, so tests/support/sglang_requests.py can check our request bodies and launch
# flags against them. SGLang itself cannot run here (no GPU); only its pure-Python parts are
# needed: `pip install --no-deps sglang` plus what `sglang.srt.managers.io_struct`,
# `sglang.srt.entrypoints.api_contract` and `sglang.srt.server_args` import.
#
# Built once and cached in ${ASYNCRL_CACHE:-~/.cache/asyncrl}/sglang-venv; a second run only
# re-checks and is fast. torch comes from the wheel cache scripts/setup.sh fills, so nothing
# big is downloaded again. Prints the venv's python on stdout (progress goes to stderr).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3.11}          # SGLang's wheel is built for CPython 3.11
SGLANG_VERSION=0.5.23                 # keep in step with asyncrl.launch.sglang
TORCH_VERSION=2.15.0                  # our torch; SGLang 0.5.23 asks for 2.14.1 (unused here)
CACHE=${ASYNCRL_CACHE:-$HOME/.cache/asyncrl}
WHEELS=$CACHE/wheels
VENV=$CACHE/sglang-venv

# What SGLang's request models import, pinned: the versions SGLang pins where it pins one,
# the versions this was checked with otherwise.
IMPORTS=(
    numpy==2.4.6 orjson==3.13.0 psutil==7.2.2 pybase64==1.5.1 requests==2.34.2
    packaging==26.3 pillow==13.0.0 starlette==1.10.0 msgspec==0.22.0 pydantic==2.14.3
    pyzmq==27.3.0 tqdm==4.70.1 ipython==9.18.1 aiohttp==3.14.5 dill==0.4.1 gguf==0.19.0
    partial-json-parser==0.2.1.1.post7
    transformers==5.19.0 apache-tvm-ffi==0.1.11 compressed-tensors==0.18.0
    sentencepiece==0.2.1 openai==2.8.0
)
TORCHVISION=torchvision==0.29.2       # --no-deps: it would otherwise re-resolve torch

step() { printf '\033[1m==> %s\033[0m\n' "$*" >&2; }
# pip lists every SGLang dependency left out on purpose (the GPU stack) as a conflict.
pip_quiet() {
    "$@" 2>&1 | { grep -v -e "^sglang $SGLANG_VERSION requires" \
        -e "^ERROR: pip's dependency resolver does not currently" || true; } >&2
}

stamp=$VENV/.complete-$(sha256sum scripts/sglang_check_env.sh | cut -c1-16)
mkdir -p "$CACHE"
exec 9>"$CACHE/.sglang-venv.lock"
flock 9   # one builder at a time; a second caller waits, then finds the stamp

if [ ! -f "$stamp" ]; then
    if [ ! -f "$WHEELS/.torch-$TORCH_VERSION.complete" ]; then
        echo "error: no torch $TORCH_VERSION wheels in $WHEELS; run scripts/setup.sh first" >&2
        exit 1
    fi
    step "building the SGLang $SGLANG_VERSION request-check environment in $VENV (once)"
    started=$(date +%s)
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
    step "installing torch $TORCH_VERSION from the wheel cache"
    pip_quiet "${PIP[@]}" install --no-index --find-links "$WHEELS" "torch==$TORCH_VERSION"
    step "installing sglang $SGLANG_VERSION (no dependencies) and its pure-Python imports"
    pip_quiet "${PIP[@]}" install --no-deps "sglang==$SGLANG_VERSION" "$TORCHVISION"
    # --find-links: any torch requirement is met by the cached wheels, never a download.
    pip_quiet "${PIP[@]}" install --find-links "$WHEELS" "${IMPORTS[@]}" "torch==$TORCH_VERSION"
    step "checking the imports"
    "$VENV/bin/python" -W ignore -c '
import sglang.srt.managers.io_struct, sglang.srt.entrypoints.api_contract
import sglang.srt.sampling.sampling_params, sglang.srt.server_args' >&2
    touch "$stamp"
    step "built in $(( $(date +%s) - started ))s"
fi
echo "$VENV/bin/python"
