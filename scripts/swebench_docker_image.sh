#!/usr/bin/env bash
# Build (or load from cache) the SWE-bench base image offline: no registry is needed.
#
#   scripts/swebench_docker_image.sh            # ensure branchgym/swebench-base:bookworm-<hash> exists
#
# Debian minbase + python3, pytest, pip (with setuptools and wheel), tkinter, git and
# patch, built with debootstrap from the Debian package mirror apt uses, then `docker
# import`ed. pip and setuptools install each repository into an environment image over
# this one (branchgym/envs/swebench/docker_env.py); tkinter is what six's tests import.
# The tag and the cached tarball are named after a hash of PACKAGES: a machine that built
# an image from another list builds this one anew instead of reusing the old one under the
# same name (branchgym's BASE_IMAGE, in docker_backend.py, names the same hash; a test
# checks they agree). The root file system tarball is kept in $BRANCHGYM_CACHE/docker
# (default ~/.cache/branchgym/docker), so a machine that lost its Docker images
# re-imports it in seconds instead of rebuilding (about 2 minutes).
set -euo pipefail

PACKAGES="python3,python3-pytest,python3-pip,python3-tk,git,patch,ca-certificates"
PACKAGES_HASH="$(printf '%s' "$PACKAGES" | sha256sum | cut -c1-8)"
SUITE="${BRANCHGYM_DEBIAN_SUITE:-bookworm}"
IMAGE="${BRANCHGYM_DOCKER_IMAGE:-branchgym/swebench-base:$SUITE-$PACKAGES_HASH}"
CACHE="${BRANCHGYM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/branchgym}/docker"
TARBALL="$CACHE/swebench-base-$SUITE-$PACKAGES_HASH.tar"

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "swebench image: $IMAGE present"
    exit 0
fi

import_tarball() {
    docker import \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
        --change 'ENV LANG=C.UTF-8' \
        --change 'WORKDIR /testbed' \
        --change 'CMD ["sleep", "infinity"]' \
        --change "LABEL branchgym.packages=$PACKAGES" \
        "$TARBALL" "$IMAGE" >/dev/null
    echo "swebench image: imported $IMAGE from $TARBALL"
}

if [ -s "$TARBALL" ]; then
    import_tarball
    exit 0
fi

# The mirror apt already uses (deb822 or one-line sources), else Debian's default.
MIRROR="$(grep -hoE '^(URIs:|deb) +https?://[^ ]+' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list 2>/dev/null \
    | grep -v security | head -1 | awk '{print $2}' || true)"
MIRROR="${MIRROR:-http://deb.debian.org/debian}"
command -v debootstrap >/dev/null || { echo "debootstrap is missing (apt-get install debootstrap)" >&2; exit 1; }

mkdir -p "$CACHE"
ROOTFS="$(mktemp -d "${TMPDIR:-/tmp}/branchgym-rootfs.XXXXXX")"
trap 'rm -rf "$ROOTFS"' EXIT
echo "swebench image: debootstrap $SUITE from $MIRROR (about 2 minutes)"
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" "$MIRROR" >"$CACHE/debootstrap.log" 2>&1 \
    || { tail -20 "$CACHE/debootstrap.log" >&2; exit 1; }
# What an image does not need: downloaded .debs, package lists, docs, manuals, locales.
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* \
    "$ROOTFS"/usr/share/doc "$ROOTFS"/usr/share/man "$ROOTFS"/usr/share/locale \
    "$ROOTFS"/usr/share/info
mkdir -p "$ROOTFS/testbed"
tar --numeric-owner -C "$ROOTFS" -cf "$TARBALL.tmp" .
mv "$TARBALL.tmp" "$TARBALL"
import_tarball
