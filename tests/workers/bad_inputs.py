"""Worker: try each bad configuration in turn and report the exception every rank raised."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import ExactDataModule, build_model, rank, write_report

from lightning_hybrid.strategies import HybridParallelStrategy, PipelineSplit


class NoContract(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Linear(4, 4)

    def training_step(self, batch, batch_idx):
        return self.net(batch[0].float()).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


CASES: dict[str, dict[str, Any]] = {
    "sizes": {"strategy": {"pipeline_parallel_size": 3}},
    "dp_sizes": {"strategy": {"pipeline_parallel_size": 2, "data_parallel_size": 2}},
    "too_few_blocks": {"strategy": {"pipeline_parallel_size": 2, "schedule": "interleaved_1f1b"}, "n_layer": 1},
    "empty_stage": {"strategy": {"pipeline_parallel_size": 2, "split": {"layers_per_stage": [6, 0]}}},
    "batch_not_divisible": {"strategy": {"pipeline_parallel_size": 2, "num_microbatches": 3}},
    "too_few_microbatches": {"strategy": {"pipeline_parallel_size": 2, "num_microbatches": 1}},
    "zero3_zero_bubble": {"strategy": {"pipeline_parallel_size": 2, "zero_stage": 3, "schedule": "zbv_zero_bubble"}},
    "unknown_schedule": {"strategy": {"pipeline_parallel_size": 2, "schedule": "2f2b"}},
    "no_contract": {"strategy": {"pipeline_parallel_size": 2}, "module": "no_contract"},
    # tied embeddings across the two stages: what cannot stay exact is refused before step 0
    "tied_zero2_buckets": {"strategy": {"pipeline_parallel_size": 2, "zero_stage": 2}, "tie": True},
    "tied_groups_differ": {"strategy": {"pipeline_parallel_size": 2}, "tie": True, "groups_by_name": True},
}


def groups_by_name(model: L.LightningModule) -> torch.optim.Optimizer:
    """A name-keyed parameter-group rule that tells the two names of a tied parameter apart."""
    named = list(model.named_parameters())
    head = [p for n, p in named if "head" in n]
    rest = [p for n, p in named if "head" not in n]
    return torch.optim.SGD([{"params": head, "lr": 0.1}, {"params": rest, "lr": 0.2}])


def attempt(case: dict[str, Any]) -> str:
    try:
        kwargs = dict(case["strategy"])
        if "split" in kwargs:
            kwargs["split"] = PipelineSplit(**kwargs["split"])
        strategy = HybridParallelStrategy(**kwargs)
        if case.get("module") == "no_contract":
            model: L.LightningModule = NoContract()
        else:
            tie = case.get("tie", False)
            model = build_model({"model": {"n_layer": case.get("n_layer", 4), "tie_embeddings": tie}})
        if case.get("groups_by_name"):
            model.configure_optimizers = lambda: groups_by_name(model)
        trainer = L.Trainer(
            accelerator="cpu", devices=2, strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False, limit_val_batches=0,
        )  # fmt: skip
        trainer.fit(model, datamodule=ExactDataModule(block_size=16, global_batch=8))
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def main(cfg: dict[str, Any]) -> None:
    write_report(cfg["out"], {"rank": rank(), "errors": {name: attempt(case) for name, case in CASES.items()}})


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
