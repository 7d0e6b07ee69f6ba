"""What FaultTolerantCheckpoint does once its hooks decided: save a step folder (in the background or not),
roll back to the last checkpoint, and leave on a preemption (save, requeue, exit code), with checkpoint I/O
kept out of the watchdog's clock."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Generator
from pathlib import Path

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only

from lightning_hybrid.callbacks._nan_policy import roll_back
from lightning_hybrid.callbacks._preemption import (
    exit_after_preemption,
    under_slurm,
)
from lightning_hybrid.callbacks._resume import capture_rng
from lightning_hybrid.callbacks._writer import load_target
from lightning_hybrid.checkpoint._store import StepFolder

log = logging.getLogger("lightning_hybrid.callbacks.fault_tolerant")  # the callback's own logger
event = rank_zero_only(log.warning)  # failures handled: shown whatever the warning filters, once per job


class CheckpointActions:
    """FaultTolerantCheckpoint's actions (uses its writer, flag, NaN policy and watchdog)."""

    def leaves_model_gradients_alone(self) -> bool:
        """Its gradient hooks read the optimizer's param groups only (``LeavesModelGradientsAlone``)."""
        return True

    @contextlib.contextmanager
    def _io(self) -> Generator[None, None, None]:
        """Waiting on checkpoint I/O (or a peer's): never a hang for the watchdog, however long."""
        if self._watchdog is None:
            yield
            return
        with self._watchdog.paused():
            yield

    def _shutdown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None

    def _save(self, trainer: pl.Trainer, step: int, *, background: bool) -> StepFolder | None:
        """Start checkpoint ``step`` (after completing the previous one); a synchronous save also completes
        it and returns the folder (``None`` if it failed on some rank)."""
        assert self._writer is not None
        with self._io():
            self._writer.finish(trainer)
            per_rank = {"rng": capture_rng(), "data": dict(self._data.samplers.position), "rank": trainer.global_rank}
            self._writer.start(trainer, step, per_rank, background=background)
            self._last_saved_step = step
            self._last_save_time = time.monotonic()
            return None if background else self._writer.finish(trainer)

    def _on_complete(self, folder: StepFolder) -> None:
        """Every rank, once a checkpoint is complete (rank 0 also moves the pointer and prunes old ones)."""
        self.last_model_path = str(load_target(folder.path))
        self._resume.completed(folder, keep_last=self.keep_last)

    def _rollback(self, trainer: pl.Trainer) -> str | None:
        assert self._writer is not None
        with self._io():
            self._writer.finish(trainer)
            return roll_back(trainer, Path(self.last_model_path)) if self.last_model_path else None

    def _announce_preemption(self) -> None:
        if not self._preempting:
            self._preempting = True
            rank_zero_info("FaultTolerantCheckpoint: preemption signal received; saving at the next step boundary")

    def _preempt(self, trainer: pl.Trainer, step: int) -> None:
        """Save what is not saved yet, then exit: 75 (requeued) when the newest work is on disk, 74 when not."""
        assert self._writer is not None
        with self._io():
            saved = True
            if self._writer.pending is not None:
                saved = self._writer.finish(trainer) is not None
            if step > 0 and (step > self._resume.complete_step or not saved):
                saved = self._save(trainer, step, background=False) is not None
        self._shutdown()
        requeue = self.requeue if self.requeue is not None else under_slurm()
        exit_after_preemption(trainer, step, saved=saved, requeue=requeue, newest=self.last_model_path, report=event)

    @staticmethod
    def _is_last_step(trainer: pl.Trainer) -> bool:
        if 0 <= trainer.max_steps <= trainer.global_step:
            return True
        last_epoch = trainer.max_epochs is not None and trainer.current_epoch + 1 >= trainer.max_epochs
        return last_epoch and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
