#!/usr/bin/env bash
# Build a minimal Debian bookworm base image with Python, without any image registry:
#   debootstrap a root filesystem, then `docker import` it.
# Usage: docker/make_base_image.sh [TAG]   (default tag: pagoda-base:bookworm)
# Env:   DEBIAN_MIRROR (default http://deb.debian.org/debian), FORCE=1 to rebuild an existing tag,
#        BASE_PACKAGES (default python3,python3-venv,python3-pip,ca-certificates).
set -euo pipefail
TAG=${1:-pagoda-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
SUITE=bookworm
PKGS=${BASE_PACKAGES:-python3,python3-venv,python3-pip,ca-certificates}

if [ "${FORCE:-0}" != 1 ] && docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "base image $TAG exists (FORCE=1 to rebuild)"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "need debootstrap (apt-get install debootstrap)" >&2; exit 1; }

ROOT=$(mktemp -d /tmp/pagoda-rootfs.XXXXXX)
trap 'rm -rf "$ROOT"' EXIT
echo "debootstrap $SUITE ($PKGS) from $MIRROR into $ROOT"
debootstrap --variant=minbase --include="$PKGS" "$SUITE" "$ROOT" "$MIRROR"

# Same apt sources as a stock debian:bookworm image, so `apt-get install` works in derived images.
rm -f "$ROOT/etc/apt/sources.list"
cat >"$ROOT/etc/apt/sources.list.d/debian.sources" <<SRC
Types: deb
URIs: $MIRROR
Suites: $SUITE $SUITE-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${MIRROR%/debian}/debian-security
Suites: $SUITE-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
# Slim it down: package caches, docs, man pages, locales other than C.
chroot "$ROOT" apt-get clean
rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*.bin \
       "$ROOT"/usr/share/doc/* "$ROOT"/usr/share/man/* "$ROOT"/usr/share/info/* \
       "$ROOT"/var/log/*.log "$ROOT"/var/cache/debconf/*-old
find "$ROOT/usr/share/locale" -mindepth 1 -maxdepth 1 ! -name 'C*' -exec rm -rf {} + 2>/dev/null || true

tar -C "$ROOT" --numeric-owner -c . | docker import \
  --change 'ENV LANG=C.UTF-8' \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' \
  --message "debootstrap $SUITE minbase + $PKGS" \
  - "$TAG"
docker run --rm "$TAG" sh -c 'if command -v python3 >/dev/null; then python3 -c "import sys, venv, ssl; print(\"base ok:\", sys.version.split()[0])"; else echo "base ok (no python)"; fi'
docker image ls "$TAG"
