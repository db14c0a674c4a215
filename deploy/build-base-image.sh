#!/usr/bin/env bash
# Build the local demo/test base image (default muster/base:bookworm) from Debian packages, for
# machines that cannot pull from a registry: debootstrap a minimal bookworm rootfs with Python 3.11
# (same ABI as the host's, so tests can bind-mount host site-packages), then `docker import` it.
#
# Usage: deploy/build-base-image.sh [--force] [--fresh]
#   --force   rebuild the image even if it exists (from the cached rootfs when there is one)
#   --fresh   also re-run debootstrap, replacing the cached rootfs (implies --force)
# Environment:
#   MUSTER_BASE_IMAGE   image name (default muster/base:bookworm)
#   MUSTER_DEBIAN_MIRROR  Debian mirror for debootstrap (default: debootstrap's own default)
# The rootfs tarball is cached under ${XDG_CACHE_HOME:-~/.cache}/muster/ so a rebuild (e.g. after
# `docker rmi`) does not re-run debootstrap. Must run as root on a Debian-like host.
# Exit status: 0 built or already there; 2 a prerequisite is missing (no engine, not root, no
# debootstrap and it cannot be installed); 1 anything else failed.
set -euo pipefail

IMAGE="${MUSTER_BASE_IMAGE:-muster/base:bookworm}"
SUITE=bookworm
PACKAGES=python3-minimal,python3,procps,iproute2,ca-certificates
CACHE_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/muster"
TARBALL="$CACHE_DIR/rootfs-$SUITE-$(echo "$PACKAGES" | md5sum | cut -c1-8).tar"
FORCE=0
FRESH=0

NAME=build-base-image
# shellcheck source=deploy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

for arg in "$@"; do
  case "$arg" in
    --force) FORCE=1 ;;
    --fresh) FORCE=1; FRESH=1 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument: $arg (see --help)" ;;
  esac
done

need_docker

exit_if_built

if [[ $FRESH -eq 1 || ! -s "$TARBALL" ]]; then
  [[ $(id -u) -eq 0 ]] || missing "debootstrap needs root"
  if ! command -v debootstrap >/dev/null; then
    log "installing debootstrap"
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y -q debootstrap >/dev/null 2>&1; then
      apt-get update -q >/dev/null || missing "apt-get update failed; cannot install debootstrap"
      apt-get install -y -q debootstrap >/dev/null || missing "cannot install debootstrap"
    fi
  fi
  mkdir -p "$CACHE_DIR"
  ROOTFS="$(mktemp -d "$CACHE_DIR/rootfs.XXXXXX")"
  # --one-file-system: never descend into a /proc or /sys a failed debootstrap left mounted.
  trap 'rm -rf --one-file-system "$ROOTFS" "$TARBALL.partial"' EXIT
  log "debootstrap $SUITE into $ROOTFS (packages: $PACKAGES); this takes a minute"
  # shellcheck disable=SC2086  # the mirror is optional: unquoted so that empty means "absent"
  if ! debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$ROOTFS" ${MUSTER_DEBIAN_MIRROR:-} \
      >"$CACHE_DIR/debootstrap.log" 2>&1; then
    tail -n 20 "$CACHE_DIR/debootstrap.log" >&2 || true
    die "debootstrap failed (full log: $CACHE_DIR/debootstrap.log)"
  fi
  # Trim what a container never needs: apt lists and caches, docs, man pages.
  rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/cache/apt/archives/*.deb \
         "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/*
  tar -C "$ROOTFS" -c . >"$TARBALL.partial"
  mv "$TARBALL.partial" "$TARBALL"
  rm -rf --one-file-system "$ROOTFS"
  trap - EXIT
  log "cached rootfs at $TARBALL ($(du -h "$TARBALL" | cut -f1))"
else
  log "using cached rootfs $TARBALL"
fi

OLD_ID="$(docker image inspect -f '{{.Id}}' "$IMAGE" 2>/dev/null || true)"
log "importing $IMAGE"
docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'CMD ["/bin/bash"]' \
  - "$IMAGE" <"$TARBALL" >/dev/null || die "docker import failed"

docker run --rm --network none "$IMAGE" python3 -c 'import sys; assert sys.version_info[:2] == (3, 11)' \
  || die "$IMAGE was imported but python3 does not run in it"
if [[ -n "$OLD_ID" && "$OLD_ID" != "$(docker image inspect -f '{{.Id}}' "$IMAGE")" ]]; then
  docker rmi "$OLD_ID" >/dev/null 2>&1 || true  # the replaced image, unless containers still use it
fi
log "built $IMAGE"
