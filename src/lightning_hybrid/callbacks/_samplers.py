"""Owning the training data order, so that a resume continues mid-epoch with exactly the unseen samples.

Lightning's samplers cannot start part-way through an epoch, and under DDP it reshuffles from an RNG no
checkpoint holds. The callback swaps a training loader's sampler for a :class:`ResumableSampler` only where
that yields the order the loader would have drawn (Lightning's ``DistributedSampler``, seeded by seed +
epoch; an unseeded ``RandomSampler`` without replacement; ``SequentialSampler``) and records the position in
the epoch's global order after every batch. Any other sampler (weighted, with replacement, seeded by the
user, inside Lightning's ``DistributedSamplerWrapper``, an IterableDataset, a batch sampler of the user's) is
the one that trains: the position is then recorded in batches, and a mid-epoch resume starts the epoch again
(``_resume_data``). A loader Lightning itself restores (one with ``state_dict`` / ``load_state_dict``) is left
to it.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler

from lightning_hybrid._lightning_compat import restart_train_iterator, train_dataloaders, wrapped_sampler
from lightning_hybrid.callbacks._resume import ResumableSampler

__all__ = ["SamplerOwner", "data_replicas"]

log = logging.getLogger("lightning_hybrid.callbacks.fault_tolerant")


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
        self.kept: list[str] = []  # the training loaders whose own order trains (not positioned by the callback)
        self.kept_batch_size: int | None = None  # the first kept loader's per-rank batch size, where it says
        # the weight the uninterrupted run gave each epoch's short last window (r/K), once a resume rescaled K
        self.window_weight: tuple[int, int] | None = None

    def own(self, trainer: pl.Trainer) -> None:
        """Swap each training loader's sampler for a ResumableSampler that yields the same order."""
        self.samplers = []
        if self.configured_k is None:  # once: a resume on another world rescales the Trainer's K after this
            self.configured_k = int(trainer.accumulate_grad_batches)
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        loaders = train_dataloaders(trainer)
        self.kept, self.kept_batch_size = [], None
        for loader in loaders:
            if callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None)):
                continue  # Lightning saves and restores its position itself
            batch_sampler = getattr(loader, "batch_sampler", None)
            sampler = None
            if isinstance(loader, DataLoader) and type(batch_sampler) is BatchSampler:
                sampler = _resumable(batch_sampler.sampler, seed)
            if sampler is None:
                source = batch_sampler.sampler if type(batch_sampler) is BatchSampler else batch_sampler
                self.kept.append(_describe(source if source is not None else loader))
                size = getattr(loader, "batch_size", None) or getattr(batch_sampler, "batch_size", None)
                if not self.kept_batch_size and isinstance(size, int) and not isinstance(size, bool) and size > 0:
                    self.kept_batch_size = size
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
        if self.kept:
            self._say_what_is_kept(trainer)
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

    def _say_what_is_kept(self, trainer: pl.Trainer) -> None:
        """Once at the start (rank 0): whose order trains (a mid-epoch resume says more, on every rank)."""
        rank_zero_warn(
            f"FaultTolerantCheckpoint: the training data comes from {', '.join(self.kept)}, which keeps its own order"
            " (it is what trains); a resume in the middle of an epoch cannot start it part-way, so such a resume"
            " starts its epoch again from the first batch. A sampler FaultTolerantCheckpoint can position:"
            " DistributedSampler, RandomSampler without replacement or generator, SequentialSampler; or give the"
            " loader state_dict() and load_state_dict() (Lightning restores it)."
        )

    def track(self, trainer: pl.Trainer, batch_idx: int) -> None:
        batching = {
            # what made the global batch, so a resume on another world can say what changed
            "replicas": data_replicas(trainer),
            "accumulation": int(trainer.accumulate_grad_batches),
            "configured": self.configured_k,
            "world": trainer.world_size,
            **(dict(zip(("weight_num", "weight_den"), self.window_weight)) if self.window_weight else {}),
        }
        if not self.samplers:
            if self.kept:  # a position in batches: a resume says what cannot be kept
                size = {"batch_size": self.kept_batch_size} if self.kept_batch_size else {}
                self.position = {"epoch": trainer.current_epoch, "batches": batch_idx + 1, **batching, **size}
            return
        sampler, batch_size = self.first()
        consumed = (batch_idx + 1) * batch_size * sampler.num_replicas
        if self._anchor is not None and self._anchor[0] == trainer.current_epoch:
            if self._anchor_batch is None:
                self._anchor_batch = batch_idx  # the resumed epoch's first batch in this run
            consumed = self._anchor[1] + (batch_idx - self._anchor_batch + 1) * batch_size * sampler.num_replicas
        if self.epoch_samples is not None:
            consumed = min(consumed, self.epoch_samples)  # the epoch's last batch may be short
        self.position = {
            "epoch": trainer.current_epoch,
            "consumed": consumed,
            **batching,
            "replicas": sampler.num_replicas,
            "batch_size": batch_size,
            # where an epoch ends, when the loader alone decides it (no limit_train_batches)
            **(
                {"epoch_samples": self.epoch_samples, "epoch_dataset": self.epoch_dataset}
                if self.epoch_samples is not None and self.epoch_dataset is not None and _unlimited(trainer)
                else {}
            ),
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
        """Global samples an epoch of this fit takes as its loader stands (None: unknown or unbounded); the last
        per-rank batch may be short (``drop_last=False``)."""
        batches = trainer.num_training_batches
        if not self.samplers or batches == float("inf"):
            return None
        (sampler, batch_sampler), size = self.samplers[0], self.first()[1]
        per_rank = len(sampler) - (len(sampler) % size if batch_sampler.drop_last else 0)
        if batches < -(-per_rank // size):  # limit_train_batches ends the epoch earlier, on whole batches
            return int(batches) * self.samples_per_batch()
        return per_rank * sampler.num_replicas

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


def data_replicas(trainer: pl.Trainer) -> int:
    """Data-parallel ranks (a pipeline's stages see the same samples; single-device strategies have none)."""
    strategy = trainer.strategy
    return (
        int(strategy.distributed_sampler_kwargs.get("num_replicas", 1)) if isinstance(strategy, ParallelStrategy) else 1
    )


def _unlimited(trainer: pl.Trainer) -> bool:
    limit = trainer.limit_train_batches
    return isinstance(limit, float) and limit == 1.0


def _resumable(source: Any, seed: int) -> ResumableSampler | None:
    """The ResumableSampler that yields ``source``'s order, for the samplers whose order it reproduces only (the
    exact classes: a subclass, Lightning's DistributedSamplerWrapper among them, draws its own)."""
    if isinstance(source, ResumableSampler):
        return source
    if type(source) is DistributedSampler:
        return ResumableSampler(
            len(source.dataset),  # type: ignore[arg-type]
            num_replicas=source.num_replicas,
            rank=source.rank,
            shuffle=source.shuffle,
            seed=source.seed,
            drop_last=source.drop_last,
        )
    if type(source) is SequentialSampler:
        return ResumableSampler(len(source.data_source), shuffle=False, seed=seed)  # type: ignore[arg-type]
    if (
        type(source) is RandomSampler
        and not source.replacement
        and source.generator is None
        and source.num_samples == len(source.data_source)  # type: ignore[arg-type]
    ):  # a permutation from the global RNG: the seeded one is as good, and can start part-way
        return ResumableSampler(len(source.data_source), shuffle=True, seed=seed)  # type: ignore[arg-type]
    return None


def _describe(sampler: Any) -> str:
    name = type(sampler).__name__
    if isinstance(sampler, DistributedSampler) and type(sampler) is not DistributedSampler:
        inner = wrapped_sampler(sampler)  # Lightning's wrapper around the user's sampler
        inner_name = type(inner).__name__ if inner is not None else "the user's sampler"
        return f"{inner_name} (inside {name})"
    return name
