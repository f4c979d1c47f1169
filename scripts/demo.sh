#!/usr/bin/env bash
# Set up everything and run the main job: comm-doctor on local ranks (default 2), which
# prints a per-rank table of the setup and live collective checks.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"
ensure_hatch
hatch run collectives:comm-doctor --nproc "${NPROC:-2}" "$@"
