"""Worker: linear regression with SGD under DDP and an AccumulationScheduler; weights after every step.

Config: schedule, unit, epochs, n (samples), batch (per rank), out; optional ft (FaultTolerantCheckpoint
kwargs), kill ({"batch": b, "rank": r} on the first attempt), resume.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from common import rank, write_report
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_hybrid.callbacks import AccumulationScheduler, FaultTolerantCheckpoint

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def toy_data(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 4, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0], dtype=torch.float64) + 0.1 * torch.randn(n, generator=g).double()
    return TensorDataset(x, y)


class Linear(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1, dtype=torch.float64)
        with torch.no_grad():
            self.net.weight.fill_(0.1)
            self.net.bias.zero_()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Record(L.Callback):
    def __init__(self) -> None:
        self.weights: dict[int, list[float]] = {}
        self.ks: dict[int, int] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.weights[trainer.global_step] = [
            float(v) for v in torch.cat([p.detach().flatten() for p in pl_module.parameters()])
        ]
        self.ks[trainer.global_step] = trainer.accumulate_grad_batches

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        kill = self.kill
        if kill and rank() == kill["rank"] and ATTEMPT == 0 and trainer.fit_loop.total_batch_idx == kill["batch"]:
            os.kill(os.getpid(), signal.SIGKILL)

    kill: dict[str, int] | None = None


def main(cfg: dict[str, Any]) -> None:
    L.seed_everything(0)
    data = toy_data(cfg["n"])
    # a frozen order (Lightning would inject a shuffling DistributedSampler): rank r takes samples r, r+W, ...
    world = int(os.environ.get("WORLD_SIZE", "1"))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank(), shuffle=False)
    loader = DataLoader(data, batch_size=cfg["batch"], sampler=sampler)
    scheduler = AccumulationScheduler(schedule={int(k): v for k, v in cfg["schedule"].items()}, unit=cfg["unit"])
    record = Record()
    record.kill = cfg.get("kill")
    callbacks: list[Any] = [scheduler, record]
    if cfg.get("ft"):
        callbacks.append(FaultTolerantCheckpoint(**cfg["ft"]))
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), strategy="ddp",
        max_epochs=cfg["epochs"], logger=False, enable_checkpointing=bool(cfg.get("ft")), enable_progress_bar=False,
        enable_model_summary=False, precision="64-true", callbacks=callbacks, use_distributed_sampler=False,
    )  # fmt: skip
    trainer.fit(Linear(), train_dataloaders=loader, ckpt_path="last" if cfg.get("ft") else None)
    write_report(
        cfg["out"],
        {
            "rank": rank(),
            "weights": record.weights,
            "ks": record.ks,
            "attempt": ATTEMPT,
            "state": scheduler.state_dict(),
        },
    )


if __name__ == "__main__":
    main(json.loads(Path(sys.argv[1]).read_text()))
