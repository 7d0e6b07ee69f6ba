"""Worker: a small regression trained on a dataset of indexed samples with the sampler a test names, with or
without ``FaultTolerantCheckpoint``; each rank reports the sample indices of every optimizer step and its
weights. The same run without the callback (plain Lightning) is the reference for the data order."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from common import rank, run_worker, write_report
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler, WeightedRandomSampler

from lightning_hybrid.callbacks import FaultTolerantCheckpoint
from lightning_hybrid.strategies import HybridParallelStrategy

SAMPLES = 32


class Indexed(Dataset):
    """Sample i: a fixed input, its target, and i itself (to record what trained)."""

    def __init__(self, samples: int = SAMPLES) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(samples, 4, generator=g)
        self.y = self.x @ torch.tensor([1.0, -2.0, 0.5, 3.0]) + 0.1 * torch.randn(samples, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class Stream(IterableDataset):
    """The same samples as a stream, each rank reading every world-th one (as a sharded stream would)."""

    def __init__(self) -> None:
        self.data = Indexed()

    def __iter__(self):
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        r = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        for i in range(r, len(self.data), world):
            yield self.data[i]


class Reversed(BatchSampler):
    """A batch sampler of the user's own (each batch in reverse order)."""

    def __iter__(self):
        for batch in super().__iter__():
            yield batch[::-1]


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(4, 1)
        self.seen: dict[int, list[int]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, idx = batch
        self.seen.setdefault(self.trainer.global_step + 1, []).extend(int(i) for i in idx)
        return nn.functional.mse_loss(self.layer(x).squeeze(-1), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Data(L.LightningDataModule):
    def __init__(self, sampler: str) -> None:
        super().__init__()
        self.kind = sampler

    def train_dataloader(self) -> DataLoader:
        data = Indexed()
        g = torch.Generator().manual_seed(7)
        if self.kind == "weighted":  # the odd samples have weight 0: they must never train
            weights = [1.0 if i % 2 == 0 else 0.0 for i in range(SAMPLES)]
            sampler: Any = WeightedRandomSampler(weights, num_samples=SAMPLES, replacement=True, generator=g)
        elif self.kind == "replacement":
            sampler = RandomSampler(data, replacement=True, num_samples=24, generator=g)
        elif self.kind == "shuffle":
            return DataLoader(data, batch_size=4, shuffle=True)
        elif self.kind == "padded":  # 60 samples: not a multiple of the global batch (drop_last=False)
            return DataLoader(Indexed(60), batch_size=4, shuffle=True)
        elif self.kind == "iterable":
            return DataLoader(Stream(), batch_size=4)
        elif self.kind == "batch_sampler":
            return DataLoader(data, batch_sampler=Reversed(RandomSampler(data, generator=g), 4, drop_last=False))
        else:
            raise ValueError(self.kind)
        return DataLoader(data, batch_size=4, sampler=sampler)


class StopAt(Callback):
    """Ends the fit after ``step`` optimizer steps (as a preemption would, after the step's checkpoint)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


def main(cfg: dict[str, Any]) -> None:
    model = Regression()
    callbacks: list[Callback] = []
    if cfg.get("ft"):
        policy = cfg.get("policy", "keep_global_batch")
        callbacks.append(FaultTolerantCheckpoint(dirpath=cfg["ft"], every_n_train_steps=1, on_world_size_change=policy))
    if cfg.get("mc"):  # Lightning's own checkpoints, without the pack's callback
        callbacks.append(ModelCheckpoint(dirpath=cfg["mc"], every_n_train_steps=1, save_top_k=-1))
    if cfg.get("stop_at"):
        callbacks.append(StopAt(cfg["stop_at"]))
    devices = cfg.get("devices", 1)
    strategy = HybridParallelStrategy(data_parallel_size=devices) if cfg.get("hybrid") else "auto"
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=cfg["steps"], max_epochs=cfg.get("epochs", -1),
        logger=False, enable_checkpointing=bool(cfg.get("ft") or cfg.get("mc")), enable_progress_bar=False,
        enable_model_summary=False, callbacks=callbacks,
    )  # fmt: skip
    ckpt_path = cfg.get("ckpt") or ("last" if cfg.get("ft") else None)
    trainer.fit(model, datamodule=Data(cfg["sampler"]), ckpt_path=ckpt_path)
    write_report(
        cfg["out"],
        {
            "rank": rank(),
            "seen": model.seen,
            "weights": [float(v) for v in torch.cat([p.detach().flatten() for p in model.parameters()])],
        },
    )


if __name__ == "__main__":
    run_worker(main)
