#!/usr/bin/env bash
# Stop or start slurmctld alone, for fault tests: the nodes (slurmd), slurmdbd and the running jobs stay.
# slurmctld saves its state on TERM and reloads it on start, so jobs outlive the outage; while it is
# down squeue/sbatch/scancel fail (sacct still answers: that is slurmdbd).
#
#   deploy/slurm/controller.sh stop | start | restart [SECONDS_DOWN]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

[ "$(id -u)" = 0 ] || die "needs root"
PIDFILE=/run/slurm/slurmctld.pid

stop() {
  pid_alive "$PIDFILE" slurmctld || { log "slurmctld is not running"; return 0; }
  stop_pidfiles 30 "$PIDFILE:slurmctld"
  log "slurmctld stopped"
}

start() {
  if ! pid_alive "$PIDFILE" slurmctld; then
    slurmctld
  fi
  wait_for 30 "slurmctld" bash -c 'scontrol ping | grep -q UP'
  log "slurmctld up"
}

case ${1:-} in
  stop) stop ;;
  start) start ;;
  restart) stop; sleep "${2:-0}"; start ;;
  *) die "usage: $0 stop | start | restart [SECONDS_DOWN]" ;;
esac
