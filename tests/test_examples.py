"""The LightningCLI example and its YAML configs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from helpers import ROOT, child_env


def _main_job(config, *args: str) -> str:
    cmd = [
        sys.executable, "examples/gpt.py", "fit", "--config", str(config),
        "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false", *args,
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out


@pytest.mark.multiproc
def test_main_job_config_trains_checkpoints_and_resumes(tmp_path):
    # the main job's own config (hybrid pipeline x ZeRO + FaultTolerantCheckpoint), with its checkpoints here
    config = yaml.safe_load((ROOT / "examples/configs/main.yaml").read_text())
    (ft,) = [cb for cb in config["trainer"]["callbacks"] if cb["class_path"].endswith("FaultTolerantCheckpoint")]
    ft["init_args"]["dirpath"] = str(tmp_path / "checkpoints")
    ft["init_args"]["every_n_train_steps"] = 20  # a shorter run than the real job's 150 steps
    path = tmp_path / "main.yaml"
    path.write_text(yaml.safe_dump(config))

    out = _main_job(
        path, "--trainer.max_steps=20", "--trainer.val_check_interval=20", f"--trainer.default_root_dir={tmp_path}"
    )
    assert "pipeline x data = 2 x 2, zero_stage=2, schedule=1f1b" in out
    assert "optimizer steps   20" in out
    assert "val_loss" in out
    assert "resumed from      - (fresh start)" in out
    manifest = json.loads((tmp_path / "checkpoints/step-000000020/manifest.json").read_text())
    assert manifest["layout"]["zero_stage"] == 2 and ".metadata" in manifest["files"]

    # running the same command again continues from the checkpoint (ckpt_path: last in the config)
    out = _main_job(path, "--trainer.max_steps=23", f"--trainer.default_root_dir={tmp_path}")
    assert f"resumed from      {tmp_path / 'checkpoints/step-000000020'}" in out
    assert "optimizer steps   23" in out
