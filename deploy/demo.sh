#!/usr/bin/env bash
# The one command for a fresh machine: set up .venv (deploy/setup.sh: the torch 2.13.0 CPU wheel first,
# then this project) and run `torchyard demo`, which starts the service on 127.0.0.1, submits the seed's
# two demonstrations through its REST API, and exits 0 only when both results check out.
#   bash deploy/demo.sh                 # data in ./.torchyard of the repository
#   bash deploy/demo.sh --serve         # keep the service running afterwards (Ctrl-C stops it)
#   bash deploy/demo.sh --port 9000 --data-dir /tmp/yard
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
bash "$ROOT/deploy/setup.sh"
cd "$ROOT"  # so that the default data directory, ./.torchyard, is the repository's (git ignores it)
exec "${TORCHYARD_VENV:-$ROOT/.venv}/bin/torchyard" demo "$@"
