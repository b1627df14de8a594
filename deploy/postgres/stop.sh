#!/usr/bin/env bash
# Stop the server deploy/postgres/start.sh started and remove its data folder (it holds test data only).
#
#   deploy/postgres/stop.sh [--keep]      # --keep: stop, but leave the data folder for the next start
#
# Idempotent: nothing running and no folder is success. Environment as in start.sh.
set -euo pipefail

DIR=${TORCHYARD_PG_DIR:-/tmp/torchyard-pg}
BIN=${TORCHYARD_PG_BIN:-/usr/lib/postgresql/15/bin}
KEEP=0
[ "${1:-}" = --keep ] && KEEP=1

if [ -f "$DIR/data/postmaster.pid" ]; then
  if [ "$(id -u)" = 0 ]; then
    runuser -u "$(stat -c %U "$DIR/data")" -- "$BIN/pg_ctl" -D "$DIR/data" -m fast -w stop >/dev/null || true
  else
    "$BIN/pg_ctl" -D "$DIR/data" -m fast -w stop >/dev/null || true
  fi
fi
if [ "$KEEP" = 0 ]; then
  rm -rf "$DIR"
fi
echo "[postgres] stopped" >&2
