#!/usr/bin/env bash
# Set up everything and run the main job: a small MLP trained on the handwritten digits
# shipped with comm-strategies, on local CPU ranks (default 2), under each strategy in
# turn (single, ddp, fsdp, fsdp2, deepspeed), with a progress bar and a summary table
# (accuracy, time per step, checkpoint size); the DeepSpeed checkpoint is then loaded for
# evaluation by one plain process. Nothing is downloaded at run time.
# The setup doctor stays its own command: bash scripts/doctor.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"
ensure_hatch
# DeepSpeed builds a small C++ op at its first backend init (cached in .tools/).
ensure_apt "g++" g++
ensure_deepspeed strategies
hatch run strategies:demo --nproc "${NPROC:-2}" "$@"
