#!/usr/bin/env bash
# The main job: set up, then train the example GPT with lightning-hybrid on this machine, then a small
# Hugging Face Llama (lightning_hybrid.models.CausalLM), exported as a save_pretrained folder
# (CPU processes by default; all GPUs when there are at least two). Extra arguments go to LightningCLI.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
devices=(--trainer.accelerator=cpu --trainer.devices=4)
if command -v nvidia-smi >/dev/null 2>&1; then
  n=$(nvidia-smi -L 2>/dev/null | grep -c GPU || true)
  if [ "${n:-0}" -ge 2 ] && [ $((n % 2)) -eq 0 ]; then devices=(--trainer.accelerator=gpu "--trainer.devices=$n"); fi
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
"$PY" examples/gpt.py fit --config examples/configs/main.yaml "${devices[@]}" "$@"
# then a Hugging Face Llama through CausalLM (pp2 x tp2, ZeRO-1), exported as a save_pretrained folder
exec "$PY" examples/causal_lm.py fit --config examples/configs/llama.yaml "${devices[@]}"
