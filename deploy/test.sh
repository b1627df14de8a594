#!/usr/bin/env bash
# The whole test suite from nothing, on a fresh Debian 12 machine as root (CI runs exactly this):
#   1. Debian packages: Chromium (dashboard tests), wrk (benchmarks), SLURM + munge + slurmdbd +
#      MariaDB (the real cluster), PostgreSQL 15 server binaries when missing;
#   2. the Python environment (deploy/setup.sh: torch CPU wheel first, then the project);
#   3. the real two-node SLURM cluster (deploy/slurm/up.sh);
#   4. ruff, mypy --strict, then pytest with every marker. PostgreSQL is started by the tests.
# In this script missing parts fail their tests instead of skipping them (TORCHYARD_TEST_STRICT=1).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
log() { echo "[test] $*" >&2; }
export TORCHYARD_TEST_STRICT=1

packages=(chromium wrk slurm-wlm munge slurmdbd mariadb-server iproute2 procps)
[ -x /usr/lib/postgresql/15/bin/initdb ] || packages+=(postgresql-15)
missing=()
for pkg in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    log "missing Debian packages (${missing[*]}) and not root: install them first"; exit 1
  fi
  log "installing Debian packages: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

bash deploy/setup.sh
PY=$ROOT/.venv/bin

if [ "$(id -u)" = 0 ] && bash deploy/slurm/up.sh --nodes 2; then
  export TORCHYARD_TEST_SLURM=up
else
  export TORCHYARD_TEST_SLURM="deploy/slurm/up.sh failed (see its output above)"
  log "WARNING: $TORCHYARD_TEST_SLURM; the slurm tests will fail"
fi

log "ruff"
"$PY/ruff" check .
log "mypy --strict"
"$PY/mypy"
log "pytest"
set +e
"$PY/pytest" -p no:cacheprovider "$@"
status=$?
set -e
if [ "$status" = 5 ]; then
  log "pytest collected no tests: that is a failure"; exit 1
fi
log "pytest exit status $status"
exit "$status"
