#!/usr/bin/env bash
# shellcheck disable=SC2016  # single-quoted scripts for bash -c expand in the child, on purpose
# Stop the cluster that up.sh started: slurmd(s), slurmctld, slurmdbd, MariaDB, munged, then the
# namespaces and the bridge. Packages, configs and SLURM's state (job ids, accounting) stay, so the
# next up.sh is quick; --purge also wipes that state, and job ids start again from 1.
#
#   deploy/slurm/down.sh [--purge]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

PURGE=0
case ${1:-} in
  --purge) PURGE=1 ;;
  "") ;;
  *) die "unknown argument: $1 (only --purge)" ;;
esac
[ "$(id -u)" = 0 ] || die "needs root"

# Jobs still queued or running are cancelled, so the accounting says what became of them and no job
# process is left behind in a namespace that is about to go.
if pid_alive /run/slurm/slurmctld.pid slurmctld; then
  jobs=$(squeue -h -o %A 2>/dev/null | paste -sd' ') || jobs=""
  if [ -n "$jobs" ]; then
    log "cancelling jobs: $jobs"
    # shellcheck disable=SC2086  # one word per job id
    scancel $jobs 2>/dev/null || true
    wait_for 15 "jobs to end" bash -c '[ -z "$(squeue -h -o %A)" ]' || true
  fi
fi

# slurmctld saves its state on TERM; job records it could not hand to slurmdbd yet are kept in that
# state and sent on the next start, so all SLURM daemons may stop together.
daemons=(/run/slurm/slurmctld.pid:slurmctld /run/slurm/slurmdbd.pid:slurmdbd)
for ((i = 1; i <= MAX_NODES; i++)); do daemons+=("/run/slurm/slurmd-$(node_name "$i").pid:slurmd"); done
stop_pidfiles 30 "${daemons[@]}"
if [ $PURGE = 1 ] && mariadb-admin --connect-timeout=1 ping >/dev/null 2>&1; then
  mariadb -e "DROP DATABASE IF EXISTS slurm_acct_db"
fi
stop_pidfiles 60 /run/mysqld/mysqld.pid:mariadbd /run/munge/munged.pid:munged

for ((i = 1; i <= MAX_NODES; i++)); do
  # Whatever still runs inside a node's namespace (a job step slurmd left) was started by this cluster.
  if [ -e "/run/netns/$(node_ns "$i")" ]; then
    for pid in $(ip netns pids "$(node_ns "$i")"); do kill -9 "$pid" 2>/dev/null || true; done
  fi
  ip link del "$(node_veth "$i")" 2>/dev/null || true
  if [ -e "/run/netns/$(node_ns "$i")" ]; then ip netns del "$(node_ns "$i")"; fi
done
ip link del "$BRIDGE" 2>/dev/null || true
rm -rf "$RUN_DIR"

if [ $PURGE = 1 ]; then
  rm -rf /var/lib/slurm/slurmctld/* /var/spool/slurmd/*
  log "purged SLURM state and accounting"
fi
log "down in $(elapsed)s"
