#!/usr/bin/env bash
# shellcheck disable=SC2016  # single-quoted scripts for bash -c expand in the child, on purpose
# Bring up a real SLURM cluster with accounting on this machine, as root, from nothing or from any
# half-started state. Idempotent: with everything up it only checks and runs the smoke jobs.
#
#   deploy/slurm/up.sh [--nodes 1|2|3] [--no-smoke]
#
# Layout: munged, MariaDB, slurmdbd and slurmctld in the root namespaces; nodes n1[, n2[, n3]], each a
# slurmd in its own network + UTS + mount namespace, joined by a bridge on a private /24 with no
# default route. Partition "debug" (default) holds every node; each node declares NODE_CPUS CPUs.
# The accounts in ACCOUNTS (alice and bob) exist on every node: the nodes share the host's files.
# See docs/slurm.md for the why of each piece.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

NODES=$DEFAULT_NODES
SMOKE=1
while [ $# -gt 0 ]; do
  case $1 in
    --nodes) NODES=${2:?--nodes needs 1, 2 or 3}; shift 2 ;;
    --nodes=*) NODES=${1#--nodes=}; shift ;;
    --no-smoke) SMOKE=0; shift ;;
    -h | --help) sed -n '3,11p' "$0"; exit 0 ;;
    *) die "unknown argument: $1" ;;
  esac
done
case $NODES in 1 | 2 | 3) ;; *) die "--nodes must be 1, 2 or 3, not $NODES" ;; esac
[ "$(uname -s)" = Linux ] || die "needs Linux (network namespaces)"
[ "$(id -u)" = 0 ] || die "needs root"

NODE_IDS=$(seq 1 "$NODES")
NODE_LIST=$(for i in $NODE_IDS; do node_name "$i"; done | paste -sd,)
CTL_HOST=$(hostname -s)

install_packages() {
  local need=0 cmd
  for cmd in slurmctld slurmd slurmdbd sinfo munged mariadbd ip nsenter unshare; do
    command -v "$cmd" >/dev/null 2>&1 || need=1
  done
  [ $need = 1 ] || return 0
  log "installing slurm-wlm, munge, slurmdbd, mariadb-server"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  # iproute2: ip/bridge; util-linux: nsenter/unshare (already essential, named for clarity).
  apt-get install -y -qq --no-install-recommends slurm-wlm munge slurmdbd mariadb-server \
    iproute2 util-linux >/dev/null
}

make_dirs() {
  install -d -o slurm -g slurm /run/slurm /var/lib/slurm/slurmctld /var/log/slurm
  install -d -o munge -g munge -m 0755 /run/munge
  install -d -o mysql -g mysql /run/mysqld
  install -d "$RUN_DIR"
  local i
  for i in $NODE_IDS; do install -d "/var/spool/slurmd/$(node_name "$i")"; done
}

# put_file SRC DEST OWNER MODE: install SRC at DEST only when it differs; returns 0 when it changed.
put_file() {
  if [ -f "$2" ] && cmp -s "$1" "$2"; then
    rm -f "$1"
    return 1
  fi
  install -o "$3" -g "$3" -m "$4" "$1" "$2"
  rm -f "$1"
}

SLURM_CONF_CHANGED=0
DBD_CONF_CHANGED=0
HOSTS_CHANGED=0
write_configs() {
  local tmp node_lines="" i
  install -d "$CONF_DIR"
  for i in $NODE_IDS; do
    node_lines+="NodeName=$(node_name "$i") NodeAddr=$(node_addr "$i") NodeHostname=$(node_name "$i")"
    node_lines+=" CPUs=$NODE_CPUS RealMemory=$REAL_MEM_MB State=UNKNOWN"$'\n'
  done
  tmp=$(mktemp)
  sed -e "s|@CLUSTER@|$SLURM_CLUSTER|" -e "s|@CTL_HOST@|$CTL_HOST|" -e "s|@CTL_ADDR@|$CTL_ADDR|" \
    -e "s|@MAX_ARRAY_SIZE@|$MAX_ARRAY_SIZE|" -e "s|@NODE_LIST@|$NODE_LIST|" -e "s|@MAX_TIME@|$MAX_TIME|" \
    "$HERE/slurm.conf.in" | awk -v lines="$node_lines" '$0 == "@NODE_LINES@" { printf "%s", lines; next } 1' \
    >"$tmp"
  put_file "$tmp" "$CONF_DIR/slurm.conf" root 0644 && SLURM_CONF_CHANGED=1
  tmp=$(mktemp)
  cp "$HERE/slurmdbd.conf.in" "$tmp"
  put_file "$tmp" "$CONF_DIR/slurmdbd.conf" slurm 0600 && DBD_CONF_CHANGED=1
  # The hosts file every node namespace sees: the controller and all nodes by their bridge addresses,
  # so MASTER_ADDR=n1 resolves to n1's namespace inside a job on n2.
  tmp=$(mktemp)
  {
    echo "127.0.0.1 localhost"
    echo "$CTL_ADDR $CTL_HOST slurmctld"
    for i in $NODE_IDS; do echo "$(node_addr "$i") $(node_name "$i")"; done
  } >"$tmp"
  put_file "$tmp" "$RUN_DIR/hosts" root 0644 && HOSTS_CHANGED=1
  return 0
}

