#!/usr/bin/env bash
# Set up everything and run comm-doctor on local ranks (default 2): a per-rank table of the
# setup, the live collective checks and one DDP training step of comm-wrappers.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"
ensure_hatch
status=0
hatch run wrappers:comm-doctor --nproc "${NPROC:-2}" "$@" || status=$?
# The checks above ran in the wrappers environment; DeepSpeed lives where scripts/demo.sh
# (the strategies environment) or the test suite (deepspeed, newest) installed it.
echo
echo "DeepSpeed in this checkout's environments:"
for env in wrappers deepspeed strategies newest; do
  dir=$(hatch env find "$env" 2>/dev/null) || continue
  if [ ! -x "$dir/bin/python" ]; then
    printf '  %-11s not created\n' "$env"
    continue
  fi
  found=$("$dir/bin/python" -c "from importlib.metadata import version; print(version('deepspeed'))" 2>/dev/null) || found="not installed"
  printf '  %-11s %s\n' "$env" "$found"
done
exit "$status"
