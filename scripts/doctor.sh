#!/usr/bin/env bash
# Set up everything and run comm-doctor on local ranks (default 2): a per-rank table of the
# setup, the live collective checks and one DDP training step of comm-wrappers.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"
ensure_hatch
hatch run wrappers:comm-doctor --nproc "${NPROC:-2}" "$@"
