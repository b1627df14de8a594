#!/usr/bin/env bash
# A Python environment for the ranks, that every job's account can run (TORCHYARD_JOB_PYTHON):
# torch (the pinned CPU wheel first), numpy, submitit and pydantic, which is all the worker needs.
# The service stages the worker package itself, so the project is not installed here.
#
#   deploy/job-python.sh [DIR]        default DIR: /opt/torchyard/job-python
#
# Jobs run as their owners' accounts, so neither the interpreter nor the packages may lie where only
# the service's account can read (a Python under root's home, a checkout in a private folder): the
# environment is made from the system's Python and lives in DIR, readable by everyone, writable by the
# one who made it. Prints the interpreter's path on its last line. Idempotent.
set -euo pipefail

DIR=${1:-/opt/torchyard/job-python}
BASE=${JOB_PYTHON_BASE:-/usr/bin/python3}
TORCH_VERSION=2.13.0
# Exact, as in pyproject.toml: the ranks run submitit's running side, whose names the service's
# adapter relies on (service/backends/submitit_adapter.py).
SUBMITIT_VERSION=1.5.4
want="torch=$TORCH_VERSION base=$("$BASE" --version 2>&1)"
STAMP=$DIR/.torchyard-job-python

log() { echo "[job-python] $*" >&2; }
pip=("$DIR/bin/python" -m pip --disable-pip-version-check -q)

if [ -x "$DIR/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ]; then
  log "up to date: $DIR"
else
  [ -x "$BASE" ] || { log "no $BASE: install Debian's python3 and python3-venv, or set JOB_PYTHON_BASE"; exit 1; }
  log "creating $DIR from $("$BASE" --version 2>&1)"
  umask 022
  "$BASE" -m venv --clear "$DIR"
  "${pip[@]}" install "torch==$TORCH_VERSION"
  # The worker's own requirements, as pyproject.toml has them.
  "${pip[@]}" install "numpy>=1.24" "submitit==$SUBMITIT_VERSION" "pydantic>=2.6,<3"
  echo "$want" >"$STAMP"
fi
if ! "$DIR/bin/python" -c "import submitit, sys; sys.exit(submitit.__version__ != '$SUBMITIT_VERSION')"; then
  log "installing submitit $SUBMITIT_VERSION"  # an environment made before the pin
  umask 022
  "${pip[@]}" install "submitit==$SUBMITIT_VERSION"
fi
"$DIR/bin/python" -c 'import torch, submitit, pydantic' || { log "$DIR is incomplete"; exit 1; }
echo "$DIR/bin/python"
