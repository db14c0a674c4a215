#!/usr/bin/env bash
# Build the local MPI task image (default muster/mpi:bookworm): the base image
# (deploy/build-base-image.sh) plus Debian's Open MPI and mpi4py, installed with apt-get from the
# Debian mirrors (no registry needed). Used by examples/mpi-allreduce and tests/test_mpi.py.
#
# Usage: deploy/build-mpi-image.sh [--force]
#   --force   rebuild the image even if it exists (the base image is kept)
# Environment:
#   MUSTER_MPI_IMAGE    image name (default muster/mpi:bookworm)
#   MUSTER_BASE_IMAGE   the base it is built on (default muster/base:bookworm)
# Exit status: 0 built or already there; 2 a prerequisite is missing (as build-base-image.sh);
# 1 anything else failed.
set -euo pipefail

IMAGE="${MUSTER_MPI_IMAGE:-muster/mpi:bookworm}"
BASE="${MUSTER_BASE_IMAGE:-muster/base:bookworm}"
PACKAGES="openmpi-bin python3-mpi4py"
FORCE=0

NAME=build-mpi-image
# shellcheck source=deploy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

for arg in "$@"; do
  case "$arg" in
    --force) FORCE=1 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument: $arg (see --help)" ;;
  esac
done

need_docker

exit_if_built

MUSTER_BASE_IMAGE="$BASE" "$(dirname "$0")/build-base-image.sh"  # its exit 2 (missing prerequisite) is ours

log "building $IMAGE from $BASE with $PACKAGES (apt-get from the Debian mirrors); this takes a minute or two"
# The host's network: the build reaches the mirrors as the host does (no bridge, no NAT needed).
docker build --network host -t "$IMAGE" - >"${TMPDIR:-/tmp}/build-mpi-image.log" 2>&1 <<DOCKERFILE || {
FROM $BASE
RUN apt-get update -q \\
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $PACKAGES \\
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /usr/share/doc/* /usr/share/man/*
DOCKERFILE
  tail -n 20 "${TMPDIR:-/tmp}/build-mpi-image.log" >&2
  die "docker build failed (full log: ${TMPDIR:-/tmp}/build-mpi-image.log)"
}

docker run --rm --network none "$IMAGE" sh -c 'command -v mpirun >/dev/null && python3 -c "import mpi4py"' \
  || die "$IMAGE was built but mpirun or mpi4py does not run in it"
log "built $IMAGE"
