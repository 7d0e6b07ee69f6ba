"""The independent reference for every cell: the shape trained in one process by Lightning alone (no
lightning-hybrid), on the same global batches in the same order, with its own callbacks and Trainer arguments.

Besides the loss of every global batch and the final weights it gives, for every split of a global batch
over ``replicas`` x ``microbatches`` (the layouts'), the loss each replica's micro-batch has at that step's
weights: what that replica's last pipeline stage (or its ``training_step``) computes before anything is
reduced. A layout's ranks are judged on those, one by one.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from shapes import CHECKPOINT_AT, GLOBAL_BATCH, MAX_STEPS, Shape, TokenMean, build
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler

SPLITS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (replicas, micro-batches per replica batch) of the layouts


@dataclass
class Reference:
    losses: list[float]  # each global batch's loss
    steps_before: list[int]  # for each global batch, the optimizer steps taken before it
    weights: dict[str, Tensor]  # the final state_dict
    # split -> replica -> one list per global batch: its micro-batches' losses (None: nothing counted in it)
    own: dict[tuple[int, int], list[list[list[float | None]]]] = field(default_factory=dict)


class _Record(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []
        self.steps_before: list[int] = []
        self._before = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._before = trainer.global_step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.extend(pl_module.reference_losses)
        self.steps_before.extend([self._before] * len(pl_module.reference_losses))


def _own_losses(model: Shape, x: Tensor, y: Tensor, own: dict) -> None:
    """Each split's replicas' micro-batch losses on the global batch ``x, y`` at the current weights. Under
    autocast the weights' casts are not cached here: a cast made without gradients, cached, would be reused by
    the step's own forward, whose weights would then get no gradient."""
    uncached: Any = contextlib.nullcontext()
    if torch.is_autocast_enabled("cpu"):
        uncached = torch.autocast("cpu", dtype=torch.get_autocast_dtype("cpu"), cache_enabled=False)
    with torch.no_grad(), uncached:
        _own_losses_uncached(model, x, y, own)


def _own_losses_uncached(model: Shape, x: Tensor, y: Tensor, own: dict) -> None:
    for split in SPLITS:
        replicas, microbatches = split
        per_replica = own.setdefault(split, [[] for _ in range(replicas)])
        for r in range(replicas):
            xr, yr = x[r::replicas], y[r::replicas]
            size = xr.shape[0] // microbatches
            losses: list[float | None] = []
            for j in range(microbatches):
                part = slice(j * size, (j + 1) * size)
                if isinstance(model, TokenMean) and int((yr[part] != -100).sum()) == 0:
                    losses.append(None)
                    continue
                losses.append(float(model.pipeline_loss(model(xr[part]), yr[part]).float()))
            per_replica[r].append(losses)


def _window_step(model: Shape, batch: Any, *, replicas: int, microbatches: int, accumulate: int, own: dict) -> Tensor:
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
            mine: list[list[float | None]] = []
            for r in range(replicas):
                # replicas after the first update copies of the buffers, which are then dropped (the tensors
                # themselves stay as backward saved them)
                originals = [getattr(m, n) for m, n in owners]
                if r:
                    for m, n in owners:
                        setattr(m, n, getattr(m, n).clone())
                xr, yr = xs[r::replicas], ys[r::replicas]
                size = xr.shape[0] // microbatches
                losses = []
                for j in range(microbatches):
                    part = slice(j * size, (j + 1) * size)
                    chunk_losses.append(model.pipeline_loss(model(xr[part]), yr[part]))
                    losses.append(float(chunk_losses[-1]))
                mine.append(losses)
                for (m, n), original in zip(owners, originals):
                    setattr(m, n, original)
            per_replica = own.setdefault((replicas, microbatches), [[] for _ in range(replicas)])
            for r in range(replicas):
                per_replica[r].append(mine[r])
        per_batch = torch.stack(chunk_losses).view(accumulate, -1).mean(dim=1)
        model.reference_losses = [float(v) for v in per_batch]
        return per_batch.mean()
    for k in range(accumulate):
        _own_losses(model, x[k * n : (k + 1) * n], y[k * n : (k + 1) * n], own)
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
) -> Reference:
    """Shape ``name`` trained in one process: every global batch's loss, the final state_dict, and the
    replicas' own micro-batch losses for every split.

    ``split``: (replicas, micro-batches) of the layout, for shapes whose batch statistics depend on them;
    ``split_before``: the split of the layout a resumed run's checkpoint came from, until CHECKPOINT_AT."""
    L.seed_everything(0, workers=False, verbose=False)
    model = build(name)
    accumulate = model.accumulate
    own: dict[tuple[int, int], list[list[list[float | None]]]] = {}

    def step(batch: Any, batch_idx: int) -> Tensor:
        replicas, microbatches = split_before if split_before and model.global_step < CHECKPOINT_AT else split
        return _window_step(model, batch, replicas=replicas, microbatches=microbatches, accumulate=accumulate, own=own)

    def lightning_step(batch: Any, batch_idx: int) -> Tensor:  # the shape's own step on a global micro-batch
        x, y = batch
        _own_losses(model, x, y, own)
        loss = own_step(batch, batch_idx)
        model.reference_losses = [float(loss)]
        return loss

    own_step = model.training_step
    if model.automatic_optimization:
        model.training_step = lightning_step if model.lightning_accumulation else step  # type: ignore[method-assign]
    else:  # the shape's own loop, on the whole global batch

        def manual(batch: Any, batch_idx: int) -> Tensor:
            _own_losses(model, batch[0], batch[1], own)
            loss = own_step(batch, batch_idx)
            model.reference_losses = [float(loss)]
            return loss

        model.training_step = manual  # type: ignore[method-assign]
    dataset = model.dataset()
    # DistributedSampler's order at one replica: the order every layout's replicas split between them
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    record = _Record()
    kwargs = model.trainer_kwargs(reference=True)
    if model.lightning_accumulation:
        kwargs["accumulate_grad_batches"] = accumulate
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
        **kwargs,
    )
    per_step = GLOBAL_BATCH * (1 if model.lightning_accumulation else accumulate)
    loader = DataLoader(dataset, batch_size=per_step, sampler=sampler)
    trainer.fit(model, train_dataloaders=loader)
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return Reference(record.losses, record.steps_before, weights, own)
