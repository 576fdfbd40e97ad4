#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for the SlurmJob tests: munged + slurmctld + slurmd
# from Debian's slurm-wlm and munge, configured in STATE_DIR (one partition "debug", this host as
# its only node). Everything it starts is stopped by `stop`, through the pid files in STATE_DIR.
#
#   scripts/slurm-local.sh start STATE_DIR    # prints the SLURM_CONF to export for sbatch/squeue
#   scripts/slurm-local.sh stop STATE_DIR
#
# Needs root (slurmd runs jobs as their user) and the packages: scripts/install-test-daemons.sh.
set -euo pipefail
cmd="${1:?usage: slurm-local.sh start|stop STATE_DIR}"
dir="$(mkdir -p "${2:?usage: slurm-local.sh start|stop STATE_DIR}" && cd "$2" && pwd)"
conf="$dir/slurm.conf"

stop_pid() {  # stop the daemon whose pid file is $1 (only if that file names a live process)
  [ -f "$1" ] || return 0
  local pid; pid="$(cat "$1")"
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$1"
}

case "$cmd" in
start)
  for tool in slurmctld slurmd munged sbatch; do
    command -v "$tool" >/dev/null || { echo "slurm-local: $tool is missing; run scripts/install-test-daemons.sh" >&2; exit 2; }
  done
  host="$(hostname -s)"
  cpus="$(nproc)"
  mkdir -p "$dir/ctld" "$dir/d" "$dir/munge" "$dir/log"
  # munge: our own daemon, key and socket, so nothing outside STATE_DIR is touched
  [ -f "$dir/munge/munge.key" ] || { dd if=/dev/urandom of="$dir/munge/munge.key" bs=1 count=1024 status=none; chmod 400 "$dir/munge/munge.key"; }
  munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/socket" \
         --pid-file="$dir/munge/munged.pid" --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed"
  cat > "$conf" <<EOF
ClusterName=monarchnb
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$((16817 + $$ % 1000))
SlurmdPort=$((17817 + $$ % 1000))
AuthType=auth/munge
AuthInfo=socket=$dir/munge/socket
CredType=cred/munge
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/d
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
NodeName=$host CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
EOF
  export SLURM_CONF="$conf"
  slurmctld -f "$conf"
  slurmd -f "$conf"
  for _ in $(seq 100); do  # ready when the node is idle
    state="$(sinfo -h -o %t 2>/dev/null || true)"
    [ "$state" = "idle" ] && break
    sleep 0.2
  done
  [ "$state" = "idle" ] || { echo "slurm-local: the node is '$state', not idle; see $dir/log" >&2; exit 1; }
  echo "$conf"
  ;;
stop)
  export SLURM_CONF="$conf"
  [ -f "$conf" ] && scancel --user="$(id -un)" >/dev/null 2>&1 || true
  stop_pid "$dir/slurmd.pid"
  stop_pid "$dir/slurmctld.pid"
  stop_pid "$dir/munge/munged.pid"
  ;;
*)
  echo "usage: slurm-local.sh start|stop STATE_DIR" >&2
  exit 2
  ;;
esac
