#!/usr/bin/env bash
# The whole test suite, in three passes so a failure in a quick pass is reported quickly:
#   1. fast tests;
#   2. slow tests (multi-process, end to end on this machine, the kwok control plane);
#   3. real pods: a one-node Kubernetes cluster on this machine (needs root) and the images
#      built from this checkout, cached outside the clone (tests/cluster/node.sh, images.sh).
# What a later pass needs is made while an earlier one runs, at low priority, so a cold machine
# fills the passes' idle time with it: the control plane beside the fast pass and the slow
# tests that do not use it (those that do, marked control_plane by tests/conftest.py, run once
# it is built), SGLang's request-check environment beside the fast pass, the images and the
# real node's packages beside the slow pass. Cached, each takes seconds. Their logs:
# $PREPARED_LOGS.
set -euo pipefail
cd "$(dirname "$0")/.."
PREPARED_LOGS=${ASYNCRL_CACHE:-$HOME/.cache/asyncrl}/test-logs
mkdir -p "$PREPARED_LOGS"

prepare() {  # prepare <name> <command...>: run it in the background, niced, logged
    local name=$1
    shift
    # A session of its own, so that a failed pass stops it with everything it started.
    setsid nice -n 19 "$@" >"$PREPARED_LOGS/$name.log" 2>&1 &
    prepared_pid[$name]=$!
}
stop_prepared() {
    local pid
    for pid in "${prepared_pid[@]}"; do
        kill -- "-$pid" 2>/dev/null || true
    done
}
prepared() {  # prepared <name>: wait for it; on failure, show its log's end and fail
    local name=$1
    if ! wait "${prepared_pid[$name]}"; then
        echo "test.sh: '$name' failed; the end of $PREPARED_LOGS/$name.log:" >&2
        tail -n 30 "$PREPARED_LOGS/$name.log" >&2
        exit 1
    fi
    unset "prepared_pid[$name]"  # done: nothing left for stop_prepared to stop
}
passed() {  # exit code 5 means no test was selected (a -k that matches none of a pass)
    [ "$1" = 0 ] || [ "$1" = 5 ]
}
declare -A prepared_pid
trap stop_prepared EXIT

bash tests/cluster/build.sh --tools  # helm and kubectl, for the fast pass's chart tests
prepare control-plane bash tests/cluster/build.sh
prepare sglang-env bash scripts/sglang_check_env.sh
.venv/bin/python -m pytest -m "not slow and not real_node" "$@"

prepared sglang-env
prepare images bash tests/cluster/images.sh
# The slow pass in two parts, around the end of the control plane's build; its slowest tests
# named in the log (10 s and more): the pass CI time depends on most.
slow() {
    rc=0; .venv/bin/python -m pytest -m "slow and not real_node and $1" --durations=0 \
        --durations-min=10 "${@:2}" || rc=$?
    passed "$rc" || exit "$rc"
}
slow "not control_plane" "$@"
prepared control-plane
prepare real-node bash tests/cluster/node.sh prepare
slow control_plane "$@"

prepared images
prepared real-node
# A node that cannot run pods fails every test of the pass, each after its own long wait:
# stop after a few so the failure is reported in minutes, not hours.
rc=0; .venv/bin/python -m pytest -m real_node --maxfail=3 --durations=0 --durations-min=10 "$@" || rc=$?
passed "$rc" || exit "$rc"
