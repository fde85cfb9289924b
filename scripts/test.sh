#!/usr/bin/env bash
# The whole test suite; slow tests (multi-process, end to end) run in a second pass so
# a failure in the fast pass is reported quickly.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest -m "not slow" "$@"
rc=0; .venv/bin/python -m pytest -m slow "$@" || rc=$?
# Exit code 5 means no test was selected: fine while there are no slow tests.
[ "$rc" = 0 ] || [ "$rc" = 5 ] || exit "$rc"
