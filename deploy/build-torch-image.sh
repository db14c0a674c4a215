#!/usr/bin/env bash
# Build the local PyTorch task image (default muster/torch:bookworm): the base image
# (deploy/build-base-image.sh) plus PyTorch for the CPU and its dependencies, from a wheelhouse
# made here with `pip download` (on the build machines torch's wheel is a local file; elsewhere
# pip takes it from the index it is configured with). Used by examples/pytorch-allreduce.
#
# Usage: deploy/build-torch-image.sh [--force]
#   --force   rebuild the image even if it exists (the base image is kept)
# Environment:
#   MUSTER_TORCH_IMAGE  image name (default muster/torch:bookworm)
#   MUSTER_BASE_IMAGE   the base it is built on (default muster/base:bookworm)
#   MUSTER_TORCH        what pip downloads (default "torch==2.13.0 numpy": without numpy, torch
#                       warns on import)
#   PIP                 pip to download with, on Python 3.11 as the image's (default: the project's
#                       .venv/bin/pip, else pip3)
# Exit status: 0 built or already there; 2 a prerequisite is missing (as build-base-image.sh, or
# no pip); 1 anything else failed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
IMAGE="${MUSTER_TORCH_IMAGE:-muster/torch:bookworm}"
BASE="${MUSTER_BASE_IMAGE:-muster/base:bookworm}"
TORCH="${MUSTER_TORCH:-torch==2.13.0 numpy}"
FORCE=0

NAME=build-torch-image
# shellcheck source=deploy/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

for arg in "$@"; do
  case "$arg" in
    --force) FORCE=1 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown argument: $arg (see --help)" ;;
  esac
done

find_pip

need_docker

exit_if_built

MUSTER_BASE_IMAGE="$BASE" "$ROOT/deploy/build-base-image.sh"  # its exit 2 (missing prerequisite) is ours

CTX="$(mktemp -d "${TMPDIR:-/tmp}/muster-torch-image.XXXXXX")"
trap 'rm -rf "$CTX"' EXIT

log "downloading $TORCH and its dependencies with $PIP"
# shellcheck disable=SC2086 # MUSTER_TORCH is a list of requirements
if ! "$PIP" download --disable-pip-version-check -q --only-binary=:all: $TORCH -d "$CTX/wheels" \
    >"$CTX/pip.log" 2>&1; then
  grep -v 'is ignored: it is neither a file nor a directory' "$CTX/pip.log" | tail -n 30 >&2 || true
  die "pip download $TORCH failed"
fi
check_wheels "$CTX/wheels"

# Installed by extracting the wheels here and copying the result into a container of the base,
# committed as the image: one layer, without the wheels themselves (190 MB of them).
SITE=/usr/local/lib/python3.11/dist-packages
mkdir -p "$CTX/site"
for wheel in "$CTX"/wheels/*.whl; do python3 -m zipfile -e "$wheel" "$CTX/site"; done
for lib in "$CTX"/site/*.data/purelib "$CTX"/site/*.data/platlib; do
  if [[ -d "$lib" ]]; then cp -a "$lib"/. "$CTX/site"/; fi
done
rm -rf "$CTX"/site/*.data "$CTX/wheels"

log "building $IMAGE from $BASE with $TORCH; this takes a minute or two"
CID="$(docker create --network none "$BASE" mkdir -p "$SITE")"
trap 'docker rm -f "$CID" >/dev/null 2>&1 || true; rm -rf "$CTX"' EXIT
docker start -a "$CID" >/dev/null || die "cannot make $SITE in a container of $BASE"
docker cp "$CTX/site/." "$CID:$SITE/" >/dev/null || die "docker cp into a container of $BASE failed"
docker commit --change 'CMD ["python3"]' "$CID" "$IMAGE" >/dev/null || die "docker commit failed"

docker run --rm --network none "$IMAGE" \
  python3 -c "import torch, torch.distributed; assert torch.distributed.is_gloo_available()" \
  || die "$IMAGE was built but torch (with gloo) does not import in it"
log "built $IMAGE ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"
