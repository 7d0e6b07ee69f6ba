#!/usr/bin/env bash
# The test suite: set up, then run the default tier (everything but the tests marked `slow`); with `--all`,
# or under CI=true, the slow tier too (the conformance matrix, chaos, the Slurm cluster, elastic world
# changes). Multi-process tests run serially; GPU tests skip without a GPU. Other arguments go to pytest,
# e.g. `-m unit` (a `-m` of one's own replaces the tier's).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
tier=(-m "not slow")
args=()
for arg in "$@"; do
  if [ "$arg" = "--all" ]; then tier=(); else args+=("$arg"); fi
done
if [ "${CI:-}" = "true" ]; then tier=(); fi
exec "$PY" -m pytest ${tier[@]+"${tier[@]}"} ${args[@]+"${args[@]}"}
