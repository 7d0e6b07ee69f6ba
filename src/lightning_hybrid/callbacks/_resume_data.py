"""What a resume does with the training data, on this world, for every kind of loader and checkpoint.

Three cases. The callback owns the loader's sampler: the epoch continues at the checkpoint's global sample, on
another number of replicas too, with the global batch kept or refused as the policy says (:mod:`._world_change`
plans it). The loader keeps its own order (an IterableDataset, a sampler or batch sampler of the user's): the
global batch is still checked, refused or kept (the accumulation needs no sampler), but a checkpoint written
mid-epoch cannot start that order part-way, so its epoch starts again from the first batch: the batches it had
trained come again, none of the rest is skipped. The checkpoint holds no data position (Lightning's
``ModelCheckpoint`` in a run without this callback): the world it was written on is unknown, so ``"refuse"``
refuses, and otherwise its epoch starts again the same way. Each rank says what it does in its own log (a rank
may run alone on its node). A resume that rescales ``K`` through the Trainer also weights each epoch's short
last window as the run that wrote the checkpoint did (:class:`ShortWindow`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from torch.optim import Optimizer

from lightning_hybrid._lightning_compat import (
    epoch_finished_at_restore,
    move_batch_counter,
    restored_batches,
    train_dataloaders,
)
from lightning_hybrid._protocols import ExactWindowMeans, ShardedCheckpointing, StepsInsideTrainingStep
from lightning_hybrid.callbacks._samplers import SamplerOwner, data_replicas
from lightning_hybrid.callbacks._world_change import (
    Batching,
    OnWorldSizeChange,
    WorldPlan,
    apply,
    keep_epoch_end,
    plan,
    restart_window,
    schedule_of,
    set_accumulation,
)

__all__ = ["DataResume", "ShortWindow", "adapt_to_world"]

log = logging.getLogger("lightning_hybrid.callbacks.fault_tolerant")


class DataResume:
    """FaultTolerantCheckpoint's data side: the training samplers, the resumed checkpoint's data position, and
    what the resume does with it on this world."""

    def __init__(self) -> None:
        self.samplers = SamplerOwner()
        self.position: dict[str, int] | None = None  # the data position of the checkpoint resumed
        self.unknown: str | None = None  # the checkpoint resumed, where it holds no data position
        self.short: ShortWindow | None = None  # the weight of each epoch's short last window, where it changed

    def forget(self) -> None:
        """A new fit: nothing resumed yet."""
        self.position = self.unknown = self.short = None

    def restore(self, position: Any) -> None:
        """The position in the callback's state (rank 0's; the global position is the same on every rank), where
        this rank's own file gave none."""
        if self.samplers.resume_at is None and isinstance(position, dict):
            self.samplers.resume_at = {k: int(v) for k, v in position.items()}
            self.position = dict(self.samplers.resume_at)

    def loaded(self, path: str, data: Any, state: Any) -> None:
        """Lightning loaded checkpoint ``path``: ``data``, this rank's position from its rank file (None: not one
        of ours); ``state``, the callback's state in the checkpoint. Neither holding a position: it is unknown."""
        if data is not None:
            self.samplers.resume_at = data
            self.position = dict(data) if isinstance(data, dict) else None
        known = data is not None or (isinstance(state, dict) and isinstance(state.get("data_position"), dict))
        self.unknown = None if known else path

    def start(self, trainer: pl.Trainer, policy: OnWorldSizeChange) -> str | None:
        """At the fit's start: own the samplers, and carry the resume out on this world (the line to log)."""
        self.samplers.own(trainer)
        position, self.position = self.position, None
        line, self.short = adapt_to_world(trainer, position, self.samplers, policy, unknown=self.unknown)
        return line

    def before_step(self, trainer: pl.Trainer, optimizer: Optimizer) -> None:
        if self.short is not None:
            self.short.before_step(trainer, optimizer)


@dataclass(frozen=True)
class ShortWindow:
    """Each epoch's last accumulation window, cut short, weighted as the run that wrote the checkpoint weighted it.

    Lightning divides every batch's loss by ``K``, so a last window of ``r < K`` batches counts ``r / K`` of a
    full one. On another world the same samples make another ``r`` and ``K`` (60 samples, global batch 8: two
    replicas take them in one step of one batch each, one process in a window of 1 of K = 2 batches, half the
    weight): the window's gradient is multiplied by ``scale`` from batch ``first`` of each epoch on."""

    first: int  # this world's batch index where each epoch's last window starts
    scale: Fraction

    def before_step(self, trainer: pl.Trainer, optimizer: Optimizer) -> None:
        if restored_batches(trainer) - 1 < self.first:  # the batch being processed
            return
        for group in optimizer.param_groups:  # element-wise on what the optimizer steps (any ZeRO stage)
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(float(self.scale))


