# shellcheck shell=bash disable=SC2034  # sourced: the names are used by up.sh and down.sh
# Shared by up.sh and down.sh: names, addresses and small helpers. Sourced, never run.
# Every name can be overridden from the environment, e.g. TORCHYARD_SLURM_NET=10.78.0 up.sh.

SLURM_CLUSTER=${TORCHYARD_SLURM_CLUSTER:-torchyard}
NET=${TORCHYARD_SLURM_NET:-10.77.0}          # a private /24 used only inside our own namespaces
BRIDGE=${TORCHYARD_SLURM_BRIDGE:-tyslurm0}
CTL_ADDR="$NET.1"                            # the bridge's address: slurmctld as the nodes see it
NODE_CPUS=${TORCHYARD_SLURM_CPUS:-4}         # declared, more than the real cores (config_overrides)
MAX_ARRAY_SIZE=${TORCHYARD_SLURM_MAX_ARRAY_SIZE:-1001}
MAX_TIME=${TORCHYARD_SLURM_MAX_TIME:-1-00:00:00}  # partition limit, so "time over the limit" is testable
MAX_NODES=3                                  # the most nodes this layout can hold (n3: a spare)
DEFAULT_NODES=2                              # what up.sh builds without --nodes (the tests' layout)
ACCOUNTS=${TORCHYARD_SLURM_ACCOUNTS-alice bob}  # Unix accounts jobs can run as (the isolation tests')
RUN_DIR=/run/torchyard-slurm                 # the hosts file the node namespaces see
CONF_DIR=/etc/slurm
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

node_name() { echo "n$1"; }
node_addr() { echo "$NET.$((10 + $1))"; }
node_ns() { echo "tyslurm-n$1"; }
node_veth() { echo "tyslurm-n$1"; }  # root-side end; 15 characters at most

log() { printf '[slurm %5.1fs] %s\n' "$(elapsed)" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
START_NS=$(date +%s%N)
elapsed() { awk -v s="$START_NS" -v n="$(date +%s%N)" 'BEGIN { printf "%.1f", (n - s) / 1e9 }'; }

# pid_alive PIDFILE NAME: the pid file names a live process whose command is NAME.
pid_alive() {
  local pid state
  [ -r "$1" ] || return 1
  pid=$(cat "$1" 2>/dev/null) || return 1
  [ -n "$pid" ] && [ -r "/proc/$pid/comm" ] && [ "$(cat "/proc/$pid/comm")" = "$2" ] || return 1
  # A daemon killed a moment ago stays a zombie until its parent reaps it: that is not alive.
  state=$(sed 's/.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1) || return 1
  [ "$state" != Z ]
}

# stop_pidfiles SECONDS PIDFILE:NAME...: TERM them all at once (each takes ~2 s to go), wait for them,
# KILL any still there after SECONDS.
stop_pidfiles() {
  local secs=$1 spec pids=() pid i
  shift
  for spec in "$@"; do
    if pid_alive "${spec%%:*}" "${spec#*:}"; then
      pid=$(cat "${spec%%:*}")
      kill "$pid" 2>/dev/null && pids+=("$pid")
    fi
    rm -f "${spec%%:*}"
  done
  for pid in "${pids[@]}"; do
    for ((i = 0; i < secs * 10; i++)); do
      [ -d "/proc/$pid" ] || break
      sleep 0.1
    done
    if [ -d "/proc/$pid" ]; then
      log "$(cat "/proc/$pid/comm" 2>/dev/null) ($pid) did not stop in ${secs}s: KILL"
      kill -9 "$pid" 2>/dev/null || true
    fi
  done
}

# wait_for SECONDS WHAT COMMAND...: poll COMMAND every 0.2 s until it succeeds.
wait_for() {
  local secs=$1 what=$2 i
  shift 2
  for ((i = 0; i < secs * 5; i++)); do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.2
  done
  log "ERROR: timed out after ${secs}s waiting for $what"
  return 1
}
