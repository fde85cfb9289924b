#!/usr/bin/env bash
# Generates the Python gRPC stubs for protos/asyncrl/v1/*.proto into asyncrl/v1/
# (gitignored). The protos import each other as "asyncrl/v1/x.proto", so the stubs
# import as `asyncrl.v1.x_pb2` and live inside the asyncrl package.
set -euo pipefail
cd "$(dirname "$0")/.."
out=asyncrl/v1
rm -rf "$out" && mkdir -p "$out"
.venv/bin/python -m grpc_tools.protoc -I protos \
    --python_out=. --pyi_out=. --grpc_python_out=. \
    protos/asyncrl/v1/*.proto
printf '"""Generated from protos/asyncrl/v1 by scripts/gen_protos.sh; do not edit."""\n' > "$out/__init__.py"