def adapt_to_world(
    trainer: pl.Trainer,
    position: dict[str, Any] | None,
    samplers: SamplerOwner,
    policy: OnWorldSizeChange,
    *,
    unknown: str | None = None,
) -> tuple[str | None, ShortWindow | None]:
    """Plan and apply a resume from ``position`` (the checkpoint's data position; ``unknown``: the checkpoint
    resumed holds none) on this world: the line that says what changed (or None), and the short window's weight
    where it needs one. Raises, on every rank alike, when the policy refuses."""
    if unknown is not None:
        return _without_position(trainer, samplers, policy, unknown), None
    if position is None:
        return None, None
    if not samplers.samplers:
        return _kept_order(trainer, position, samplers, policy), None
    sampler, batch_size = samplers.first()
    schedule = schedule_of(trainer)
    keep_problem, resize_problem = _problems(trainer, samplers)
    change = _plan(trainer, position, policy, sampler.num_replicas, batch_size, keep_problem, resize_problem)
    # where the uninterrupted run's epochs end, when it was measured on this dataset without a limit
    same_data = position.get("epoch_dataset") == samplers.epoch_dataset and samplers.epoch_dataset is not None
    wanted = position.get("epoch_samples") if policy == "keep_global_batch" and same_data else None
    wanted = wanted if isinstance(wanted, int) and not isinstance(wanted, bool) and wanted > 0 else None
    if change is None:
        # the same samples per batch; the epoch may still have been shortened by an earlier resume
        notes = [keep_epoch_end(trainer, samplers, wanted) if keep_problem is None else None]
        notes.append(restart_window(trainer, samplers, position, schedule))
        text = "; ".join(note for note in notes if note)
        short = _short_window(trainer, samplers, position, None, wanted)
        return (f"world {trainer.world_size}: {text}" if text else None), short
    note = apply(trainer, change, schedule, samplers, wanted)
    if wanted is None:  # measured before a resize: measure this world's again
        samplers.epoch_samples = samplers.epoch_samples_now(trainer)
    short = _short_window(trainer, samplers, position, change, wanted)
    return change.line() + (f"; {note}" if note else ""), short


def _plan(
    trainer: pl.Trainer,
    position: dict[str, Any],
    policy: OnWorldSizeChange,
    replicas: int,
    batch_size: int,
    keep_problem: str | None,
    resize_problem: str | None,
) -> WorldPlan | None:
    schedule = schedule_of(trainer)
    strategy = trainer.strategy
    record = strategy.checkpoint_layout() if isinstance(strategy, ShardedCheckpointing) else {}
    return plan(
        position,
        world=trainer.world_size,
        replicas=replicas,
        batch_size=batch_size,
        accumulation=int(trainer.accumulate_grad_batches) if schedule is None else schedule.accumulate_grad_batches,
        policy=policy,
        schedule=schedule,
        engine=strategy.engine_name() if isinstance(strategy, StepsInsideTrainingStep) else None,
        microbatches=int(record.get("num_microbatches") or 1) if record.get("pipeline_parallel_size", 1) > 1 else 1,
        resize_problem=resize_problem,
        keep_problem=keep_problem,
    )


def _problems(trainer: pl.Trainer, samplers: SamplerOwner) -> tuple[str | None, str | None]:
    """Why the global batch cannot be kept at all, and why the per-rank batch cannot change, where they cannot."""
    limit = trainer.limit_train_batches
    keep_problem = None
    if not (isinstance(limit, float) and limit == 1.0):
        keep_problem = (
            f"limit_train_batches={limit!r} counts per-rank batches, so the epoch would end at another sample;"
            " remove it, or set it for this world"
        )
    elif trainer.reload_dataloaders_every_n_epochs:
        keep_problem = (
            "reload_dataloaders_every_n_epochs rebuilds the loader with its configured batch size and length each epoch"
        )
    elif any(isinstance(c, GradientAccumulationScheduler) for c in trainer.callbacks):  # type: ignore[attr-defined]
        keep_problem = (
            "Lightning's GradientAccumulationScheduler sets K from its own schedule each epoch; use"
            " lightning_hybrid.callbacks.AccumulationScheduler, whose schedule is rescaled"
        )
    resize_problem = None
    if samplers.kept:
        resize_problem = f"its batches come from {', '.join(samplers.kept)}, whose batch size is the loader's own"
    elif len(samplers.samplers) != 1 or len(train_dataloaders(trainer)) != 1:
        resize_problem = "there is more than one training loader (or one whose sampler is not resumable)"
    elif trainer.reload_dataloaders_every_n_epochs:
        resize_problem = "reload_dataloaders_every_n_epochs rebuilds the loader with its configured batch size"
    return keep_problem, resize_problem