setup_network() {
  local i ns veth
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge
  fi
  ip addr replace "$CTL_ADDR/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  for i in $NODE_IDS; do
    ns=$(node_ns "$i")
    veth=$(node_veth "$i")
    # A name left in /run/netns by a machine that restarted is a plain file, no longer a namespace.
    if [ -e "/run/netns/$ns" ] && ! ip -n "$ns" link show lo >/dev/null 2>&1; then
      log "namespace $ns is stale: making it again"
      ip netns del "$ns" 2>/dev/null || rm -f "/run/netns/$ns"
    fi
    [ -e "/run/netns/$ns" ] || ip netns add "$ns"
    if ! ip link show "$veth" >/dev/null 2>&1; then
      ip link add "$veth" type veth peer name eth0 netns "$ns"
    fi
    ip link set "$veth" master "$BRIDGE" up
    ip -n "$ns" link set lo up
    ip -n "$ns" addr replace "$(node_addr "$i")/24" dev eth0
    ip -n "$ns" link set eth0 up
  done
}

start_munge() {
  if pid_alive /run/munge/munged.pid munged; then return 0; fi
  log "starting munged"
  if [ ! -s /etc/munge/munge.key ]; then  # as for MariaDB: the package made it, an image may not hold it
    log "no munge key: making one"
    install -d -o munge -g munge -m 0700 /etc/munge
    runuser -u munge -- mungekey --create --keyfile=/etc/munge/munge.key
  fi
  runuser -u munge -- /usr/sbin/munged
  wait_for 10 "munge" bash -c 'munge -n | unmunge'
}

start_mariadb() {
  if ! mariadb-admin --connect-timeout=1 ping >/dev/null 2>&1; then
    # The package makes the system tables when it is installed; a machine image can hold the package
    # with an empty data folder, and mariadbd then aborts ("Can't open and lock privilege tables").
    if [ ! -d /var/lib/mysql/mysql ]; then
      log "MariaDB's data folder has no system tables: making them"
      install -d -o mysql -g mysql /var/lib/mysql
      mariadb-install-db --user=mysql --datadir=/var/lib/mysql --skip-test-db >>/var/log/slurm/mariadb.log 2>&1
    fi
    log "starting MariaDB"
    # Unix socket only: slurmdbd talks to it as "localhost", nothing listens on TCP.
    setsid mariadbd --user=mysql --skip-networking --pid-file=/run/mysqld/mysqld.pid \
      --socket=/run/mysqld/mysqld.sock </dev/null >>/var/log/slurm/mariadb.log 2>&1 &
    wait_for 30 "MariaDB" mariadb-admin --connect-timeout=1 ping
  fi
  mariadb -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
    CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED VIA unix_socket;
    GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
}

dbd_listening() { (exec 3<>/dev/tcp/127.0.0.1/6819) 2>/dev/null; }

start_slurmdbd() {
  if pid_alive /run/slurm/slurmdbd.pid slurmdbd; then
    [ $DBD_CONF_CHANGED = 1 ] || return 0
    log "slurmdbd.conf changed: restarting slurmdbd"
    stop_pidfiles 30 /run/slurm/slurmdbd.pid:slurmdbd
  fi
  log "starting slurmdbd"
  slurmdbd
  wait_for 30 "slurmdbd on port 6819" dbd_listening
}

start_slurmctld() {
  if pid_alive /run/slurm/slurmctld.pid slurmctld; then
    [ $SLURM_CONF_CHANGED = 1 ] || return 0
    log "slurm.conf changed: restarting slurmctld"
    stop_pidfiles 30 /run/slurm/slurmctld.pid:slurmctld
  fi
  log "starting slurmctld"
  slurmctld
  wait_for 30 "slurmctld" bash -c 'scontrol ping | grep -q UP'
}

