#!/usr/bin/env bash
# Set up everything and run the whole check suite: lint, types, layer contract, builds,
# docs, the tests of every layer (each in an environment without the layers above; the
# DeepSpeed tests in one with the extra), the real-launcher tests (torchrun, mpirun, srun)
# and a smoke run of the benchmarks; then the layers' tests again on the newest supported
# torch (the `newest` environment).
#
#   bash scripts/test.sh           the whole suite (what CI runs)
#   bash scripts/test.sh --quick   lint, types, the layer contract, the public API and the
#                                  fast tests of every layer (single-process ones and the
#                                  quickest gloo worlds): a few minutes, for a change in
#                                  progress. The whole suite still decides.
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$ROOT"
ensure_hatch

if [ "${1:-}" = "--quick" ]; then
  start=$(date +%s)
  ensure_deepspeed strategies
  log "lint";            hatch run full:lint
  log "types";           hatch run full:types
  log "layer contract";  hatch run full:layers
  log "public API";      hatch run full:api
  log "quick tests: comm-core"
  hatch run core:python -m pytest -q tests/core/test_plain_process.py tests/core/test_init_errors.py \
    tests/core/test_launcher_env.py tests/core/test_attempt.py tests/core/test_cpu_group.py
  log "quick tests: comm-collectives"
  hatch run collectives:python -m pytest -q tests/collectives/test_plain_process.py \
    tests/collectives/test_byte_model.py tests/collectives/test_signature_memo.py \
    tests/collectives/test_collectives.py
  log "quick tests: comm-wrappers"
  hatch run wrappers:python -m pytest -q tests/wrappers/test_api.py tests/wrappers/test_fsdp_policy_names.py
  log "quick tests: comm-strategies"
  hatch run strategies:python -m pytest -q tests/strategies/test_package.py tests/strategies/test_sampler.py \
    tests/strategies/test_strategies_entry_points.py tests/strategies/test_checkpoint_paths.py \
    tests/docs/test_docstring_format.py
  log "quick tier passed in $(( $(date +%s) - start )) s (the whole suite: bash scripts/test.sh)"
  exit 0
fi
ensure_apt "openmpi-bin" mpirun
ensure_apt "slurm-wlm munge" srun slurmctld slurmd munged
# DeepSpeed builds a small C++ op at its first backend init (cached in .tools/).
ensure_apt "g++" g++
ensure_deepspeed deepspeed
ensure_deepspeed strategies
# The newest torch the packages support (2.14.1, a CUDA build of ~5.5 GB): one environment
# with every layer and DeepSpeed, for the layers' tests below.
ensure_deepspeed newest

start=$(date +%s)
log "lint";            hatch run full:lint
log "types";           hatch run full:types
log "layer contract";  hatch run full:layers
log "public API";      hatch run full:api
log "builds";          bash scripts/check_builds.sh
log "installs";        bash scripts/check_installs.sh
log "docs";            hatch run full:docs
log "docstring examples: comm-core";        hatch run core:doctest
log "docstring examples: comm-collectives"; hatch run collectives:doctest
log "docstring examples: comm-wrappers (comm_wrappers.deepspeed skipped: no DeepSpeed)"
hatch run wrappers:doctest
log "docstring examples: comm-wrappers with the deepspeed extra"; hatch run deepspeed:doctest
log "docstring examples: comm-strategies";  hatch run strategies:doctest
log "runnable code blocks of the docs";     hatch run strategies:examples
log "tests: comm-core (environment without the upper layers)"
hatch run core:test
log "tests: comm-collectives (environment without the upper layers)"
hatch run collectives:test
log "tests: fault injection into every collective (one rank fails, every rank raises)"
hatch run collectives:faults
log "tests: comm-wrappers (environment without comm-strategies)"
hatch run wrappers:test
log "tests: comm-wrappers DeepSpeed (environment with the deepspeed extra)"
hatch run deepspeed:test
log "tests: comm-strategies (DeepSpeed and MMEngine installed)"
hatch run strategies:test
log "tests: real launchers"
hatch run core:launchers
# The layers' tests again on the newest supported torch (the packages' ceiling), in one
# environment holding every layer (the layer isolation is checked above, on the pin).
log "tests on the newest supported torch: $(hatch run newest:version)"
log "tests: comm-core on the newest torch";        hatch run newest:core
log "tests: comm-collectives on the newest torch"; hatch run newest:collectives
log "tests: fault injection on the newest torch";  hatch run newest:faults
log "tests: comm-wrappers on the newest torch";    hatch run newest:wrappers
log "tests: comm-wrappers DeepSpeed on the newest torch"; hatch run newest:deepspeed
log "tests: comm-strategies on the newest torch";  hatch run newest:strategies
log "benchmark smoke run"
# A benchmark is not a test: the smoke run checks that the script works. It gets one more
# try after a failure, and the failure stays in the log (every failed rank's traceback).
if ! hatch run full:bench --smoke --out "$ROOT/.tools/bench-smoke"; then
  log "benchmark smoke run failed (report above); running it once more"
  hatch run full:bench --smoke --out "$ROOT/.tools/bench-smoke"
fi
log "benchmark smoke run: wrappers (against raw loops and MMEngine, DeepSpeed included)"
if ! hatch run deepspeed:bench-wrappers --smoke --out "$ROOT/.tools/bench-wrappers-smoke"; then
  log "wrappers benchmark smoke run failed (report above); running it once more"
  hatch run deepspeed:bench-wrappers --smoke --out "$ROOT/.tools/bench-wrappers-smoke"
fi
log "benchmark smoke run: strategies (against raw loops and MMEngine's DDPStrategy)"
if ! hatch run strategies:bench-strategies --smoke --out "$ROOT/.tools/bench-strategies-smoke"; then
  log "strategies benchmark smoke run failed (report above); running it once more"
  hatch run strategies:bench-strategies --smoke --out "$ROOT/.tools/bench-strategies-smoke"
fi
log "benchmark smoke run: checkpoints (against torch.save, DCP, engine.save_checkpoint)"
if ! hatch run strategies:bench-checkpoint --smoke --out "$ROOT/.tools/bench-checkpoint-smoke"; then
  log "checkpoint benchmark smoke run failed (report above); running it once more"
  hatch run strategies:bench-checkpoint --smoke --out "$ROOT/.tools/bench-checkpoint-smoke"
fi
log "benchmark smoke run: checkpoint fixed cost per part, and comm against raw DCP at world 4"
if ! hatch run strategies:bench-checkpoint-cost --smoke --out "$ROOT/.tools/bench-checkpoint-cost-smoke"; then
  log "checkpoint cost benchmark smoke run failed (report above); running it once more"
  hatch run strategies:bench-checkpoint-cost --smoke --out "$ROOT/.tools/bench-checkpoint-cost-smoke"
fi
log "benchmark smoke run: recovery (a rank killed under torchrun --max-restarts, one restart)"
if ! hatch run strategies:bench-recovery --smoke --out "$ROOT/.tools/bench-recovery-smoke"; then
  log "recovery benchmark smoke run failed (report above); running it once more"
  hatch run strategies:bench-recovery --smoke --out "$ROOT/.tools/bench-recovery-smoke"
fi
log "all checks passed in $(( $(date +%s) - start )) s"
