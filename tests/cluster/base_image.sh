#!/usr/bin/env bash
# Builds container images without any registry: Debian bookworm from a Debian mirror
# (debootstrap --variant=minbase) plus a few of bookworm's packages, as a one-layer image tar
# that both `docker load` and `ctr -n k8s.io images import` read (OCI layout with index.json,
# plus docker-save's manifest.json). Two flavours:
#   python (default): Python 3.11, python3-venv, ca-certificates, tagged
#                     asyncrl.local/debian-python:bookworm: the base of docker/Dockerfile's
#                     targets here, and, as its command is `sleep infinity`, the test node's
#                     pod sandbox ("pause") image;
#   redis:            redis-server, tagged asyncrl.local/redis:bookworm: the managed Redis of
#                     the test node's jobs (the chart's jobs.redis.image).
#
#   bash tests/cluster/base_image.sh [python|redis]           # build if missing; print the path
#   bash tests/cluster/base_image.sh [python|redis] --print   # print the path, build nothing
#
# The tar is cached under ${ASYNCRL_CACHE:-~/.cache/asyncrl}/images, its name keyed on
# IMAGE_VERSION: change the packages or the layout below, bump it. Needs root (debootstrap,
# chroot). Progress goes to stderr; stdout carries only the path.
set -euo pipefail

IMAGE_VERSION=1
SUITE=bookworm
FLAVOUR=python
if [ "${1:-}" = python ] || [ "${1:-}" = redis ]; then
    FLAVOUR=$1
    shift
fi
case $FLAVOUR in
    python) NAME=debian-python; PACKAGES=(python3 python3-venv ca-certificates) ;;
    redis) NAME=redis; PACKAGES=(redis-server) ;;
esac
IMAGE_REF=asyncrl.local/$NAME:$SUITE

CACHE=${ASYNCRL_CACHE:-$HOME/.cache/asyncrl}
OUT=$CACHE/images/$NAME-$SUITE-v$IMAGE_VERSION.tar
if [ "${1:-}" = "--print" ] || [ -s "$OUT" ]; then
    echo "$OUT"
    exit 0
fi

say() { echo "base_image.sh: $*" >&2; }
# One build at a time (images.sh and node.sh prepare may both ask, side by side): a second
# caller waits, then finds the tar.
mkdir -p "$CACHE/images"
exec 7>"$CACHE/images/.$NAME.lock"
flock 7
if [ -s "$OUT" ]; then
    echo "$OUT"
    exit 0
fi
NICE=(nice -n "${ASYNCRL_BUILD_NICE:-19}")
start=$SECONDS

