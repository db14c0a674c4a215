# What deploy/build-*.sh share; sourced, not run. The script sets NAME (how its messages begin)
# first. Exit status, as each script's header says: 1 a failure (die), 2 a prerequisite is
# missing (missing).

log() { echo "$NAME: $*" >&2; }
die() { log "error: $*"; exit 1; }
missing() { log "error: $*"; exit 2; }

# --help: the script's header comment (from its second line to the first line that is not one).
usage() { sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; }

need_docker() {
  command -v docker >/dev/null || missing "docker CLI not found"
  docker info >/dev/null 2>&1 || missing "the Docker engine does not answer (is dockerd running?)"
}

# One run at a time on this machine, until the script exits (where flock(1) is there): a second
# run waits, then finds the image built. Two builds at once broke one another (the first one's
# prune of its dangling install stage removed the layer the second was building on).
one_at_a_time() {
  command -v flock >/dev/null || return 0
  exec 9>"${TMPDIR:-/tmp}/muster-$NAME.lock"
  flock 9 || die "cannot take ${TMPDIR:-/tmp}/muster-$NAME.lock"
}

# PIP: as set, else the project's .venv/bin/pip, else pip3.
find_pip() {
  if [[ -n "${PIP:-}" ]]; then :
  elif [[ -x "$ROOT/.venv/bin/pip" ]]; then PIP="$ROOT/.venv/bin/pip"
  elif command -v pip3 >/dev/null; then PIP=pip3
  else missing "no pip: create the project's virtualenv (python3 -m venv .venv) or set PIP"
  fi
}

# Exit 0 when IMAGE exists and FORCE is 0.
exit_if_built() {
  if [[ $FORCE -eq 0 ]] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
    log "$IMAGE already exists; nothing to do (use --force to rebuild)"
    exit 0
  fi
}

# The wheels in $1 are extracted into an image, not installed (the base has no pip): binary ones
# must fit it (CPython 3.11, glibc, this machine's architecture, as the base is debootstrapped
# natively). Then say what the wheelhouse holds.
check_wheels() {
  local arch wheel tags
  arch="$(uname -m)"
  for wheel in "$1"/*.whl; do
    tags="$(basename "$wheel" .whl | rev | cut -d- -f1-3 | rev)"  # python-abi-platform
    case "$tags" in
      py3-none-any|py2.py3-none-any) ;;
      cp311-cp311-*manylinux*"$arch"*|cp3*-abi3-*manylinux*"$arch"*|py3-none-*manylinux*"$arch"*) ;;
      *) die "$(basename "$wheel") does not fit the image's CPython 3.11 on $arch (is $PIP on Python 3.11?)" ;;
    esac
  done
  log "wheelhouse: $(find "$1" -name '*.whl' | wc -l) wheels, $(du -sh "$1" | cut -f1)"
}
