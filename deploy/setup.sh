#!/usr/bin/env bash
# Create or refresh the project's Python environment in .venv:
#   1. python3 -m venv .venv (when missing)
#   2. pip install torch==2.13.0 FIRST: the CPU wheel on this machine's disk. The project's own
#      `torch>=2.3,<3` is then already satisfied; a bare torch requirement would pull a CUDA build.
#   3. pip install -e '.[dev]'
# Idempotent and quick the second time: a stamp in .venv records the hash of pyproject.toml, the torch
# version and the Python it was built for; nothing is installed while all three still match (a venv
# of another Python is made anew).
#
# Environment: TORCHYARD_VENV (default <repo>/.venv), PYTHON (default python3).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${TORCHYARD_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}
TORCH_VERSION=2.13.0
STAMP=$VENV/.torchyard-setup

log() { echo "[setup] $*" >&2; }

base=$("$PYTHON" -c 'import sys; print(sys.version.split()[0])')
want="pyproject=$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1) torch=$TORCH_VERSION python=$base"

installed() {  # the stamp matches and the distributions are really there (reads metadata, imports nothing)
  [ -x "$VENV/bin/python" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] &&
    "$VENV/bin/python" - "$TORCH_VERSION" <<'PY'
import sys
from importlib.metadata import PackageNotFoundError, version
try:
    ok = version("torch").split("+")[0] == sys.argv[1] and bool(version("torchyard"))
except PackageNotFoundError:
    ok = False
sys.exit(0 if ok else 1)
PY
}

if installed; then
  log "up to date: $VENV"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ] ||
  [ "$("$VENV/bin/python" -c 'import sys; print(sys.version.split()[0])' 2>/dev/null)" != "$base" ]; then
  log "creating $VENV with Python $base ($PYTHON)"
  "$PYTHON" -m venv --clear "$VENV"
fi
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)
rm -f "$STAMP"
log "installing torch==$TORCH_VERSION (CPU wheel) first"
"${pip[@]}" install -q "torch==$TORCH_VERSION"
log "installing the project with its dev extras"
"${pip[@]}" install -q -e "$ROOT[dev]"
echo "$want" >"$STAMP"
log "ready: $VENV ($("$VENV/bin/python" -c 'import importlib.metadata as m; print("torch", m.version("torch"))'))"
