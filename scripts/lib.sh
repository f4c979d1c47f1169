# Shared helpers of the project's scripts; source it, do not run it.
# Sets ROOT, and puts a hatch of a pinned version on PATH (bootstrapping it into .tools/
# with nothing but python3 and pip when it is missing).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HATCH_VERSION="1.18.2"
PYTHON="${PYTHON:-python3}"

log() { printf '\n==> %s\n' "$*" >&2; }

ensure_hatch() {
  local tools="$ROOT/.tools"
  if [ ! -x "$tools/bin/hatch" ] || ! "$tools/bin/hatch" --version 2>/dev/null | grep -F "$HATCH_VERSION" >/dev/null; then
    log "bootstrapping hatch $HATCH_VERSION into .tools/"
    "$PYTHON" -m venv "$tools"
    "$tools/bin/python" -m pip install --quiet "hatch==$HATCH_VERSION"
  fi
  export PATH="$tools/bin:$PATH"
  # Environments live inside the checkout: a fresh clone never reuses a stale one.
  export HATCH_DATA_DIR="${HATCH_DATA_DIR:-$ROOT/.tools/hatch-data}"
  export PIP_DISABLE_PIP_VERSION_CHECK=1
}

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; elif command -v sudo >/dev/null 2>&1; then sudo "$@"; else
    echo "need root (or sudo) to run: $*" >&2; return 1; fi
}

# ensure_apt PACKAGE COMMAND...: install the Debian packages unless every command exists.
ensure_apt() {
  local missing=0 cmd
  local packages="$1"; shift
  for cmd in "$@"; do command -v "$cmd" >/dev/null 2>&1 || missing=1; done
  [ "$missing" -eq 0 ] && return 0
  log "installing Debian packages: $packages"
  if [ ! -f "$ROOT/.tools/apt-updated" ]; then
    as_root apt-get update -qq && mkdir -p "$ROOT/.tools" && touch "$ROOT/.tools/apt-updated"
  fi
  # shellcheck disable=SC2086
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $packages >/dev/null
}

DEEPSPEED_VERSION="0.19.8"

# ensure_deepspeed ENV: install DeepSpeed into the hatch environment ENV unless it is there.
# Its sdist's build imports torch: build it against the environment's torch, without
# isolation. JIT-built ops go to .tools/torch-extensions, reused by later runs.
ensure_deepspeed() {
  local env="$1"
  export TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$ROOT/.tools/torch-extensions}"
  hatch env create "$env" >/dev/null 2>&1 || true
  if ! hatch run "$env":python -c "import deepspeed" >/dev/null 2>&1; then
    log "installing DeepSpeed $DEEPSPEED_VERSION into the $env environment"
    hatch run "$env":python -m pip install --quiet --no-build-isolation "deepspeed==$DEEPSPEED_VERSION"
  fi
}
