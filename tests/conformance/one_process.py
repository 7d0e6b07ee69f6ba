"""The independent reference for every cell: the shape trained in one process by Lightning alone (no
lightning-hybrid), on the same global batches in the same order, with its own callbacks."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from shapes import CHECKPOINT_AT, GLOBAL_BATCH, MAX_STEPS, Shape, TokenMean, build
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler


class _Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.extend(pl_module.reference_losses)


def _window_step(model: Shape, batch: Any, *, replicas: int, microbatches: int, accumulate: int) -> Tensor:
    """One optimizer step of one process on a whole accumulation window (``accumulate`` global batches):
    the exact mean over the window (over its counted elements for a token mean). The loss each global
    batch of the window would report is kept for the comparison. With ``per_chunk_statistics`` each
    replica's micro-batches run apart (BatchNorm's batch statistics) and only replica 0 updates the
    running statistics, as Lightning's DDP keeps them."""
    x, y = batch
    n = x.shape[0] // accumulate
    model.reference_losses = []
    if model.per_chunk_statistics:
        chunk_losses: list[Tensor] = []
        for k in range(accumulate):
            xs, ys = x[k * n : (k + 1) * n], y[k * n : (k + 1) * n]
            owners = [(m, n) for m in model.modules() for n, b in m.named_buffers(recurse=False) if b is not None]
            for r in range(replicas):
                # replicas after the first update copies of the buffers, which are then dropped (the tensors
                # themselves stay as backward saved them)
                originals = [getattr(m, n) for m, n in owners]
                if r:
                    for m, n in owners:
                        setattr(m, n, getattr(m, n).clone())
                xr, yr = xs[r::replicas], ys[r::replicas]
                size = xr.shape[0] // microbatches
                for j in range(microbatches):
                    part = slice(j * size, (j + 1) * size)
                    chunk_losses.append(model.pipeline_loss(model(xr[part]), yr[part]))
                for (m, n), original in zip(owners, originals):
                    setattr(m, n, original)
        per_batch = torch.stack(chunk_losses).view(accumulate, -1).mean(dim=1)
        model.reference_losses = [float(v) for v in per_batch]
        return per_batch.mean()
    out = model(x)
    if isinstance(model, TokenMean):
        flat = torch.nn.functional.cross_entropy(
            out.flatten(0, 1).float(), y.flatten(), ignore_index=-100, reduction="none"
        ).view(y.shape)
        counted = (y != -100).float()
        for k in range(accumulate):
            rows = slice(k * n, (k + 1) * n)
            model.reference_losses.append(float(flat[rows].sum() / counted[rows].sum()))
        return flat.sum() / counted.sum()
    for k in range(accumulate):
        rows = slice(k * n, (k + 1) * n)
        model.reference_losses.append(float(model.pipeline_loss(out[rows], y[rows])))
    return model.pipeline_loss(out, y)


def reference(
    name: str, folder: Any, *, split: tuple[int, int] = (1, 1), split_before: tuple[int, int] | None = None
) -> tuple[list[float], dict]:
    """(the loss of every global batch, the final state_dict) of shape ``name`` trained in one process.

    ``split``: (replicas, micro-batches) of the layout, for shapes whose batch statistics depend on them;
    ``split_before``: the split of the layout a resumed run's checkpoint came from, until CHECKPOINT_AT."""
    L.seed_everything(0, workers=False, verbose=False)
    model = build(name)
    accumulate = model.accumulate

    def step(batch: Any, batch_idx: int) -> Tensor:
        replicas, microbatches = split_before if split_before and model.global_step < CHECKPOINT_AT else split
        return _window_step(model, batch, replicas=replicas, microbatches=microbatches, accumulate=accumulate)

    if model.automatic_optimization:
        model.training_step = step  # type: ignore[method-assign]
    else:  # the shape's own loop, on the whole global batch
        own = model.training_step

        def manual(batch: Any, batch_idx: int) -> Tensor:
            loss = own(batch, batch_idx)
            model.reference_losses = [float(loss)]
            return loss

        model.training_step = manual  # type: ignore[method-assign]
    dataset = model.dataset()
    # DistributedSampler's order at one replica: the order every layout's replicas split between them
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    record = _Record()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=MAX_STEPS,
        callbacks=[*model.callbacks(), record],
        logger=CSVLogger(folder, name="", version=""),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    loader = DataLoader(dataset, batch_size=GLOBAL_BATCH * accumulate, sampler=sampler)
    trainer.fit(model, train_dataloaders=loader)
    return record.losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
