#!/usr/bin/env bash
# Generates the Python gRPC stubs for protos/asyncrl/v1/*.proto into core/v1/ (gitignored),
# which installs as `asyncrl.v1`. The protos import each other as "asyncrl/v1/x.proto", so
# the generated code imports `asyncrl.v1.x_pb2`, which resolves inside the asyncrl package.
set -euo pipefail
cd "$(dirname "$0")/.."
staging=$(mktemp -d)
trap 'rm -rf "$staging"' EXIT
.venv/bin/python -m grpc_tools.protoc -I protos \
    --python_out="$staging" --pyi_out="$staging" --grpc_python_out="$staging" \
    protos/asyncrl/v1/*.proto
printf '"""Generated from protos/asyncrl/v1 by scripts/gen_protos.sh; do not edit."""\n' \
    > "$staging/asyncrl/v1/__init__.py"
rm -rf core/v1
mv "$staging/asyncrl/v1" core/v1
