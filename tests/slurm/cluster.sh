#!/usr/bin/env bash
# A private single-host Slurm cluster with two emulated nodes (n1, n2) for the Slurm test tier.
#
#   bash tests/slurm/cluster.sh start DIR   # installs Slurm with apt-get when missing (root only), starts it
#   bash tests/slurm/cluster.sh stop DIR
#
# Everything the cluster needs lives in DIR: slurm.conf, a munge key and socket, state, spool, logs and PID
# files, on free ports; the host's /etc/slurm, /etc/munge, /etc/hosts and any running Slurm are never
# touched. Clients find it through SLURM_CONF=DIR/slurm.conf (printed last on success). Exit status 3 means
# "Slurm cannot be installed or started here"; the reason is the last line printed.
set -uo pipefail

fail() { echo "CANNOT START: $*"; exit 3; }
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }  # daemons are checked by pid file

stop() {
  local dir=$1
  for pid in "$dir"/slurmd-n1.pid "$dir"/slurmd-n2.pid "$dir"/slurmctld.pid "$dir"/munge/munged.pid; do
    alive "$pid" && kill "$(cat "$pid")" 2>/dev/null
  done
  return 0
}

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Both nodes are this host (NodeHostname=localhost, NodeAddr=127.0.0.1): no name needs to resolve.
# config_overrides: Slurm believes these CPU counts, not the hardware, so 2-tasks-per-node jobs fit anywhere.
config() {
  local dir=$1 cpus=$2
  cat <<CONF
ClusterName=lh$(basename "$dir" | tr -dc 'a-z0-9' | tail -c 20)
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$(free_port)
SlurmUser=root
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.sock
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobRequeue=1
ReturnToService=2
MpiDefault=none
SlurmdParameters=config_overrides
PlugStackConfig=$dir/plugstack.conf
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmdSpoolDir=$dir/spool-%n
StateSaveLocation=$dir/state
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$(free_port) CPUs=$cpus State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=$(free_port) CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
}

start() {
  local dir=$1
  if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    [ "$(id -u)" = 0 ] || fail "Slurm is not installed and installing it needs root"
    command -v apt-get >/dev/null || fail "Slurm is not installed and there is no apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends slurm-wlm munge slurm-client >/dev/null 2>&1 \
      || { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends slurm-wlm munge slurm-client >/dev/null 2>&1; } \
      || fail "apt-get could not install slurm-wlm munge slurm-client"
  fi
  # slurmd runs jobs as their users and must be root; munged refuses loose permissions on its files
  [ "$(id -u)" = 0 ] || fail "a private Slurm cluster needs root (slurmd starts jobs as their users)"
  mkdir -p "$dir"/munge "$dir"/state "$dir"/spool-n1 "$dir"/spool-n2 "$dir"/log || fail "cannot create $dir"
  chmod 711 "$dir" "$dir"/munge
  head -c 1024 /dev/urandom > "$dir"/munge/munge.key && chmod 600 "$dir"/munge/munge.key
  : > "$dir"/plugstack.conf
  # Not `nproc`: it honours OMP_NUM_THREADS, and nodes of 1 CPU would leave 2-task jobs pending for ever
  local cpus
  cpus=$(getconf _NPROCESSORS_ONLN 2>/dev/null)
  [ "${cpus:-0}" -ge 2 ] 2>/dev/null || cpus=2
  config "$dir" "$cpus" > "$dir"/slurm.conf
  export SLURM_CONF="$dir"/slurm.conf
  munged --force --socket="$dir"/munge/munge.sock --key-file="$dir"/munge/munge.key \
    --pid-file="$dir"/munge/munged.pid --log-file="$dir"/munge/munged.log --seed-file="$dir"/munge/munged.seed \
    || fail "munged did not start (see $dir/munge/munged.log)"
  slurmctld -i -f "$SLURM_CONF" || fail "slurmctld did not start (see $dir/log/slurmctld.log)"
  slurmd -N n1 -f "$SLURM_CONF" || fail "slurmd n1 did not start (see $dir/log/slurmd-n1.log)"
  slurmd -N n2 -f "$SLURM_CONF" || fail "slurmd n2 did not start (see $dir/log/slurmd-n2.log)"
  for _ in $(seq 60); do
    if [ "$(sinfo -h -N -o '%N %t' 2>/dev/null | grep -c ' idle')" = 2 ]; then
      sinfo -N -o '%N %t %c'
      echo "SLURM_CONF=$SLURM_CONF"
      exit 0
    fi
    sleep 0.5
  done
  sinfo -N 2>&1
  tail -5 "$dir"/log/slurmctld.log 2>&1
  stop "$dir"
  fail "the emulated nodes did not come up idle"
}

case "${1:-}" in
  start) [ -n "${2:-}" ] || { echo "usage: $0 start|stop DIR"; exit 2; }; start "$2" ;;
  stop) [ -n "${2:-}" ] || { echo "usage: $0 start|stop DIR"; exit 2; }; stop "$2" ;;
  *) echo "usage: $0 start|stop DIR"; exit 2 ;;
esac
