#!/usr/bin/env bash
# Install the built wheels the way a user does, into clean virtual environments (nothing
# editable, nothing from the checkout), and run a two-rank torchrun smoke run in each:
#   core:        torch and numpy at the declared floor (NUMPY_FLOOR), then comm-core alone
#                (scripts/smoke_layers.py core);
#   collectives: the same, then comm-collectives alone (scripts/smoke_layers.py collectives);
# and of every wrapper (scripts/smoke_wrappers.py):
#   plain:     torch, then comm-wrappers;
#   deepspeed: torch, setuptools, wheel, ninja, then comm-wrappers[deepspeed] without build
#              isolation (DeepSpeed ships only an sdist whose build imports torch).
# comm-core and comm-collectives must resolve from the local wheels in dist/ (checked in
# pip's install report), third-party packages from the registry. Uses the wheels that
# scripts/check_builds.sh left in dist/ (it is run here when there are none).
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"
TORCH_VERSION="2.13.0"
NUMPY_FLOOR="1.24.4"  # comm-core and comm-collectives declare numpy>=1.24: the floor runs here
base="$ROOT/.tools/install-check"
export PIP_DISABLE_PIP_VERSION_CHECK=1
start=$(date +%s)

if ! compgen -G "dist/comm_wrappers-*.whl" >/dev/null; then
  log "no wheels in dist/: building them"
  ensure_hatch
  bash scripts/check_builds.sh
fi
wheel_of() {  # wheel_of MODULE: the one wheel of MODULE in dist/
  local found=(dist/"$1"-*.whl)
  if [ "${#found[@]}" -ne 1 ] || [ ! -f "${found[0]}" ]; then
    echo "FAIL: expected one $1 wheel in dist/, found: ${found[*]}" >&2; exit 1
  fi
  echo "$ROOT/${found[0]}"
}
wrappers_wheel=$(wheel_of comm_wrappers)
core_wheel=$(wheel_of comm_core)
collectives_wheel=$(wheel_of comm_collectives)

# pip is not installed into the environments (saves ~5 s each): this Python's pip installs
# into them with --python. Installs skip byte-compiling (torch has thousands of modules,
# ~15 s of CPU); the smoke run compiles what it imports, so PYTHONDONTWRITEBYTECODE is
# lifted for it.
pip_version=$("$PYTHON" -m pip --version | awk '{print $2}')
if [ "$(printf '%s\n22.3\n' "$pip_version" | sort -V | head -1)" != "22.3" ]; then
  echo "FAIL: $PYTHON has pip $pip_version; pip >= 22.3 is needed (pip --python)" >&2; exit 1
fi
mkdir -p "$base"
constraints="$base/constraints.txt"
# torch pinned: anything else downloads a CUDA build of gigabytes (docs: shared/ENVIRONMENT.md).
printf 'torch==%s\ndeepspeed==%s\n' "$TORCH_VERSION" "$DEEPSPEED_VERSION" >"$constraints"

pip_into() {  # pip_into VENV ARGS...: run pip install ARGS into VENV, quietly, bounded
  local venv="$1"; shift
  timeout 900 "$PYTHON" -m pip --python "$venv/bin/python" install -qq --no-compile \
    -c "$constraints" "$@"
}

new_venv() {  # new_venv NAME: a clean, empty environment (no pip); prints its path
  local venv="$base/$1"
  rm -rf "$venv"
  "$PYTHON" -m venv --without-pip "$venv"
  echo "$venv"
}

# check_report REPORT: the comm packages were installed from dist/, torch was not touched.
check_report() {
  "$PYTHON" - "$1" "$ROOT/dist" <<'EOF'
import json, sys
from pathlib import Path

report, dist = sys.argv[1], Path(sys.argv[2]).as_uri()
installed = {i["metadata"]["name"]: i["download_info"]["url"] for i in json.load(open(report))["install"]}
bad = [f"{name} from {url}" for name, url in installed.items() if name.startswith("comm-") and not url.startswith(dist + "/")]
missing = [n for n in ("comm-core", "comm-collectives", "comm-wrappers") if n not in installed]
if "torch" in installed:
    bad.append(f"torch installed again from {installed['torch']}")
if bad or missing:
    sys.exit(f"FAIL: install report: {'; '.join(bad)} missing: {missing}")
print(f"ok: comm-core, comm-collectives, comm-wrappers installed from dist/; also {len(installed) - 3} third-party packages")
EOF
}

