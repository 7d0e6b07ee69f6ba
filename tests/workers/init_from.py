"""Worker: start from pretrained weights (``init_from``) one or more times in one job and save what was loaded.

Each run builds its model on the meta device, trains one step with learning rate 0 (the weights stay what was
loaded) and writes a sharded checkpoint; the test consolidates it and compares with the source file.
"""

from __future__ import annotations

from typing import Any

import lightning as L
from common import ExactDataModule, build_model, rank, run_worker, write_report
from train_gpt import RecordLoss

from lightning_hybrid.strategies import HybridParallelStrategy, PretrainedWeights


def _model(cfg: dict[str, Any]) -> L.LightningModule:
    if cfg.get("hf"):
        from hf_gpt2 import PipelinedGPT2

        return PipelinedGPT2(**cfg.get("model", {}))
    return build_model({**cfg, "model": {"optimizer": "sgd", "lr": 0.0, "build_on_meta": True, **cfg.get("model", {})}})


def main(cfg: dict[str, Any]) -> None:
    report: dict[str, Any] = {"rank": rank(), "runs": []}
    for run in cfg["runs"]:
        model = _model(cfg)
        data = ExactDataModule(block_size=16, **cfg.get("data", {}))
        recorder = RecordLoss()
        strategy = HybridParallelStrategy(**cfg["strategy"], init_from=PretrainedWeights(**run["init_from"]))
        trainer = L.Trainer(
            accelerator="cpu",
            devices=cfg["devices"],
            strategy=strategy,
            max_steps=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            use_distributed_sampler=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            callbacks=[recorder],
        )
        trainer.fit(model, datamodule=data)
        trainer.save_checkpoint(run["save"])
        report["runs"].append({"losses": recorder.losses, "bytes_read": strategy.pretrained_bytes_read})
    write_report(cfg["out"], report)


if __name__ == "__main__":
    run_worker(main)
