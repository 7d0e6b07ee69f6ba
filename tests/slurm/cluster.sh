#!/usr/bin/env bash
# A single-host Slurm cluster with two emulated nodes (n1, n2) for the Slurm test tier.
#   bash tests/slurm/cluster.sh start   # installs Slurm with apt-get when missing (root only), starts daemons
#   bash tests/slurm/cluster.sh stop
# Exit status 3 means "Slurm cannot be installed or started here" (the tier is skipped with this output).
set -uo pipefail

skip() { echo "SKIP: $*"; exit 3; }
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }  # daemons are checked by pid file

stop() {
  for pid in /run/slurmd-n1.pid /run/slurmd-n2.pid /run/slurmctld.pid; do
    alive "$pid" && kill "$(cat "$pid")" 2>/dev/null
    rm -f "$pid"
  done
  return 0
}

# slurm.conf for two emulated nodes with $1 CPUs each. config_overrides: Slurm believes these numbers,
# not the hardware, so the 2-tasks-per-node test jobs fit on any host.
config() {
  cat <<CONF
ClusterName=lightninghybrid
SlurmctldHost=localhost
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobRequeue=1
ReturnToService=2
MpiDefault=none
SlurmdParameters=config_overrides
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd-%n.pid
SlurmdSpoolDir=/var/spool/slurmd-%n
StateSaveLocation=/var/spool/slurmctld
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
NodeName=n1 NodeAddr=127.0.0.1 Port=17001 CPUs=$1 State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 Port=17002 CPUs=$1 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
}

start() {
  if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    [ "$(id -u)" = 0 ] || skip "Slurm is not installed and installing it needs root"
    command -v apt-get >/dev/null || skip "Slurm is not installed and there is no apt-get"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y --no-install-recommends slurm-wlm munge slurm-client >/dev/null 2>&1 \
      || { apt-get update >/dev/null 2>&1 && apt-get install -y --no-install-recommends slurm-wlm munge slurm-client >/dev/null 2>&1; } \
      || skip "apt-get could not install slurm-wlm munge slurm-client"
  fi
  [ "$(id -u)" = 0 ] || { sinfo >/dev/null 2>&1 && exit 0; skip "no running Slurm and starting one needs root"; }
  # Not `nproc`: it honours OMP_NUM_THREADS, and nodes of 1 CPU would leave the test jobs pending for ever
  # (Reason=PartitionConfig).
  cpus=$(getconf _NPROCESSORS_ONLN 2>/dev/null)
  [ "${cpus:-0}" -ge 2 ] 2>/dev/null || cpus=2
  conf=$(config "$cpus")
  if alive /run/slurmctld.pid && alive /run/slurmd-n1.pid && alive /run/slurmd-n2.pid \
      && [ "$conf" = "$(cat /etc/slurm/slurm.conf 2>/dev/null)" ]; then
    sinfo -h -o %T | grep -qv down && exit 0
  fi
  stop
  grep -qE '(^|\s)n1(\s|$)' /etc/hosts || echo "127.0.0.1 n1 n2" >> /etc/hosts
  mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd-n1 /var/spool/slurmd-n2 /var/log/slurm /run/munge
  printf '%s\n' "$conf" > /etc/slurm/slurm.conf
  chown munge:munge /run/munge 2>/dev/null
  if ! pgrep -u munge munged >/dev/null 2>&1; then
    runuser -u munge -- munged 2>/dev/null || su -s /bin/sh munge -c munged || skip "munged did not start"
  fi
  slurmctld -i || skip "slurmctld did not start (see /var/log/slurm/slurmctld.log)"
  slurmd -N n1 || skip "slurmd n1 did not start"
  slurmd -N n2 || skip "slurmd n2 did not start"
  for _ in $(seq 60); do
    if sinfo -h -N -o '%N %t' | grep -q "n1 idle" && sinfo -h -N -o '%N %t' | grep -q "n2 idle"; then
      sinfo -N -o '%N %t %c'; exit 0
    fi
    sleep 0.5
  done
  sinfo -N 2>&1; skip "the emulated nodes did not come up idle"
}

case "${1:-start}" in
  start) start ;;
  stop) stop ;;
  *) echo "usage: $0 start|stop"; exit 2 ;;
esac
