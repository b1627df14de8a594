#!/usr/bin/env bash
# The whole test suite from nothing, on a fresh Debian 12 machine as root (CI runs exactly this):
#   1. Debian packages: Chromium (dashboard tests), wrk (benchmarks), python3-venv, SLURM + munge + slurmdbd +
#      MariaDB (the real cluster), systemd (systemd-analyze verify of the unit), curl (README
#      examples), PostgreSQL 15 server binaries when missing: one apt-get update,
#      only when something is missing;
#   2. the Python environment (deploy/setup.sh: torch CPU wheel first, then the project), made from
#      the oldest Python the project supports that this machine has (Debian 12's /usr/bin/python3,
#      3.11.2), so that the suite runs where the oldest users run (PYTHON=... picks another);
#   3. the real two-node SLURM cluster (deploy/slurm/up.sh, when present), with the Unix accounts
#      alice and bob, and a Python environment for jobs that run as them (deploy/job-python.sh);
#   4. ruff check, mypy --strict, then pytest with every marker. PostgreSQL is started by the tests
#      (tests/conftest.py, through deploy/postgres/start.sh).
# A missing part fails its tests instead of skipping them (TORCHYARD_TEST_STRICT=1): when SLURM does
# not come up, the slurm tests fail. Every check runs even after one fails; the summary at the end
# lists each step, and the exit status is 0 only when every step passed.
#
#   bash deploy/test.sh [PYTEST ARGS...]      e.g. bash deploy/test.sh -x tests/api
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 1
export TORCHYARD_TEST_STRICT=1
PY=$ROOT/.venv/bin
START=$SECONDS
SUMMARY=()
FAILED=0

log() { echo "[test] $*" >&2; }

# step NAME COMMAND...: run it, time it, record the outcome; never stops the script.
step() {
  local name=$1 began=$SECONDS rc
  shift
  log "---- $name"
  "$@"
  rc=$?
  [ "$name" = pytest ] && [ "$rc" = 5 ] && { log "pytest collected no tests: that is a failure"; rc=1; }
  if [ "$rc" = 0 ]; then
    SUMMARY+=("$(printf '  %-10s ok      %4ds' "$name" $((SECONDS - began)))")
  else
    SUMMARY+=("$(printf '  %-10s FAILED  %4ds  (exit status %s)' "$name" $((SECONDS - began)) "$rc")")
    FAILED=1
  fi
  return "$rc"
}

finish() {
  echo >&2
  log "summary ($((SECONDS - START)) s in all)"
  printf '%s\n' "${SUMMARY[@]}" >&2
  if [ "$FAILED" = 0 ]; then log "PASSED"; else log "FAILED"; fi
  exit "$FAILED"
}

system_packages() {
  local packages=(chromium wrk slurm-wlm munge slurmdbd mariadb-server iproute2 procps systemd curl python3-venv
    slapd ldap-utils nginx)
  local missing=() pkg
  [ -x /usr/lib/postgresql/15/bin/initdb ] || packages+=(postgresql-15)
  for pkg in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  [ ${#missing[@]} = 0 ] && { log "Debian packages already installed"; return 0; }
  if [ "$(id -u)" != 0 ]; then
    log "missing Debian packages (${missing[*]}) and not root: install them first"
    return 1
  fi
  log "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get -o DPkg::Lock::Timeout=300 update -qq &&
    apt-get -o DPkg::Lock::Timeout=300 install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

slurm_cluster() {
  if [ ! -f deploy/slurm/up.sh ]; then
    export TORCHYARD_TEST_SLURM="deploy/slurm/up.sh does not exist"
  elif [ "$(id -u)" != 0 ]; then
    export TORCHYARD_TEST_SLURM="deploy/slurm/up.sh needs root"
  elif bash deploy/slurm/up.sh --nodes 2; then
    export TORCHYARD_TEST_SLURM=up
    return 0
  # State left by an earlier run on this machine is the one thing a second try from nothing can
  # fix; the first try's output above still says what went wrong.
  elif log "deploy/slurm/up.sh failed: purging SLURM's state and trying once more" &&
    bash deploy/slurm/down.sh --purge && bash deploy/slurm/up.sh --nodes 2; then
    log "WARNING: SLURM came up only after a purge of its state"
    export TORCHYARD_TEST_SLURM=up
    return 0
  else
    export TORCHYARD_TEST_SLURM="deploy/slurm/up.sh failed (see its output above)"
  fi
  log "WARNING: $TORCHYARD_TEST_SLURM: the slurm tests will fail"
  return 1
}

step packages system_packages
# requires-python is >=3.11: Debian's own python3 is the oldest one here that every account can run.
if [ -z "${PYTHON:-}" ] && [ -x /usr/bin/python3 ] &&
  /usr/bin/python3 -c 'import sys, venv; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
  export PYTHON=/usr/bin/python3
fi
if ! step setup bash deploy/setup.sh; then
  log "no Python environment: nothing else can run"
  finish
fi
step slurm slurm_cluster
job_python() {
  local python
  python=$(bash deploy/job-python.sh) || return 1
  export TORCHYARD_TEST_JOB_PYTHON=$python
}
step job-python job_python
step ruff "$PY/ruff" check .
# `ruff format --check` is left out while parts of the tree are not formatted yet.
step mypy "$PY/mypy"
# --durations: every run says where its time went (the slowest 50 tests and fixtures).
step pytest "$PY/pytest" -p no:cacheprovider --durations=50 "$@"
finish