# The Debian mirror this machine already uses (deb822 "URIs:" or one-line "deb URL bookworm").
debian_mirror() {
    local file
    local lists=(/etc/apt/sources.list /etc/apt/sources.list.d/*.sources
                 /etc/apt/sources.list.d/*.list)
    for file in "${lists[@]}"; do
        [ -f "$file" ] || continue
        awk -v suite="$SUITE" '
            /^[[:space:]]*#/ { next }
            /^deb[[:space:]]/ && $0 !~ /security/ {
                for (i = 2; i <= NF; i++)
                    if ($i ~ /^https?:/ && $(i + 1) == suite) { print $i; exit }
            }
            /^URIs:/ { uri = $2 }
            /^Suites:/ && uri != "" && uri !~ /security/ {
                for (i = 2; i <= NF; i++) if ($i == suite) { print uri; exit }
            }
            /^[[:space:]]*$/ { uri = "" }
        ' "$file"
    done | head -n 1
}

MIRROR=${DEBIAN_MIRROR:-$(debian_mirror)}
MIRROR=${MIRROR:-http://deb.debian.org/debian}

if ! command -v debootstrap >/dev/null; then
    say "installing debootstrap"
    { apt-get update -qq && apt-get install -y -qq debootstrap; } >/dev/null 2>&1 \
        || { say "apt-get install debootstrap failed"; exit 1; }
fi

mkdir -p "$CACHE/images"
work=$(mktemp -d "$CACHE/images/.build.XXXXXX")
rootfs=$work/rootfs
# Unmount whatever a failed step left mounted inside the tree before deleting it: rm -rf must
# never walk into the host's /proc, /sys or /dev.
cleanup() {
    local mounts
    mounts=$(awk -v w="$work/" 'index($2, w) == 1 { print $2 }' /proc/mounts | sort -r)
    for m in $mounts; do umount -l "$m" || true; done
    if awk -v w="$work/" 'index($2, w) == 1 { found = 1 } END { exit !found }' /proc/mounts; then
        say "left $work in place: something is still mounted under it"
        return
    fi
    rm -rf "$work"
}
trap cleanup EXIT

say "debootstrap $SUITE from $MIRROR"
"${NICE[@]}" debootstrap --variant=minbase "$SUITE" "$rootfs" "$MIRROR" \
    >"$work/debootstrap.log" 2>&1 \
    || { tail -n 30 "$work/debootstrap.log" >&2; exit 1; }

say "installing ${PACKAGES[*]}"
cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
# Snapshot mirrors serve Release files past their Valid-Until date.
echo 'Acquire::Check-Valid-Until "false";' >"$rootfs/etc/apt/apt.conf.d/99build"
mount -t proc proc "$rootfs/proc"
in_root() { "${NICE[@]}" chroot "$rootfs" env DEBIAN_FRONTEND=noninteractive LC_ALL=C "$@"; }
in_root apt-get update -qq >&2
in_root apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >"$work/apt.log" 2>&1 \
    || { tail -n 30 "$work/apt.log" >&2; exit 1; }
in_root apt-get clean
umount "$rootfs/proc"

# What a container runtime provides at run time, or what only served the build.
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/* "$rootfs"/var/log/* \
    "$rootfs"/tmp/* "$rootfs"/etc/apt/apt.conf.d/99build "$rootfs"/dev/* "$rootfs"/proc/* \
    "$rootfs"/sys/*
: >"$rootfs/etc/resolv.conf"
: >"$rootfs/etc/hostname"
if [ "$FLAVOUR" = python ]; then
    python_version=$(chroot "$rootfs" python3 -c 'import platform; print(platform.python_version())')
else
    python_version=""
fi

say "packing $IMAGE_REF"
layer=$work/layer.tar
"${NICE[@]}" tar -C "$rootfs" --numeric-owner --sort=name -cf "$layer" .
python3 - "$work" "$layer" "$IMAGE_REF" "$python_version" <<'PY'
"""Writes an OCI image layout (index.json) with docker-save's manifest.json beside it."""
import datetime, hashlib, json, os, shutil, sys
from pathlib import Path

work, layer, ref, python_version = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4]
out = work / "image"
blobs = out / "blobs" / "sha256"
blobs.mkdir(parents=True)


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def blob(data):
    digest = hashlib.sha256(data).hexdigest()
    (blobs / digest).write_bytes(data)
    return digest


layer_digest = sha256_file(layer)
shutil.move(layer, blobs / layer_digest)
created = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
config = json.dumps({
    "architecture": "amd64", "os": "linux", "created": created,
    "config": {
        "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "LANG=C.UTF-8"] + ([f"PYTHON_VERSION={python_version}"] if python_version else []),
        "Cmd": ["sleep", "infinity"],
        "WorkingDir": "/",
    },
    "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer_digest}"]},
    "history": [{"created": created, "created_by": "tests/cluster/base_image.sh"}],
}, sort_keys=True).encode()
config_digest = blob(config)
manifest = json.dumps({
    "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
    "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
               "digest": f"sha256:{config_digest}", "size": len(config)},
    "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": f"sha256:{layer_digest}",
                "size": (blobs / layer_digest).stat().st_size}],
}, sort_keys=True).encode()
manifest_digest = blob(manifest)
tag = ref.rsplit(":", 1)[1]
(out / "index.json").write_text(json.dumps({
    "schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
    "manifests": [{
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": f"sha256:{manifest_digest}", "size": len(manifest),
        "platform": {"architecture": "amd64", "os": "linux"},
        # containerd names the image from the first, docker and OCI tools from the second.
        "annotations": {"io.containerd.image.name": ref, "org.opencontainers.image.ref.name": tag},
    }],
}))
(out / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
(out / "manifest.json").write_text(json.dumps([{
    "Config": f"blobs/sha256/{config_digest}", "RepoTags": [ref],
    "Layers": [f"blobs/sha256/{layer_digest}"],
}]))
PY
tar -C "$work/image" -cf "$OUT.partial" oci-layout index.json manifest.json blobs
mv "$OUT.partial" "$OUT"
say "built $(du -h "$OUT" | cut -f1) in $((SECONDS - start))s"
echo "$OUT"