def _kept_order(
    trainer: pl.Trainer, position: dict[str, Any], samplers: SamplerOwner, policy: OnWorldSizeChange
) -> str | None:
    """The loader keeps its own order: the global batch is planned from the batch sizes alone, and a mid-epoch
    checkpoint's epoch starts again (its order cannot start part-way)."""
    kept = ", ".join(samplers.kept) or "the training loader"
    line = None
    if Batching.recorded(position) is not None and samplers.kept_batch_size is not None:
        keep_problem, resize_problem = _problems(trainer, samplers)
        replicas = data_replicas(trainer)
        change = _plan(trainer, position, policy, replicas, samplers.kept_batch_size, keep_problem, resize_problem)
        if change is not None:
            set_accumulation(trainer, change, schedule_of(trainer))
            line = change.line(positioned=False)
    elif position.get("world") != trainer.world_size:
        what = (
            f"the checkpoint does not record the global batch it was written with (world {position.get('world', '?')},"
            f" this run {trainer.world_size}; the batches of {kept} have no batch_size to read)"
        )
        if policy == "refuse":
            raise ValueError(
                f"FaultTolerantCheckpoint(on_world_size_change='refuse'): {what}. Resume on the world that wrote it, or"
                " pass on_world_size_change='keep_per_rank_batch'. Nothing was deleted."
            )
        line = f"{what}: this run's accumulation and per-rank batch are used as configured"
    _restart_epoch(trainer, samplers, f"{kept} keeps its own order and cannot start part-way through an epoch")
    return line


def _without_position(trainer: pl.Trainer, samplers: SamplerOwner, policy: OnWorldSizeChange, path: str) -> None:
    """A checkpoint without a data position: refused under ``"refuse"``, else its epoch starts again."""
    what = (
        f"{path} holds no data position (it was not written by this FaultTolerantCheckpoint, e.g. by Lightning's"
        " ModelCheckpoint): the world and global batch it was written with, and where its epoch stood, are unknown"
    )
    if policy == "refuse":
        raise ValueError(
            f"FaultTolerantCheckpoint(on_world_size_change='refuse'): {what}. Resume from a checkpoint in this"
            " callback's dirpath, or pass on_world_size_change='keep_global_batch' or 'keep_per_rank_batch' to go on"
            " with this run's accumulation and per-rank batch (a checkpoint written mid-epoch then starts its epoch"
            " again from the first batch). Nothing was deleted."
        )
    if not _restart_epoch(trainer, samplers, what):
        log.warning(
            f"[rank {trainer.global_rank}] FaultTolerantCheckpoint: {what}: this run's accumulation and per-rank batch"
            " are used as configured"
        )


def _restart_epoch(trainer: pl.Trainer, samplers: SamplerOwner, why: str) -> bool:
    """Start a mid-epoch checkpoint's epoch again from its first batch, saying so on this rank; False when the
    checkpoint was written at an epoch's end (the next epoch starts from its first batch anyway)."""
    done = restored_batches(trainer)
    if done == 0 or epoch_finished_at_restore(trainer):
        return False
    epoch = trainer.current_epoch
    move_batch_counter(trainer, 0)
    if samplers.samplers:
        samplers.restart_at(trainer, epoch, 0)
    log.warning(
        f"[rank {trainer.global_rank}] FaultTolerantCheckpoint: {why}: epoch {epoch} starts again from its first"
        f" batch (the {done} batch(es) it had trained come again; none of the rest is skipped)"
    )
    return True


def _short_window(
    trainer: pl.Trainer,
    samplers: SamplerOwner,
    position: dict[str, Any],
    change: WorldPlan | None,
    wanted: int | None,
) -> ShortWindow | None:
    """The weight of each epoch's short last window: the one the checkpoint's run gave it (recorded by an earlier
    rescale, else its ``r / K``) over this world's ``r / K``; None where they are equal or unknown."""
    strategy = trainer.strategy
    if schedule_of(trainer) is not None or (isinstance(strategy, ExactWindowMeans) and strategy.exact_window_means()):
        return None  # the schedule weights short windows by their own length; the strategy counts elements
    epoch = samplers.epoch_samples
    if epoch is None or wanted is None or epoch != wanted or not samplers.samplers:
        return None  # this world's epochs end elsewhere: the note of keep_epoch_end says so
    per_batch, k = samplers.samples_per_batch(), int(trainer.accumulate_grad_batches)
    rest = epoch % (per_batch * k)
    if not rest:
        return None
    recorded = (position.get("weight_num"), position.get("weight_den"))
    if all(isinstance(v, int) and v > 0 for v in recorded):
        weight = Fraction(*recorded)  # type: ignore[arg-type]
    elif change is not None:
        weight = Fraction(math.ceil(Fraction(rest, change.old.per_batch)), change.old.accumulation)
    else:
        return None
    samplers.window_weight = (weight.numerator, weight.denominator)
    scale = weight / Fraction(math.ceil(Fraction(rest, per_batch)), k)
    return ShortWindow((epoch - rest) // per_batch, scale) if scale != 1 else None
