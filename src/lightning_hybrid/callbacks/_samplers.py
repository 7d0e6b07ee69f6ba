"""Owning the training data order, so that a resume continues mid-epoch with exactly the unseen samples.

Lightning's samplers cannot start part-way through an epoch, and under DDP it reshuffles from an RNG no
checkpoint holds. The callback swaps each training loader's sampler for a :class:`ResumableSampler` that
yields the same order (``DistributedSampler``'s, seeded by seed + epoch) and records the position in the
epoch's global order after every batch.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from lightning_hybrid._lightning_compat import restart_train_iterator, train_dataloaders
from lightning_hybrid.callbacks._resume import ResumableSampler

__all__ = ["SamplerOwner"]


class SamplerOwner:
    """Swaps the training samplers for resumable ones and tracks the data position (epoch, consumed)."""

    def __init__(self) -> None:
        # each owned loader's sampler and batch sampler (whose batch size a resume on another world may change)
        self.samplers: list[tuple[ResumableSampler, BatchSampler]] = []
        self.configured_k: int | None = None
        # global samples per epoch of the world the run started on, and the dataset length it was measured on
        self.epoch_samples: int | None = None
        self.epoch_dataset: int | None = None
        self.position: dict[str, int] = {"epoch": 0, "consumed": 0}
        self.resume_at: dict[str, int] | None = None  # where the resumed epoch continues
        # (epoch, global position) the resumed epoch continued at, and Lightning's batch index of its first
        # batch: positions are counted from there, in this world's batches (the restored batch counter is in
        # the batches of the world that wrote the checkpoint)
        self._anchor: tuple[int, int] | None = None
        self._anchor_batch: int | None = None

    def own(self, trainer: pl.Trainer) -> None:
        """Swap each training loader's sampler for a ResumableSampler that yields the same order."""
        self.samplers = []
        if self.configured_k is None:  # once: a resume on another world rescales the Trainer's K after this
            self.configured_k = int(trainer.accumulate_grad_batches)
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        loaders = train_dataloaders(trainer)
        for loader in loaders:
            batch_sampler = getattr(loader, "batch_sampler", None)
            if not (isinstance(loader, DataLoader) and type(batch_sampler) is BatchSampler):
                rank_zero_warn(
                    "FaultTolerantCheckpoint: a training loader with a custom batch sampler (or no DataLoader) keeps"
                    " its own order; mid-epoch resume restarts its epoch unless it implements state_dict()."
                )
                continue
            sampler = _resumable(batch_sampler.sampler, seed)
            if sampler is None:
                rank_zero_warn(
                    f"FaultTolerantCheckpoint: unknown sampler {type(batch_sampler.sampler).__name__}; not resumable."
                )
                continue
            batch_sampler.sampler = sampler
            # iterator creation would draw worker seeds from the global RNG: give the loader its own stream
            loader.generator = torch.Generator().manual_seed(seed)
            sampler.set_epoch(trainer.current_epoch)
            if self.resume_at is not None:
                sampler.resume_at(self.resume_at["epoch"], self.resume_at["consumed"])
                self._anchor, self._anchor_batch = (self.resume_at["epoch"], self.resume_at["consumed"]), None
            else:
                sampler.resume_at(trainer.current_epoch, None)  # a sampler kept from an earlier fit starts afresh
            self.samplers.append((sampler, batch_sampler))
        resumed = self.resume_at or {}
        saved, dataset = resumed.get("epoch_samples"), self.samplers[0][0].n if self.samplers else None
        if isinstance(saved, int) and saved > 0 and resumed.get("epoch_dataset") == dataset:
            self.epoch_samples = saved
        else:  # a fresh run, another dataset, or a limited epoch: measured on this world (again after a resize)
            self.epoch_samples = self.epoch_samples_now(trainer)
        self.epoch_dataset = dataset
        self.resume_at = None
        if self.samplers and len(self.samplers) == len(loaders):
            # Lightning warns that a mid-epoch resume without a stateful loader is unreliable: not with ours
            warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
        if self.samplers:
            # the fit loop already prefetched a batch with the old sampler: start over with ours
            restart_train_iterator(trainer)

    def track(self, trainer: pl.Trainer, batch_idx: int) -> None:
        if not self.samplers:
            return
        sampler, batch_size = self.first()
        consumed = (batch_idx + 1) * batch_size * sampler.num_replicas
        if self._anchor is not None and self._anchor[0] == trainer.current_epoch:
            if self._anchor_batch is None:
                self._anchor_batch = batch_idx  # the resumed epoch's first batch in this run
            consumed = self._anchor[1] + (batch_idx - self._anchor_batch + 1) * batch_size * sampler.num_replicas
        self.position = {
            "epoch": trainer.current_epoch,
            "consumed": consumed,
            # what made the global batch, so a resume on another world can say what changed
            "replicas": sampler.num_replicas,
            "batch_size": batch_size,
            "accumulation": int(trainer.accumulate_grad_batches),
            "configured": self.configured_k,
            # where an epoch ends, when the loader alone decides it (no limit_train_batches)
            **(
                {"epoch_samples": self.epoch_samples, "epoch_dataset": self.epoch_dataset}
                if self.epoch_samples is not None and self.epoch_dataset is not None and _unlimited(trainer)
                else {}
            ),
            "world": trainer.world_size,
        }

    def first(self) -> tuple[ResumableSampler, int]:
        """The first owned loader's sampler and per-rank batch size."""
        sampler, batch_sampler = self.samplers[0]
        return sampler, batch_sampler.batch_size

    def samples_per_batch(self) -> int:
        """Global samples of one training batch of the first owned loader (replicas x per-rank batch)."""
        sampler, batch_size = self.first()
        return sampler.num_replicas * batch_size

    def epoch_samples_now(self, trainer: pl.Trainer) -> int | None:
        """Global samples an epoch of this fit takes as its loader stands (None: unknown or unbounded)."""
        batches = trainer.num_training_batches
        if not self.samplers or batches == float("inf"):
            return None
        return int(batches) * self.samples_per_batch()

    def restart_at(self, trainer: pl.Trainer, epoch: int, consumed: int) -> None:
        """Continue ``epoch`` at global position ``consumed`` instead (a whole window of this world's)."""
        for sampler, _ in self.samplers:
            sampler.resume_at(epoch, consumed)
        self._anchor, self._anchor_batch = (epoch, consumed), None
        restart_train_iterator(trainer)

    def resize(self, batch_size: int) -> None:
        """Give every owned loader another per-rank batch size (a resume that keeps the global batch on another
        number of replicas); the caller recounts the epoch's batches and restarts the iterator."""
        for _, batch_sampler in self.samplers:
            batch_sampler.batch_size = batch_size


def _unlimited(trainer: pl.Trainer) -> bool:
    limit = trainer.limit_train_batches
    return isinstance(limit, float) and limit == 1.0


def _resumable(source: Any, seed: int) -> ResumableSampler | None:
    if isinstance(source, ResumableSampler):
        return source
    if isinstance(source, DistributedSampler):
        return ResumableSampler(
            len(source.dataset),  # type: ignore[arg-type]
            num_replicas=source.num_replicas,
            rank=source.rank,
            shuffle=source.shuffle,
            seed=source.seed,
            drop_last=source.drop_last,
        )
    if isinstance(source, (RandomSampler, SequentialSampler)):
        return ResumableSampler(len(source.data_source), shuffle=isinstance(source, RandomSampler), seed=seed)  # type: ignore[arg-type]
    return None
