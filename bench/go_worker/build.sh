#!/usr/bin/env bash
# Builds bench/go_worker/go-worker (gitignored): the Buffer stubs generated from protos/ into
# pb/ (gitignored) with protoc from the project's grpcio-tools and Go's protoc plugins, then
# the worker. Needs `go`; modules and plugins come from the Go module proxy into ~/go.
set -euo pipefail
cd "$(dirname "$0")"
root=../..
export PATH="$(go env GOPATH)/bin:$PATH"
command -v protoc-gen-go >/dev/null || go install google.golang.org/protobuf/cmd/protoc-gen-go@v1.36.12
command -v protoc-gen-go-grpc >/dev/null || go install google.golang.org/grpc/cmd/protoc-gen-go-grpc@v1.5.1
rm -rf pb && mkdir pb
# The protos declare no Go package: map each to this module's pb package.
maps=""
for proto in "$root"/protos/asyncrl/v1/*.proto; do
    maps+=",Masyncrl/v1/$(basename "$proto")=asyncrl.dev/bench/go_worker/pb"
done
"$root"/.venv/bin/python -m grpc_tools.protoc -I "$root/protos" \
    --go_out=pb --go_opt=paths=source_relative${maps} \
    --go-grpc_out=pb --go-grpc_opt=paths=source_relative${maps} \
    "$root"/protos/asyncrl/v1/buffer.proto "$root"/protos/asyncrl/v1/common.proto
mv pb/asyncrl/v1/*.go pb/ && rm -rf pb/asyncrl
go build -o go-worker .
