#!/usr/bin/env bash
# The pack's GPU paths in one table, in under 10 minutes on one node with 1 to 8 GPUs: exactness on NCCL
# (ZeRO-0/1/2/3, a pipeline, tensor parallelism, both engines), bf16, fp16 with the agreed scaler, the overlap benchmark and the
# peak memory per ZeRO stage. Without a GPU it is a dry run that says what it skipped. Set-up included:
#   bash benchmarks/gpu_check.sh          # or: bash benchmarks/gpu_check.sh --cpu (the checks on 2 CPU processes)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec timeout 600 "$PY" benchmarks/gpu_check.py "$@"
