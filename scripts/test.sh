#!/usr/bin/env bash
# The whole test suite, in three passes so a failure in a quick pass is reported quickly:
#   1. fast tests;
#   2. slow tests (multi-process, end to end on this machine, the kwok control plane);
#   3. real pods: a one-node Kubernetes cluster on this machine (needs root) and the images
#      built from this checkout, cached outside the clone (tests/cluster/node.sh, images.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest -m "not slow and not real_node" "$@"
passed() {  # exit code 5 means no test was selected (a -k that matches none of a pass)
    [ "$1" = 0 ] || [ "$1" = 5 ]
}
# The slowest named in the log: the pass CI time depends on most.
rc=0; .venv/bin/python -m pytest -m "slow and not real_node" --durations=20 "$@" || rc=$?
passed "$rc" || exit "$rc"

bash tests/cluster/node.sh prepare
bash tests/cluster/images.sh >/dev/null
# A node that cannot run pods fails every test of the pass, each after its own long wait:
# stop after a few so the failure is reported in minutes, not hours.
rc=0; .venv/bin/python -m pytest -m real_node --maxfail=3 "$@" || rc=$?
passed "$rc" || exit "$rc"
