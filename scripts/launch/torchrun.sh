#!/usr/bin/env bash
# Run a program under real torchrun on loopback.
#   torchrun.sh one  PROGRAM ARGS...   one node, 2 ranks
#   torchrun.sh two  PROGRAM ARGS...   two node agents on 127.0.0.1, 2 ranks each (world 4)
#   torchrun.sh restart static|c10d PROGRAM ARGS...
#                                      one node, 2 ranks, restarted after a failure
#                                      (--max-restarts ${COMM_MAX_RESTARTS:-1}), with the
#                                      default (static) or the c10d rendezvous
#   torchrun.sh agent PORT PROGRAM ARGS...
#                                      one node agent of an elastic job (--nnodes 1:2, one
#                                      rank, c10d on 127.0.0.1:PORT): start it twice for two
#                                      nodes; a node lost or joining restarts the workers
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
  restart)
    rdzv="$1"; shift
    port=$("$py" "$ROOT/scripts/launch/free_port.py")
    common=(--nnodes 1 --nproc-per-node 2 --max-restarts "${COMM_MAX_RESTARTS:-1}" --monitor-interval 0.1)
    case "$rdzv" in
      static) common+=(--master-addr 127.0.0.1 --master-port "$port") ;;
      c10d) common+=(--rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$port" --rdzv-id "job-$port") ;;
      *) echo "usage: torchrun.sh restart static|c10d PROGRAM ARGS..." >&2; exit 2 ;;
    esac
    exec timeout "${COMM_LAUNCH_TIMEOUT:-240}" "$py" -m torch.distributed.run "${common[@]}" "$@" ;;
  agent)
    port="$1"; shift
    # torch 2.13's agents share one worker store across rendezvous rounds; a node that joins
    # later waits for the store's address under the new round, which the first node never
    # writes there (the join times out after 60 s). A store per round avoids it.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    exec timeout "${COMM_LAUNCH_TIMEOUT:-240}" "$py" -m torch.distributed.run \
      --nnodes 1:2 --nproc-per-node 1 --max-restarts "${COMM_MAX_RESTARTS:-3}" \
      --monitor-interval 0.1 --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$port" \
      --rdzv-id "elastic-$port" --rdzv-conf join_timeout=60,last_call_timeout=1 "$@" ;;
  *) echo "usage: torchrun.sh one|two|restart|agent ..." >&2; exit 2 ;;
esac
