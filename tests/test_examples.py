"""The LightningCLI example and its YAML configs."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import ROOT, child_env


@pytest.mark.multiproc
def test_main_job_config_trains_the_example_model(tmp_path):
    # the main job's own config (hybrid pipeline x ZeRO), shortened to its first validation point
    cmd = [
        sys.executable, "examples/gpt.py", "fit", "--config", "examples/configs/main.yaml",
        "--trainer.max_steps=50", "--trainer.limit_val_batches=1",
        f"--trainer.default_root_dir={tmp_path}", "--trainer.enable_progress_bar=false",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert "pipeline x data = 2 x 2, zero_stage=2, schedule=1f1b" in out
    assert "optimizer steps   50" in out
    assert "val_loss" in out
    # the ModelCheckpoint Lightning adds by default wrote a sharded checkpoint directory
    assert list(tmp_path.rglob("*.ckpt/.metadata"))