# smoke VENV ARGS...: the two-rank smoke run with VENV's Python and tools (torchrun, ninja).
smoke() {
  local venv="$1"; shift
  env -u PYTHONDONTWRITEBYTECODE PATH="$venv/bin:$PATH" \
    timeout 300 "$venv/bin/python" "$ROOT/scripts/smoke_wrappers.py" --timeout 240 "$@"
}

# check_layer_report REPORT NAMES...: exactly these comm packages, from dist/; torch untouched.
check_layer_report() {
  "$PYTHON" - "$ROOT/dist" "$@" <<'EOF'
import json, sys
from pathlib import Path

dist, report, expected = Path(sys.argv[1]).as_uri(), sys.argv[2], sys.argv[3:]
installed = {i["metadata"]["name"]: i["download_info"]["url"] for i in json.load(open(report))["install"]}
comm = sorted(name for name in installed if name.startswith("comm-"))
bad = [f"{name} from {url}" for name, url in installed.items() if name.startswith("comm-") and not url.startswith(dist + "/")]
if "torch" in installed:
    bad.append(f"torch installed again from {installed['torch']}")
if bad or comm != sorted(expected):
    sys.exit(f"FAIL: install report: {'; '.join(bad)}; comm packages {comm}, expected {expected}")
print(f"ok: {', '.join(comm)} installed alone from dist/")
EOF
}

check_layer() {  # check_layer core|collectives
  local layer="$1" t0 venv
  t0=$(date +%s)
  venv=$(new_venv "$layer")
  if [ "$layer" = core ]; then
    pip_into "$venv" "torch==$TORCH_VERSION" "numpy==$NUMPY_FLOOR"
    pip_into "$venv" --find-links "$ROOT/dist" --report "$base/$layer-report.json" "$core_wheel"
    check_layer_report "$base/$layer-report.json" comm-core
  else
    pip_into "$venv" "torch==$TORCH_VERSION" "numpy==$NUMPY_FLOOR"
    pip_into "$venv" --find-links "$ROOT/dist" --report "$base/$layer-report.json" \
      "$collectives_wheel"
    check_layer_report "$base/$layer-report.json" comm-core comm-collectives
  fi
  timeout 120 "$PYTHON" -m pip --python "$venv/bin/python" check
  env -u PYTHONDONTWRITEBYTECODE PATH="$venv/bin:$PATH" \
    timeout 240 "$venv/bin/python" "$ROOT/scripts/smoke_layers.py" "$layer" --timeout 180
  log "comm-$layer alone: installed and checked in $(( $(date +%s) - t0 )) s"
}

check_plain() {
  local t0 venv
  t0=$(date +%s)
  venv=$(new_venv plain)
  pip_into "$venv" "torch==$TORCH_VERSION"
  pip_into "$venv" --find-links "$ROOT/dist" --report "$base/plain-report.json" "$wrappers_wheel"
  check_report "$base/plain-report.json"
  timeout 120 "$PYTHON" -m pip --python "$venv/bin/python" check
  smoke "$venv"
  log "comm-wrappers: installed and checked in $(( $(date +%s) - t0 )) s"
}

