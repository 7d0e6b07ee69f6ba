"""Resuming on another number of data-parallel replicas with the uninterrupted run's samples per step.

A checkpoint's data position records what made its global batch: the data-parallel replicas, the per-rank
batch size, the accumulation and the world size. A resume whose replicas x per-rank batch differ would take
another number of samples per optimizer step (the loss curve departs from the uninterrupted run's), and
Lightning would count the resumed epoch in the old world's batches (the accumulation window closes early,
the epoch's end is missed). :func:`plan` decides what this run does about it; it reads only the
checkpoint's global position and this run's sizes, so every rank decides the same, and a refusal is raised
by every rank before step 0 with nothing deleted. :func:`apply` carries the decision out: the accumulation
``K' = K x old / new`` (through the accumulation schedule when there is one, so it continues keyed by its
unit), or, where that is not whole, the per-rank batch size; and Lightning's batch counter of the resumed
epoch in this world's batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Literal, Protocol, Union, get_args, runtime_checkable

import lightning.pytorch as pl

from lightning_hybrid._lightning_compat import (
    epoch_finished_at_restore,
    limit_training_batches,
    move_batch_counter,
    recount_training_batches,
)
from lightning_hybrid.callbacks._samplers import SamplerOwner

__all__ = [
    "WORLD_SIZE_CHANGES",
    "Batching",
    "OnWorldSizeChange",
    "WorldPlan",
    "apply",
    "keep_epoch_end",
    "plan",
    "restart_window",
    "schedule_of",
    "set_accumulation",
]

OnWorldSizeChange = Literal["keep_global_batch", "keep_per_rank_batch", "refuse"]
WORLD_SIZE_CHANGES: tuple[str, ...] = get_args(OnWorldSizeChange)


@runtime_checkable
class RescalesAccumulation(Protocol):
    """A callback that owns ``accumulate_grad_batches`` (an accumulation schedule): a resume on another number of
    replicas multiplies its K, now and for the rest of its schedule, by a factor."""

    @property
    def accumulate_grad_batches(self) -> int: ...

    def can_rescale_accumulation(self, factor: Fraction) -> bool:
        """Whether every K it may choose stays a whole number under ``factor``."""
        ...

    def rescale_accumulation(self, factor: Fraction) -> int:
        """Multiply K (and the rest of the schedule) by ``factor``; returns the K in force now."""
        ...

    def rewind_samples(self, samples: int) -> None:
        """The resume takes ``samples`` (global) again: its count of samples seen goes back by as many."""
        ...


def schedule_of(trainer: pl.Trainer) -> RescalesAccumulation | None:
    return next((c for c in trainer.callbacks if isinstance(c, RescalesAccumulation)), None)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class Batching:
    """What makes a global batch: replicas x per-rank batch size x accumulation."""

    replicas: int
    batch_size: int
    accumulation: int
    world: Union[int, None] = None

    @property
    def per_batch(self) -> int:
        """Samples each batch of the accumulation window brings in, over all replicas."""
        return self.replicas * self.batch_size

    @property
    def global_batch(self) -> int:
        return self.per_batch * self.accumulation

    @classmethod
    def recorded(cls, position: dict[str, Any] | None) -> Batching | None:
        """From a checkpoint's data position; None if it does not say (written by an earlier version)."""
        if not position:
            return None
        values = [position.get(key) for key in ("replicas", "batch_size", "accumulation")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
            return None
        world = position.get("world")
        return cls(*values, world=world if isinstance(world, int) and world >= 1 else None)  # type: ignore[arg-type]


@dataclass(frozen=True)
class WorldPlan:
    """What a resume on another world does: ``new`` is what this run trains with from the resumed batch on."""

    old: Batching
    new: Batching
    policy: OnWorldSizeChange
    epoch: int
    consumed: int  # global samples of the resumed epoch already trained on, by the checkpoint
    loader_batch: int  # this run's per-rank batch size as configured
    factor: Fraction = Fraction(1)  # what this run's accumulation (and its schedule's) is multiplied by
    configured: Union[int, None] = None  # the Trainer's K as configured, where the checkpoint's is kept instead

    @property
    def same_batches(self) -> bool:
        """Each batch of the window brings in what it did: Lightning's restored counter is in this world's batches."""
        return self.new.per_batch == self.old.per_batch

    def resume_sample(self) -> int:
        """Where the resumed epoch continues: the checkpoint's sample, or, when that is inside a window of this
        world (a checkpoint written mid-window, by a preemption during validation or at a run's end), the start
        of that window: its gradient was never applied, so its samples are taken again in one whole window, on
        every replica alike."""
        window = self.new.per_batch * self.new.accumulation
        return self.consumed - self.consumed % window

    def batches(self) -> int:
        """Batches of the resumed epoch already consumed, in this world's batches."""
        return self.resume_sample() // self.new.per_batch

    def line(self, positioned: bool = True) -> str:
        """What changed, and (``positioned``: the callback's sampler continues the epoch) where the data resumes."""
        old, new = self.old, self.new
        world = f"world {old.world or '?'} -> {new.world} (dp {old.replicas} -> {new.replicas})"
        where = f"resuming at sample {self.resume_sample()} of epoch {self.epoch}"
        if not positioned:
            where = "the loader's own order goes on"
        elif self.resume_sample() != self.consumed:
            where += (
                f" (the checkpoint was written at sample {self.consumed}, inside one of this world's accumulation"
                " windows: that window is taken again from its start, on every replica alike)"
            )
        if self.policy == "keep_per_rank_batch":
            return (
                f"{world}: per-rank batch {new.batch_size} and accumulation {new.accumulation} kept"
                f" (on_world_size_change='keep_per_rank_batch'), global batch {old.global_batch} ->"
                f" {new.global_batch}: the loss curve departs from the uninterrupted run's; {where}"
            )
        changes = []
        if self.configured is not None:
            changes.append(
                f"accumulation {new.accumulation} kept from the checkpoint (accumulate_grad_batches={self.configured}"
                " configured; on_world_size_change='keep_per_rank_batch' uses it)"
            )
        if new.accumulation != old.accumulation:
            changes.append(f"accumulation {old.accumulation} -> {new.accumulation}")
        if new.batch_size != self.loader_batch:
            changes.append(f"per-rank batch {self.loader_batch} -> {new.batch_size}")
        return f"{world}: {', '.join(changes)}, global batch {new.global_batch} kept, {where}"


def plan(
    position: dict[str, Any] | None,
    *,
    world: int,
    replicas: int,
    batch_size: int,
    accumulation: int,
    policy: OnWorldSizeChange,
    schedule: RescalesAccumulation | None = None,
    engine: str | None = None,
    microbatches: int = 1,
    resize_problem: str | None = None,
    keep_problem: str | None = None,
) -> WorldPlan | None:
    """The resume's plan, or None when each batch of the window brings in what it did (or nothing is known).

    ``batch_size``, ``accumulation``: this run's per-rank batch and the Trainer's K as configured (kept by
    ``"keep_per_rank_batch"``; the global batch is kept from the checkpoint's K, or the schedule's when there is
    one); ``engine``: an engine whose accumulation is fixed when it is built (DeepSpeed); ``microbatches``: what
    the per-rank batch must be a multiple of; ``resize_problem``: why the per-rank batch cannot change in this
    run, if it cannot; ``keep_problem``: why the global batch cannot be kept at all, if it cannot.
    """
    old = Batching.recorded(position)
    if old is None or position is None:
        return None
    new = Batching(replicas, batch_size, accumulation, world)
    at = {
        "epoch": int(position.get("epoch", 0)),
        "consumed": int(position.get("consumed", 0)),
        "loader_batch": batch_size,
    }
    if new.per_batch == old.per_batch:
        configured = position.get("configured")
        if policy != "keep_global_batch" or schedule is not None or accumulation == old.accumulation:
            return None
        if configured is not None and configured != accumulation:
            return None  # the configuration's K changed since: the user's choice
        # the configuration is the one that was rescaled by an earlier resume on another world: a restart on this
        # world must not silently undo the rescale
        kept = Batching(replicas, batch_size, old.accumulation, world)
        return WorldPlan(old, kept, policy, **at, configured=accumulation)
    was = (
        f"the checkpoint was written on {old.world or '?'} rank(s) with {old.replicas} data-parallel replica(s) x"
        f" per-rank batch {old.batch_size} x accumulation {old.accumulation} = global batch {old.global_batch};"
        f" this run has {replicas} replica(s) x per-rank batch {batch_size} on {world} rank(s)"
    )
    if policy == "refuse":
        raise ValueError(
            f"FaultTolerantCheckpoint(on_world_size_change='refuse'): {was}. Resume on {old.replicas} replica(s), or"
            " pass on_world_size_change='keep_global_batch' (rescales the accumulation or the per-rank batch) or"
            " 'keep_per_rank_batch'. Nothing was deleted."
        )
    if policy == "keep_per_rank_batch":
        return WorldPlan(old, new, policy, **at)
    if keep_problem is not None:
        raise ValueError(
            f"FaultTolerantCheckpoint cannot keep the global batch on this world: {was}; {keep_problem}. Pass"
            " on_world_size_change='keep_per_rank_batch' to go on with another global batch. Nothing was deleted."
        )
    factor = Fraction(old.per_batch, new.per_batch)
    # K of the uninterrupted run at this point: the schedule's (restored with it), else the checkpoint's
    accumulation = schedule.accumulate_grad_batches if schedule is not None else old.accumulation
    k = accumulation * factor
    if k.denominator == 1 and engine is None and (schedule is None or schedule.can_rescale_accumulation(factor)):
        return WorldPlan(old, Batching(replicas, batch_size, int(k), world), policy, **at, factor=factor)
    per_rank = Fraction(old.per_batch, replicas)
    fits = per_rank.denominator == 1 and int(per_rank) % microbatches == 0
    if fits and engine is None and resize_problem is None:
        return WorldPlan(old, Batching(replicas, int(per_rank), accumulation, world), policy, **at)
    usable = [d for d in range(1, old.global_batch + 1) if old.global_batch % (d * batch_size) == 0]
    per_rank_fix = ""
    if engine is not None:
        how = f"{engine} fixes its accumulation and micro-batch size when its engine is built"
        if fits:
            per_rank_fix = f"set the per-rank batch size to {per_rank} in the configuration"
    else:
        how = f"accumulation {accumulation} x {factor} = {k} is not a whole number"
        if schedule is not None and k.denominator == 1:
            how = f"the accumulation schedule's K values x {factor} are not all whole numbers"
        if per_rank.denominator != 1:
            how += f", nor is a per-rank batch of {old.per_batch}/{replicas}"
        elif int(per_rank) % microbatches:
            how += f", and a per-rank batch of {per_rank} is not a multiple of num_microbatches ({microbatches})"
        elif resize_problem is not None:
            how += f", and the per-rank batch cannot become {per_rank} in this run: {resize_problem}"
            per_rank_fix = f"set the per-rank batch size to {per_rank} in the configuration"
    raise ValueError(
        f"FaultTolerantCheckpoint cannot keep the global batch on this world: {was}; {how}. Resume on a world with"
        f" {' or '.join(map(str, usable))} data-parallel replica(s) (per-rank batch {batch_size}), "
        + (f"{per_rank_fix}, " if per_rank_fix else "")
        + "or pass on_world_size_change='keep_per_rank_batch' to go on with another global batch. Nothing was"
        " deleted."
    )


def apply(
    trainer: pl.Trainer,
    change: WorldPlan,
    schedule: RescalesAccumulation | None,
    samplers: SamplerOwner,
    epoch_samples: int | None = None,
) -> str | None:
    """Carry the plan out before the resumed epoch's first batch: the accumulation (the schedule's, which sets the
    Trainer's), the per-rank batch size of the loader whose sampler the callback owns, the epoch's end, the
    sampler's position (a window's start), and Lightning's batch counter of the resumed epoch in this world's
    batches. Returns a note when the uninterrupted run's epoch end cannot be kept."""
    set_accumulation(trainer, change, schedule)
    if change.new.batch_size != change.loader_batch:
        samplers.resize(change.new.batch_size)
        recount_training_batches(trainer)  # restarts the iterator
    note = keep_epoch_end(trainer, samplers, epoch_samples) if change.policy == "keep_global_batch" else None
    if epoch_finished_at_restore(trainer):  # at an epoch's last batch (Lightning may count the next one already)
        if trainer.num_training_batches != float("inf") and not change.same_batches:
            move_batch_counter(trainer, int(trainer.num_training_batches))
        return note
    if change.epoch != trainer.current_epoch:
        return note  # the next epoch starts from its first batch
    if change.resume_sample() != change.consumed:
        _take_window_again(trainer, samplers, schedule, change.epoch, change.consumed, change.resume_sample())
    elif not change.same_batches:
        move_batch_counter(trainer, change.batches())
    return note


def set_accumulation(trainer: pl.Trainer, change: WorldPlan, schedule: RescalesAccumulation | None) -> None:
    """The plan's accumulation: the schedule's (which sets the Trainer's) and the Trainer's."""
    if schedule is not None and change.factor != 1:
        schedule.rescale_accumulation(change.factor)
    trainer.accumulate_grad_batches = change.new.accumulation


def _take_window_again(
    trainer: pl.Trainer, samplers: SamplerOwner, schedule: Any, epoch: int, consumed: int, start: int
) -> None:
    """Continue ``epoch`` at ``start``, the start of the window the checkpoint (at ``consumed``) was written
    inside: the sampler, Lightning's batch counter and a schedule's count of samples seen go back there."""
    samplers.restart_at(trainer, epoch, start)
    move_batch_counter(trainer, start // samplers.samples_per_batch())
    if schedule is not None:
        schedule.rewind_samples(consumed - start)


def restart_window(trainer: pl.Trainer, samplers: SamplerOwner, position: dict[str, Any], schedule: Any) -> str | None:
    """A resume on the same samples per batch from a checkpoint written inside an accumulation window (a
    preemption during a validation that falls mid-window, the save at a run's end): the checkpoint holds none of
    that window's gradient, so the window is taken again from its start (Lightning would go on mid-window, and the
    step would miss the window's first batches). The line that says so, or None."""
    epoch, consumed = int(position.get("epoch", -1)), int(position.get("consumed", 0))
    if epoch != trainer.current_epoch or epoch_finished_at_restore(trainer):
        return None
    per_batch = samplers.samples_per_batch()
    start = consumed - consumed % (per_batch * int(trainer.accumulate_grad_batches))
    if start == consumed:
        return None
    _take_window_again(trainer, samplers, schedule, epoch, consumed, start)
    return (
        f"the checkpoint was written at sample {consumed} of epoch {epoch}, inside an accumulation window whose"
        f" gradient it does not hold: resuming at the window's start, sample {start}"
    )


def keep_epoch_end(trainer: pl.Trainer, samplers: SamplerOwner, epoch_samples: int | None) -> str | None:
    """End each epoch at the uninterrupted run's sample ``epoch_samples``: its loader dropped the last, partial
    per-rank batch (``drop_last``) or padded, so its epoch's length depends on its replicas and batch size. A
    note when this world's batches cannot end there (the epoch ends where this world's loader ends it)."""
    natural = samplers.epoch_samples_now(trainer)
    if epoch_samples is None or natural is None or epoch_samples == natural:
        return None
    per_batch = samplers.samples_per_batch()
    if epoch_samples > natural:
        return (
            f"each epoch of the uninterrupted run took {epoch_samples} samples, more than this world's loader holds"
            f" ({natural}): epochs end earlier here"
        )
    if epoch_samples % per_batch:
        return (
            f"each epoch of the uninterrupted run took {epoch_samples} samples, not a whole number of this world's"
            f" batches of {per_batch}: epochs take {natural} here, so the last window of each differs"
        )
    limit_training_batches(trainer, epoch_samples // per_batch)
    samplers.epoch_samples = epoch_samples
    return (
        f"each epoch ends at sample {epoch_samples} as in the uninterrupted run ({epoch_samples // per_batch} batches)"
    )
