#!/usr/bin/env bash
# Build every package (sdist and wheel) and check what each ships: the wheel holds py.typed
# and the licence (.dist-info/licenses/LICENSE), the sdist holds the licence at its top.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"
out="$ROOT/dist"
rm -rf "$out"
for pkg in packages/*/; do
  name=$(basename "$pkg")
  module=${name//-/_}
  (cd "$pkg" && hatch build -t wheel -t sdist "$out" >/dev/null)
  wheel=$(ls "$out"/"${module}"-*.whl)
  sdist=$(ls "$out"/"${module}"-*.tar.gz)
  # Ask zipfile / tarfile directly: a listing piped into `grep -q` can die of SIGPIPE under
  # pipefail.
  "$PYTHON" - "$wheel" "$sdist" "$module" <<'PY'
import sys, tarfile, zipfile
from pathlib import Path

wheel, sdist, module = sys.argv[1:]
names = zipfile.ZipFile(wheel).namelist()
missing = [want for want in (f"{module}/py.typed",) if want not in names]
if not any(n.endswith(".dist-info/licenses/LICENSE") for n in names):
    missing.append("*.dist-info/licenses/LICENSE")
with tarfile.open(sdist) as archive:
    top = Path(sdist).name.removesuffix(".tar.gz")
    if f"{top}/LICENSE" not in archive.getnames():
        missing.append(f"{top}/LICENSE (sdist)")
if missing:
    sys.exit(f"FAIL: {Path(wheel).name} / {Path(sdist).name} lack: {', '.join(missing)}")
print(f"ok: {Path(wheel).name} holds {module}/py.typed and LICENSE; {Path(sdist).name} holds LICENSE")
PY
done
