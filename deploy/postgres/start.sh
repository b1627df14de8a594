#!/usr/bin/env bash
# Start a throwaway PostgreSQL 15 server for tests and development, and print its SQLAlchemy URL.
#
#   deploy/postgres/start.sh          # prints postgresql+psycopg2://postgres@127.0.0.1:PORT/torchyard
#
# The server runs as the `postgres` user when started by root (created if missing), else as the
# caller, on a data folder of its own, listening on 127.0.0.1 and a free port plus a unix socket in
# that folder. Idempotent: with the server already up it only prints the URL again.
# Durability is switched off (fsync, synchronous_commit): this server is for tests, never for data.
#
# Environment: TORCHYARD_PG_DIR (default /tmp/torchyard-pg), TORCHYARD_PG_DB (default torchyard),
# TORCHYARD_PG_BIN (default /usr/lib/postgresql/15/bin).
set -euo pipefail

DIR=${TORCHYARD_PG_DIR:-/tmp/torchyard-pg}
DB=${TORCHYARD_PG_DB:-torchyard}
BIN=${TORCHYARD_PG_BIN:-/usr/lib/postgresql/15/bin}
DATA=$DIR/data

log() { echo "[postgres] $*" >&2; }
die() { log "ERROR: $*"; exit 1; }

[ -x "$BIN/initdb" ] || die "no PostgreSQL server binaries in $BIN (Debian package postgresql-15)"

if [ "$(id -u)" = 0 ]; then
  RUN_AS=postgres
  if ! id -u "$RUN_AS" >/dev/null 2>&1; then
    log "creating the system user $RUN_AS"
    useradd --system --home-dir /var/lib/postgresql --shell /usr/sbin/nologin "$RUN_AS"
  fi
  as_owner() { runuser -u "$RUN_AS" -- "$@"; }
else
  RUN_AS=$(id -un)
  as_owner() { "$@"; }
fi

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

running() { [ -f "$DATA/postmaster.pid" ] && as_owner "$BIN/pg_ctl" -D "$DATA" status >/dev/null 2>&1; }

mkdir -p "$DIR"
chmod 0755 "$DIR"
if [ "$(id -u)" = 0 ]; then chown "$RUN_AS" "$DIR"; fi

if [ ! -f "$DATA/PG_VERSION" ]; then
  rm -rf "$DATA"  # a half-made folder from an interrupted run
  log "initdb in $DATA"
  as_owner "$BIN/initdb" -D "$DATA" -A trust -U postgres -E UTF8 --locale=C.UTF-8 --no-sync \
    >"$DIR/initdb.log" 2>&1 || die "initdb failed: $(tail -5 "$DIR/initdb.log")"
fi

if running; then
  PORT=$(cat "$DIR/port")
else
  PORT=$(free_port)
  echo "$PORT" >"$DIR/port"
  log "starting on 127.0.0.1:$PORT (socket in $DIR)"
  as_owner "$BIN/pg_ctl" -D "$DATA" -l "$DIR/server.log" -w -t 60 \
    -o "-c listen_addresses=127.0.0.1 -p $PORT -k $DIR -c fsync=off -c synchronous_commit=off" \
    -o "-c full_page_writes=off -c max_connections=300" start >/dev/null \
    || die "pg_ctl start failed: $(tail -5 "$DIR/server.log" 2>/dev/null)"
fi

psql() { as_owner "$BIN/psql" -X -q -h "$DIR" -p "$PORT" -U postgres -v ON_ERROR_STOP=1 "$@"; }
if [ "$(psql -d postgres -tAc "SELECT 1 FROM pg_database WHERE datname = '$DB'")" != 1 ]; then
  psql -d postgres -c "CREATE DATABASE \"$DB\"" >/dev/null
fi

echo "postgresql+psycopg2://postgres@127.0.0.1:$PORT/$DB"
