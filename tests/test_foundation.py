"""The package, the example model and the multi-process launcher."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from helpers import launch
from reference import reference_run

import lightning_hybrid
from lightning_hybrid.strategies import DeepSpeedPipelineStrategy, HybridParallelStrategy


@pytest.mark.unit
def test_import_registers_strategy_names_idempotently():
    from lightning.pytorch.strategies import StrategyRegistry

    names = lightning_hybrid.register_strategies()
    assert lightning_hybrid.register_strategies() == names  # a second call changes nothing
    assert {"hybrid", "hybrid_zero1", "hybrid_zero2", "hybrid_zero3", "hybrid_pipeline"} <= set(names)
    assert StrategyRegistry["hybrid_zero2"]["init_params"] == {"zero_stage": 2}
    assert "deepspeed_pipeline" in names


@pytest.mark.trainer
def test_trainer_resolves_hybrid_by_name():
    trainer = L.Trainer(strategy="hybrid", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, HybridParallelStrategy)
    trainer = L.Trainer(strategy="hybrid_zero3", accelerator="cpu", devices=1, logger=False)
    assert trainer.strategy.layout_request.zero_stage == 3
    trainer = L.Trainer(strategy="deepspeed_pipeline", accelerator="cpu", devices=1, logger=False)
    assert isinstance(trainer.strategy, DeepSpeedPipelineStrategy)


@pytest.mark.trainer
def test_example_model_trains_single_process(tmp_path):
    from gpt import GPT, CharDataModule

    torch.manual_seed(0)
    data = CharDataModule(block_size=32, batch_size=8)
    model = GPT(vocab_size=data.vocab_size, block_size=32, n_layer=2, d_model=32, n_head=2, lr=3e-3)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=30,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=2,
        val_check_interval=30,
        default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=data)
    metrics = trainer.callback_metrics
    assert trainer.global_step == 30
    # a character model starts near ln(vocab) and must have learned something in 30 steps
    assert metrics["train_loss"] < 0.85 * torch.log(torch.tensor(float(data.vocab_size)))
    assert torch.isfinite(metrics["val_ppl"]) and metrics["val_ppl"] < data.vocab_size


@pytest.mark.multiproc
def test_example_model_trains_under_ddp_with_two_processes():
    cfg = {"model": {"optimizer": "sgd", "lr": 0.2}, "data": {"global_batch": 8}, "steps": 4}
    job = launch("train_gpt.py", {**cfg, "strategy": {"name": "ddp"}, "devices": 2}, nproc=2)
    ref_losses, _ = reference_run(cfg, steps=4)
    per_rank = torch.tensor([job.rank(r)["losses"] for r in (0, 1)])
    # each rank saw half of every global batch: their mean is the single-process loss, step after step
    torch.testing.assert_close(per_rank.mean(0), torch.tensor(ref_losses), rtol=0, atol=1e-5)
    assert per_rank[:, -1].mean() < per_rank[:, 0].mean()
