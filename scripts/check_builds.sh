#!/usr/bin/env bash
# Build every package (sdist and wheel) and check that each wheel ships py.typed.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"
out="$ROOT/dist"
rm -rf "$out"
for pkg in packages/*/; do
  name=$(basename "$pkg")
  module=${name//-/_}
  (cd "$pkg" && hatch build -t wheel -t sdist "$out" >/dev/null)
  wheel=$(ls "$out"/"${module}"-*.whl)
  # Ask zipfile directly: a listing piped into `grep -q` can die of SIGPIPE under pipefail.
  if ! "$PYTHON" -c 'import sys, zipfile; sys.exit(sys.argv[2] not in zipfile.ZipFile(sys.argv[1]).namelist())' \
      "$wheel" "$module/py.typed"; then
    echo "FAIL: $wheel does not contain $module/py.typed" >&2; exit 1
  fi
  echo "ok: $(basename "$wheel") holds $module/py.typed"
done
