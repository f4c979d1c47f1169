#!/usr/bin/env bash
# Run a program under real torchrun on loopback.
#   torchrun.sh one  PROGRAM ARGS...   one node, 2 ranks
#   torchrun.sh two  PROGRAM ARGS...   two node agents on 127.0.0.1, 2 ranks each (world 4)
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
mode="$1"; shift
py="${PYTHON_RANK:-python}"
export GLOO_SOCKET_IFNAME=lo OMP_NUM_THREADS=1
case "$mode" in
  one)
    exec timeout 120 "$py" -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node 2 "$@" ;;
  two)
    port=$("$py" "$ROOT/scripts/launch/free_port.py")
    common=(--nnodes 2 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port "$port")
    timeout 120 "$py" -m torch.distributed.run "${common[@]}" --node-rank 0 "$@" & a=$!
    timeout 120 "$py" -m torch.distributed.run "${common[@]}" --node-rank 1 "$@" & b=$!
    status=0
    wait "$a" || status=$?
    wait "$b" || status=$?
    exit "$status" ;;
  *) echo "usage: torchrun.sh one|two PROGRAM ARGS..." >&2; exit 2 ;;
esac
