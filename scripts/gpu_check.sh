#!/usr/bin/env bash
# One command for a GPU machine: set up a CUDA torch environment (the `newest` hatch
# environment: every layer, DeepSpeed, torch 2.14.1's CUDA build) and run every CUDA test
# of every layer, then print a table per layer.
#
#   bash scripts/gpu_check.sh [PYTEST ARGS...]
#
# The tests size their worlds to the machine: nccl worlds of one rank per GPU where there
# are several, a world of one under nccl (and gloo with CUDA tensors) where there is one.
# Without a GPU every test skips with its reason and the script exits 1.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"
ensure_hatch
ensure_apt "g++" g++
ensure_deepspeed newest
PY="$(hatch env find newest)/bin/python"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  log "no CUDA device is usable here (torch.cuda.is_available() is False): nothing to check"
  exit 1
fi
"$PY" -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda, '|', torch.cuda.device_count(), 'x', torch.cuda.get_device_name(0))"
out="$ROOT/.tools/gpu-check"
rm -rf "$out" && mkdir -p "$out"
layers=(
  "comm-collectives:tests/collectives/test_gpu.py"
  "comm-wrappers:tests/wrappers/test_cuda.py"
  "comm-wrappers[deepspeed]:tests/wrappers_deepspeed/test_cuda.py"
  "comm-strategies:tests/strategies/test_cuda.py"
)
status=0
start=$(date +%s)
for entry in "${layers[@]}"; do
  name="${entry%%:*}"; tests="${entry#*:}"
  log "CUDA tests: $name ($tests)"
  timeout 900 "$PY" -m pytest -q "$tests" --junitxml "$out/${name//[^a-z-]/_}.xml" "$@" || status=1
done
log "CUDA tests done in $(( $(date +%s) - start )) s"
"$PY" - "$out" <<'PYEOF'
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

print(f"| {'layer':<26} | {'passed':>6} | {'failed':>6} | {'skipped':>7} | {'seconds':>7} |")
print(f"|{'-' * 28}|{'-' * 8}|{'-' * 8}|{'-' * 9}|{'-' * 9}|")
for report in sorted(Path(sys.argv[1]).glob("*.xml")):
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, failed = int(suite.get("tests", 0)), int(suite.get("failures", 0)) + int(suite.get("errors", 0))
    skipped = int(suite.get("skipped", 0))
    print(
        f"| {report.stem:<26} | {total - failed - skipped:>6} | {failed:>6} | {skipped:>7} | "
        f"{float(suite.get('time', 0)):>7.1f} |"
    )
PYEOF
exit "$status"