check_deepspeed() {
  local t0 venv csrc key extensions
  t0=$(date +%s)
  venv=$(new_venv deepspeed)
  pip_into "$venv" "torch==$TORCH_VERSION" setuptools wheel ninja
  pip_into "$venv" --no-build-isolation --find-links "$ROOT/dist" \
    --report "$base/deepspeed-report.json" "${wrappers_wheel}[deepspeed]"
  check_report "$base/deepspeed-report.json"
  timeout 120 "$PYTHON" -m pip --python "$venv/bin/python" check
  # DeepSpeed JIT-builds its shared-memory op (~25 s) into TORCH_EXTENSIONS_DIR. ninja
  # rebuilds when a source is newer than the build, and each install writes the sources
  # anew: give them a fixed time, and key the folder by their content and torch's version,
  # so later runs reuse the build and a changed DeepSpeed builds afresh. Not the folder of
  # the hatch environments: their include paths differ, so each would rebuild the other's.
  csrc="$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")"
  csrc="$csrc/deepspeed/ops/csrc"
  [ -d "$csrc" ] || { echo "FAIL: no DeepSpeed sources at $csrc" >&2; return 1; }
  find "$csrc" -exec touch -h -d "2000-01-01 00:00:00 UTC" {} +
  key=$( (cd "$csrc" && find . -type f -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
    echo "torch $TORCH_VERSION") | sha256sum | cut -c1-16)
  extensions="$ROOT/.tools/torch-extensions/install-check"
  mkdir -p "$extensions"
  find "$extensions" -mindepth 1 -maxdepth 1 ! -name "$key" -exec rm -rf {} +
  # A lock left by a killed build makes every later build wait; nothing else uses this folder.
  find "$extensions" -name lock -delete
  TORCH_EXTENSIONS_DIR="$extensions/$key" smoke "$venv" --deepspeed
  log "comm-wrappers[deepspeed]: installed and checked in $(( $(date +%s) - t0 )) s"
}

log "install checks: comm-core alone, then comm-collectives alone, in clean environments"
check_layer core
check_layer collectives

# Both at once (~30 % less time on two cores): the plain check prints as it goes, the
# DeepSpeed check's output follows when both are done. (Background jobs, not `|| status=$?`,
# under which bash would ignore set -e inside the functions.)
log "install checks: comm-wrappers and comm-wrappers[deepspeed], each in a clean environment"
deepspeed_log="$base/deepspeed.log"
check_deepspeed >"$deepspeed_log" 2>&1 &
deepspeed_pid=$!
check_plain &
plain_pid=$!
trap 'kill "$plain_pid" "$deepspeed_pid" 2>/dev/null || true' EXIT
plain_status=0
wait "$plain_pid" || plain_status=$?
deepspeed_status=0
wait "$deepspeed_pid" || deepspeed_status=$?
trap - EXIT
log "comm-wrappers[deepspeed] (its output, from the run beside the one above)"
cat "$deepspeed_log"
if [ "$plain_status" -ne 0 ] || [ "$deepspeed_status" -ne 0 ]; then
  echo "FAIL: install checks: comm-wrappers exit $plain_status," \
    "comm-wrappers[deepspeed] exit $deepspeed_status" >&2
  exit 1
fi
log "install checks passed in $(( $(date +%s) - start )) s"

# ---------------------------------------------------------------- comm-strategies
# comm-strategies from its wheel into the environments above (the wrappers' checks left
# them): its data file must be in the wheel, and the demo runs single, ddp and fsdp2 for
# one epoch on 2 local ranks; with the deepspeed extra, DeepSpeed too.
if compgen -G "dist/comm_strategies-*.whl" >/dev/null; then
  strategies_wheel=$(wheel_of comm_strategies)
  t0=$(date +%s)
  log "install check: comm-strategies (and [deepspeed]) from the wheel"
  pip_into "$base/plain" --find-links "$ROOT/dist" "$strategies_wheel"
  timeout 120 "$PYTHON" -m pip --python "$base/plain/bin/python" check
  env -u PYTHONDONTWRITEBYTECODE PATH="$base/plain/bin:$PATH" timeout 300 \
    "$base/plain/bin/python" -m comm_strategies.demo --epochs 1 --strategies single ddp fsdp2
  pip_into "$base/deepspeed" --no-build-isolation --find-links "$ROOT/dist" \
    "${strategies_wheel}[deepspeed]"
  timeout 120 "$PYTHON" -m pip --python "$base/deepspeed/bin/python" check
  extensions=$(find "$ROOT/.tools/torch-extensions/install-check" -mindepth 1 -maxdepth 1 -type d | head -1)
  env -u PYTHONDONTWRITEBYTECODE PATH="$base/deepspeed/bin:$PATH" \
    TORCH_EXTENSIONS_DIR="${extensions:-$ROOT/.tools/torch-extensions/install-check/strategies}" \
    timeout 300 "$base/deepspeed/bin/python" -m comm_strategies.demo --epochs 1 --strategies deepspeed
  log "comm-strategies: installed and checked in $(( $(date +%s) - t0 )) s"
fi
