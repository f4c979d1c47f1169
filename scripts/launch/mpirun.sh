#!/usr/bin/env bash
# Run a program on 2 ranks under Open MPI's mpirun (installed when missing).
#   mpirun.sh PROGRAM ARGS...
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
ensure_apt "openmpi-bin" mpirun
py="${PYTHON_RANK:-python}"
port=$("$py" "$ROOT/scripts/launch/free_port.py")
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_btl=self,tcp OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo
forward=(-x MASTER_ADDR=127.0.0.1 -x MASTER_PORT="$port" -x GLOO_SOCKET_IFNAME=lo -x PATH)
[ -n "${PYTHONPATH:-}" ] && forward+=(-x PYTHONPATH)
exec timeout 120 mpirun --oversubscribe -np 2 "${forward[@]}" "$py" "$@"
