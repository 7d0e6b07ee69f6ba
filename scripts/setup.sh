#!/usr/bin/env bash
# Creates (or reuses) .venv with lightning-hybrid and its test tools. Idempotent: a second run only checks.
# Source it: `source scripts/setup.sh`; it leaves PY pointing at the venv's python.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${LH_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ ! -x "$PY" ]; then
  echo "[setup] creating $VENV"
  python3 -m venv "$VENV"
fi

stamp="$VENV/.lightning-hybrid-installed"
want="$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$PY" -c "import lightning_hybrid" 2>/dev/null; then
  echo "[setup] environment up to date ($VENV)"
  return 0 2>/dev/null || exit 0
fi

# torch: keep one that is already installed (a user's CUDA build stays untouched); otherwise take the
# pinned CPU build when it is available locally, else a CUDA build where a GPU is present, else the CPU
# wheel index. A bare `pip install torch` would pull a multi-GB CUDA build onto CPU-only machines.
if ! "$PY" -c "import torch" 2>/dev/null; then
  if "$PY" -m pip install -q --no-index "torch==2.13.0" 2>/dev/null; then
    echo "[setup] torch 2.13.0 installed from local wheels"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch>=2.13"
  elif ! "$PY" -m pip install -q --timeout 15 --retries 1 "torch==2.13.0" \
      --index-url https://download.pytorch.org/whl/cpu 2>/dev/null; then
    # the CPU wheel index is unreachable (offline mirror, firewall): take whatever the configured index has
    "$PY" -m pip install -q "torch==2.13.0" || "$PY" -m pip install -q "torch>=2.13"
  fi
fi

echo "[setup] installing lightning-hybrid (editable) with its test extra"
"$PY" -m pip install -q -e "$ROOT[test]" 2>&1 | grep -v "is ignored: it is neither" || true
"$PY" -c "import lightning_hybrid, torch, lightning; print(f'[setup] torch {torch.__version__}, lightning {lightning.__version__}, lightning-hybrid {lightning_hybrid.__version__}')"
echo "$want" > "$stamp"
