#!/usr/bin/env bash
# Run a program on 2 tasks under srun from a single-node Slurm on this machine.
# Installs slurm-wlm and munge when missing, writes a one-node configuration, starts the
# daemons that are not running, and stops again those it started.
#   srun.sh PROGRAM ARGS...
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
ensure_apt "slurm-wlm munge" srun slurmctld slurmd munged
py="${PYTHON_RANK:-python}"
host=$(hostname -s)
started=()   # names of the daemons this script started; stopped by pid on exit
cleanup() {
  local name pid
  for name in "${started[@]}"; do
    for pid in $(pgrep -x "$name"); do as_root kill "$pid" 2>/dev/null || true; done
  done
}
trap cleanup EXIT

if ! pgrep -x slurmctld >/dev/null; then
  mem=$(awk '/MemAvailable/ {print int($2 / 1024 / 2)}' /proc/meminfo)
  as_root mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /run/munge /var/log/slurm
  as_root tee /etc/slurm/slurm.conf >/dev/null <<CONF
ClusterName=local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
NodeName=$host CPUs=$(nproc) RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
fi
if ! pgrep -x munged >/dev/null; then
  as_root chown munge:munge /run/munge 2>/dev/null || true
  if [ ! -s /etc/munge/munge.key ]; then
    as_root sh -c 'dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null && chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key'
  fi
  as_root munged --force 2>/dev/null || as_root munged
  started+=(munged)
fi
if ! pgrep -x slurmctld >/dev/null; then
  as_root slurmctld
  started+=(slurmctld slurmscriptd)
fi
if ! pgrep -x slurmd >/dev/null; then
  as_root slurmd
  started+=(slurmd)
fi
for _ in $(seq 60); do
  state=$(sinfo -h -o %t 2>/dev/null | head -1 || true)
  case "$state" in idle|mix|alloc) break ;; esac
  sleep 0.5
done
export GLOO_SOCKET_IFNAME=lo
timeout 120 srun -N1 -n2 --time=5 "$py" "$@"
