"""The LightningCLI example and its YAML configs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from helpers import ROOT, child_env


def _main_job(config, *args: str, script: str = "examples/gpt.py") -> str:
    cmd = [
        sys.executable, script, "fit", "--config", str(config),
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


def _llama_job(config: dict, tmp_path, *args: str) -> str:
    path = tmp_path / "llama.yaml"
    path.write_text(yaml.safe_dump(config))
    return _main_job(
        path, f"--export_dir={tmp_path / 'hf'}", f"--trainer.default_root_dir={tmp_path}", *args,
        script="examples/causal_lm.py",
    )  # fmt: skip


@pytest.mark.multiproc
def test_llama_example_trains_a_transformers_model_and_exports_it(tmp_path):
    from transformers import AutoModelForCausalLM

    config = yaml.safe_load((ROOT / "examples/configs/llama.yaml").read_text())
    out = _llama_job(config, tmp_path, "--trainer.max_steps=3", "--trainer.val_check_interval=3")
    assert f"exported {tmp_path / 'hf'}" in out
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info.values()), info
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 4


@pytest.mark.multiproc
def test_init_from_written_in_yaml_with_a_key_map_reaches_the_strategy_as_weights(tmp_path):
    """LightningCLI's parser builds ``PretrainedWeights`` (class_path, init_args, a key map) for the strategy:
    after two steps at learning rate 0, the exported model is the folder's own, bitwise."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = yaml.safe_load((ROOT / "examples/configs/llama.yaml").read_text())
    fields = dict(config["model"]["model"])
    torch.manual_seed(7)
    source = AutoModelForCausalLM.from_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    source.save_pretrained(tmp_path / "folder")
    n = source.config.num_hidden_layers
    key_map = {
        "model.embed_tokens.": "layers.0.embed_tokens.",
        **{f"model.layers.{i}.": f"layers.{i + 1}.layer." for i in range(n)},
        "model.norm.": f"layers.{n + 1}.norm.",
        "lm_head.": f"layers.{n + 1}.lm_head.",
    }
    strategy = config["trainer"]["strategy"]["init_args"]
    strategy["init_from"] = {
        "class_path": "lightning_hybrid.strategies.PretrainedWeights",
        "init_args": {"path": str(tmp_path / "folder"), "key_map": key_map},
    }
    config["trainer"]["devices"] = 2  # pp2 (the main job's tensor parallelism needs 4 processes)
    strategy["tensor_parallel_size"] = 1
    config["model"]["lr"] = 0.0  # it trains (2 steps), and AdamW at lr 0 leaves the weights where they start
    out = _llama_job(config, tmp_path, "--trainer.max_steps=2", "--trainer.val_check_interval=2")
    assert "pipeline stages of CausalLM" in out
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    for name, value in source.state_dict().items():
        assert torch.equal(exported[name], value), name
