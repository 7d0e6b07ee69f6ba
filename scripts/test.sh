#!/usr/bin/env bash
# The test suite: set up, then run every tier that this machine supports (multi-process tests run
# serially; GPU tests skip without a GPU). Extra arguments go to pytest, e.g. `-m unit`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$PY" -m pytest "$@"
