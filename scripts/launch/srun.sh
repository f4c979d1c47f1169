#!/usr/bin/env bash
# Run a program on 2 tasks under srun from a single-node Slurm on this machine.
# Installs slurm-wlm and munge when missing. When no Slurm daemon runs here, it starts a
# private one-node cluster: its configuration, state and pid files live in a private
# temporary folder named by SLURM_CONF (never /etc/slurm/slurm.conf, which it leaves alone),
# and the daemons it started are stopped, and the folder removed, on exit. When Slurm runs
# here already (slurmctld and slurmd), it uses that cluster as configured.
#   srun.sh PROGRAM ARGS...
source "$(dirname "${BASH_SOURCE[0]}")/../lib.sh"
ensure_apt "slurm-wlm munge" srun slurmctld slurmd munged
py="${PYTHON_RANK:-python}"
host=$(hostname -s)
started=()   # pids of the daemons this script started; stopped on exit
private=""   # the private folder of a cluster this script started
cleanup() {
  local pid
  for pid in "${started[@]}"; do as_root kill "$pid" 2>/dev/null || true; done
  if [ -n "$private" ]; then
    for _ in $(seq 20); do  # the daemons leave before their folder goes
      alive=0
      for pid in "${started[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
      [ "$alive" = 0 ] && break
      sleep 0.25
    done
    as_root rm -rf "$private"
  fi
}
trap cleanup EXIT

running() { pgrep -x "$1" >/dev/null; }
if running slurmctld && running slurmd; then
  log "srun.sh: using the Slurm cluster already running here"
elif running slurmctld || running slurmd; then
  echo "FAIL: srun.sh: only one of slurmctld / slurmd runs here; it neither starts the" \
    "other (that would mix two configurations) nor touches this Slurm." >&2
  exit 1
else
  private=$(as_root mktemp -d /tmp/comm-slurm.XXXXXX)  # mode 0700
  mem=$(awk '/MemAvailable/ {print int($2 / 1024 / 2)}' /proc/meminfo)
  as_root mkdir -p "$private/state" "$private/spool" /run/munge
  as_root tee "$private/slurm.conf" >/dev/null <<CONF
ClusterName=local
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$private/state
SlurmdSpoolDir=$private/spool
SlurmctldPidFile=$private/slurmctld.pid
SlurmdPidFile=$private/slurmd.pid
SlurmctldLogFile=$private/slurmctld.log
SlurmdLogFile=$private/slurmd.log
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
  export SLURM_CONF="$private/slurm.conf"  # the daemons, sinfo and srun all read this one
  if ! running munged; then
    as_root chown munge:munge /run/munge 2>/dev/null || true
    if [ ! -s /etc/munge/munge.key ]; then
      as_root sh -c 'dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key 2>/dev/null && chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key'
    fi
    as_root munged --force 2>/dev/null || as_root munged
    started+=($(pgrep -x -n munged))
  fi
  as_root env SLURM_CONF="$SLURM_CONF" slurmctld
  as_root env SLURM_CONF="$SLURM_CONF" slurmd
  for _ in $(seq 40); do  # the pid files appear once the daemons are up
    [ -s "$private/slurmctld.pid" ] && [ -s "$private/slurmd.pid" ] && break
    sleep 0.25
  done
  for name in slurmctld slurmd; do
    [ -s "$private/$name.pid" ] && started+=("$(cat "$private/$name.pid")")
  done
  started+=($(pgrep -x slurmscriptd || true))
fi
for _ in $(seq 60); do
  state=$(sinfo -h -o %t 2>/dev/null | head -1 || true)
  case "$state" in idle|mix|alloc) break ;; esac
  sleep 0.5
done
export GLOO_SOCKET_IFNAME=lo
timeout 120 srun -N1 -n2 --time=5 "$py" "$@"