start_slurmd() {
  local i=$1 name ns pidfile
  name=$(node_name "$i")
  ns=$(node_ns "$i")
  pidfile=/run/slurm/slurmd-$name.pid
  if pid_alive "$pidfile" slurmd; then
    [ $SLURM_CONF_CHANGED = 1 ] || [ $HOSTS_CHANGED = 1 ] || return 0
    stop_pidfiles 10 "$pidfile:slurmd"
  fi
  log "starting slurmd $name in namespace $ns"
  # Not `ip netns exec`: it remounts /sys and slurmd then fails ("No filesystem mounted on
  # /sys/fs/cgroup"). nsenter joins only the network namespace; unshare gives the node its own
  # hostname and a mount namespace (slave: later host mounts still show) for its own /etc/hosts.
  nsenter --net="/run/netns/$ns" unshare --uts --mount --propagation slave \
    bash -c 'hostname "$1" && mount --bind "$2" /etc/hosts && exec slurmd -N "$1"' _ "$name" "$RUN_DIR/hosts"
}

# Nodes beyond --nodes (a 3-node cluster brought up again with --nodes 2) go away entirely.
remove_extra_nodes() {
  local i
  for ((i = NODES + 1; i <= MAX_NODES; i++)); do
    stop_pidfiles 10 "/run/slurm/slurmd-$(node_name "$i").pid:slurmd"
    ip link del "$(node_veth "$i")" 2>/dev/null || true
    [ -e "/run/netns/$(node_ns "$i")" ] && ip netns del "$(node_ns "$i")"
  done
  return 0
}

nodes_idle() {
  local states
  states=$(sinfo -h -N -p debug -o '%N %T' 2>/dev/null) || return 1
  [ "$(grep -c ' idle$' <<<"$states")" = "$NODES" ]
}

wait_nodes_idle() {
  local i
  for ((i = 0; i < 150; i++)); do
    nodes_idle && return 0
    # A node left down or drained in the state files from an earlier run does not come back by itself.
    if ((i == 25)); then
      scontrol update nodename="$NODE_LIST" state=resume >/dev/null 2>&1 || true
    fi
    sleep 0.2
  done
  sinfo -N >&2 || true
  die "nodes did not become idle"
}

smoke() {
  local out id id2 hosts want state i
  want=$(for i in $NODE_IDS; do node_name "$i"; done | paste -sd' ')
  out=$(srun -N "$NODES" --ntasks-per-node=1 -t 1 -J smoke bash -c 'echo "$SLURM_JOB_ID $(hostname)"')
  id=$(head -n1 <<<"$out" | cut -d' ' -f1)
  hosts=$(cut -d' ' -f2 <<<"$out" | sort | paste -sd' ')
  [ "$hosts" = "$want" ] || die "srun ran on '$hosts', expected '$want'"
  id2=$(sbatch --parsable -N "$NODES" -t 1 -J smoke -o /dev/null --wrap 'srun hostname')
  for ((i = 0; i < 100; i++)); do
    state=$(sacct -n -X -P -j "$id,$id2" -o State 2>/dev/null | paste -sd' ')
    [ "$state" = "COMPLETED COMPLETED" ] && break
    sleep 0.2
  done
  [ "$state" = "COMPLETED COMPLETED" ] || die "smoke jobs $id, $id2 not COMPLETED in sacct: '$state'"
  log "smoke: srun job $id ran on $hosts; sbatch job $id2 and accounting OK"
}

ensure_accounts() {  # users whose jobs run as themselves (service.accounts); home folders of their own
  local name
  for name in $ACCOUNTS; do
    id -u "$name" >/dev/null 2>&1 || useradd --create-home --shell /bin/bash "$name"
  done
}

# On failure, say what the daemons said: CI keeps only this script's output.
explain_failure() {
  local rc=$? file
  [ "$rc" = 0 ] && return 0
  log "failed (exit status $rc); the daemons' last words:"
  for file in /var/log/slurm/mariadb.log /var/log/slurm/slurmdbd.log /var/log/slurm/slurmctld.log \
    /var/log/slurm/slurmd-n*.log; do
    [ -f "$file" ] || continue
    echo "---- tail $file" >&2
    tail -n 15 "$file" >&2
  done
  echo "---- daemons running" >&2
  pgrep -a 'munged|mariadbd|slurmdbd|slurmctld|slurmd' >&2 || true
  echo "---- sinfo" >&2
  timeout 5 sinfo -N -o '%N %T %E' >&2 || true
  exit "$rc"
}
trap explain_failure EXIT

REAL_MEM_MB=$(awk '/^MemTotal:/ { print int($2 / 1024 * 0.9) }' /proc/meminfo)
install_packages
ensure_accounts
make_dirs
write_configs
setup_network
remove_extra_nodes
start_munge
start_mariadb
start_slurmdbd
start_slurmctld
for i in $NODE_IDS; do start_slurmd "$i"; done
wait_nodes_idle
[ $SMOKE = 0 ] || smoke
log "up: cluster $SLURM_CLUSTER, controller $CTL_HOST ($CTL_ADDR), partition debug, nodes $NODE_LIST" \
  "(${NODE_CPUS} CPUs each), MaxArraySize=$MAX_ARRAY_SIZE, in $(elapsed)s"
sinfo
