"""FaultTolerantCheckpoint: checkpoints that survive kills, preemption, corruption and divergence.

The callback connects Lightning's hooks to its parts, each a module of its own: the on-disk format
(``lightning_hybrid.checkpoint``), the writer (``_writer``), the resume choice (``_resume_choice``), the
data position (``_resume_data``, ``_samplers``, ``_world_change``), preemption and Slurm (``_preemption``),
the NaN policy (``_nan_policy``) and the watchdog (``_watchdog``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hybrid._agree import agree, distributed_ready
from lightning_hybrid._elastic import prepare_elastic_restart
from lightning_hybrid._lightning_compat import LastCheckpointLookup, grad_scaler
from lightning_hybrid._protocols import ShardedCheckpointing, SkipsNonFiniteSteps, StepsInsideTrainingStep
from lightning_hybrid._skip import skip_schedulers_when
from lightning_hybrid._torch_compat import note_failed_fit, wait_for_gloo_at_exit
from lightning_hybrid._validate import check_bool, check_choice, check_int, check_number
from lightning_hybrid.callbacks._actions import CheckpointActions, event
from lightning_hybrid.callbacks._nan_policy import NanPolicy, NanPolicyName
from lightning_hybrid.callbacks._preemption import (
    PREEMPTION_EXIT_CODE,
    PREEMPTION_SAVE_FAILED_EXIT_CODE,
    SignalFlag,
    parse_signals,
)
from lightning_hybrid.callbacks._resume import restore_rng
from lightning_hybrid.callbacks._resume_choice import ResumeState
from lightning_hybrid.callbacks._resume_data import DataResume
from lightning_hybrid.callbacks._watchdog import HANG_EXIT_CODE, Watchdog
from lightning_hybrid.callbacks._world_change import WORLD_SIZE_CHANGES, OnWorldSizeChange
from lightning_hybrid.callbacks._writer import CheckpointWriter

__all__ = ["HANG_EXIT_CODE", "PREEMPTION_EXIT_CODE", "PREEMPTION_SAVE_FAILED_EXIT_CODE", "FaultTolerantCheckpoint"]

log = logging.getLogger(__name__)


class FaultTolerantCheckpoint(CheckpointActions, LastCheckpointLookup):
    """Failure-aware checkpointing: atomic, checksummed, agreed across ranks, exact to resume.

    Each checkpoint is a folder ``dirpath/step-<N>`` whose files are written under temporary names,
    flushed, fsynced and renamed; a ``manifest.json`` listing every file's size and SHA-256 is written last
    and makes it count. ``trainer.fit(model, ckpt_path="last")`` resumes from the newest checkpoint that
    every rank can read and whose checksums match (the callback answers Lightning's "last" itself, whatever
    ``last.ckpt`` is); a truncated, corrupted, incomplete or hostile one is skipped with a log line naming
    it. Nothing in a checkpoint folder is ever executed: payloads load with ``weights_only=True`` and torch
    DCP's index through an allow-list. Resuming restores the model, optimizers, LR schedulers, precision
    plugin, callbacks, each rank's RNG streams and the position in the epoch's data, so a run killed at any
    step ends with the weights of an uninterrupted one.

    Preemption signals only set a flag; at the next training or validation batch boundary the ranks agree
    (one small all-reduce), save together, requeue the job under Slurm and exit with
    ``PREEMPTION_EXIT_CODE`` (75), or ``PREEMPTION_SAVE_FAILED_EXIT_CODE`` (74, not requeued) when that save
    failed. A watchdog exits a hung rank with ``HANG_EXIT_CODE`` (76) instead of waiting out the collective
    timeout. A non-finite gradient or loss (agreed across ranks) skips the step, rolls back to the last
    checkpoint, or raises.

    Works with single device, DDP, ``ModelParallelStrategy`` and ``HybridParallelStrategy`` (sharded
    checkpoints that resume on another world size or pipeline/data-parallel layout).

    Args:
        dirpath: folder of the step checkpoints (shared by all nodes).
        every_n_train_steps: save after every N optimizer steps.
        every_n_minutes: save when this many minutes passed since the last save (rank 0's clock decides).
            If neither is given, every 30 minutes.
        keep_last: verified checkpoints to keep (>= 2, so a corrupted newest one has a fallback).
        async_save: stage the state in CPU memory and write it in the background while training goes on.
        signals: names of the preemption signals to handle (e.g. the one ``sbatch --signal`` sends).
        requeue: after a preemption save, ``scontrol requeue`` the job; ``None``: when running under Slurm.
        nan_policy: on a non-finite gradient (or loss): ``"skip"`` the update (step-interval LR schedulers
            do not advance either; ``global_step`` does), ``"rollback"`` to the last checkpoint and skip
            the data window since (step counter and LR schedule go on), or ``"raise"``; ``None`` disables
            the check.
        max_rollbacks: give up (raise) after this many rollbacks.
        hang_timeout: seconds without a finished step before the watchdog exits the process; ``None`` derives
            it from the step times seen (at least 5 minutes); ``0`` disables the watchdog. Checkpoint I/O
            does not count while every peer's heartbeat goes on (a peer stopped or hung during a save ends it).
        on_world_size_change: a resume on another number of data-parallel replicas (a node lost or added):
            ``"keep_global_batch"`` rescales the accumulation (or, where that is not whole, the per-rank batch
            size) so every step takes the uninterrupted run's samples; ``"keep_per_rank_batch"`` rescales
            nothing and says so; ``"refuse"`` stops before step 0. Either way the data continues at the
            checkpoint's global sample, and one line says what changed.

    Example::

        trainer = Trainer(
            strategy=HybridParallelStrategy(pipeline_parallel_size=2, zero_stage=2),
            callbacks=[FaultTolerantCheckpoint(dirpath="ckpt", every_n_train_steps=500, async_save=True)],
        )
        trainer.fit(model, ckpt_path="last")  # resumes when a valid checkpoint exists, else starts fresh
    """

    def __init__(
        self,
        *,
        dirpath: Union[str, os.PathLike],
        every_n_train_steps: Union[int, None] = None,
        every_n_minutes: Union[float, None] = None,
        keep_last: int = 2,
        async_save: bool = False,
        signals: Sequence[str] = ("SIGTERM", "SIGUSR1"),
        requeue: Union[bool, None] = None,
        nan_policy: Union[NanPolicyName, None] = "skip",
        max_rollbacks: int = 3,
        hang_timeout: Union[float, None] = None,
        on_world_size_change: OnWorldSizeChange = "keep_global_batch",
    ) -> None:
        if not isinstance(dirpath, (str, os.PathLike)) or not os.fspath(dirpath):
            raise ValueError(f"dirpath must be a folder path, got {dirpath!r}.")
        check_int("every_n_train_steps", every_n_train_steps, minimum=1, optional=True)
        check_number("every_n_minutes", every_n_minutes, minimum=0, inclusive=False, optional=True)
        check_int(
            "keep_last", keep_last, minimum=2,
            fix="the previous checkpoint is the fallback when the newest one turns out to be corrupted",
        )  # fmt: skip
        check_bool("async_save", async_save)
        parsed_signals = parse_signals(signals)
        check_bool("requeue", requeue, optional=True)
        check_choice("nan_policy", nan_policy, ("skip", "rollback", "raise", None))
        check_int("max_rollbacks", max_rollbacks, minimum=0)
        check_choice("on_world_size_change", on_world_size_change, WORLD_SIZE_CHANGES)
        check_number(
            "hang_timeout", hang_timeout, minimum=0, optional=True,
            fix="use None to derive it from the step times, or 0 to disable the watchdog",
        )  # fmt: skip
        super().__init__(dirpath=dirpath, save_top_k=0, save_last=False)
        prepare_elastic_restart()  # before the Trainer forms the process group
        self._dirpath_arg = os.fspath(dirpath)
        self.every_n_train_steps_ft = every_n_train_steps
        self.every_n_minutes = every_n_minutes if every_n_minutes or every_n_train_steps else 30.0
        self.keep_last = keep_last
        self.async_save = async_save
        self.signals = parsed_signals
        self.requeue = requeue
        self.nan_policy = nan_policy
        self.max_rollbacks = max_rollbacks
        self.hang_timeout = hang_timeout
        self.on_world_size_change = on_world_size_change

        self.resumed_from: Union[str, None] = None
        """The checkpoint this run resumed from (the pointer resolved), if any."""
        self._root = Path(dirpath)
        self._flag = SignalFlag(parsed_signals)
        self._nan = NanPolicy(nan_policy, max_rollbacks=max_rollbacks, report=event) if nan_policy else None
        self._data = DataResume()
        self._writer: CheckpointWriter | None = None
        self._watchdog: Watchdog | None = None
        self._ckpt_group: dist.ProcessGroup | None = None
        self._resume = ResumeState(self._root, report=event)
        self._last_saved_step = -1  # step of the newest save started
        self._last_save_time = time.monotonic()
        self._seen_step = -1
        self._preempting = False
        self._resume_rng: dict[str, Any] | None = None

    # ------------------------------------------------------------------------------------------- state

    @property
    def rollbacks(self) -> int:
        return self._nan.rollbacks if self._nan is not None else 0

    @property
    def nonfinite_steps(self) -> int:
        return self._nan.nonfinite_steps if self._nan is not None else 0

    @property
    @override
    def state_key(self) -> str:
        return f"{type(self).__qualname__}{{'dirpath': {self._dirpath_arg!r}}}"

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "dirpath": self._dirpath_arg,
            "last_model_path": self.last_model_path,
            "rollbacks": self.rollbacks,
            "nonfinite_steps": self.nonfinite_steps,
            "data_position": dict(self._data.samplers.position),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self._nan is not None:
            self._nan.rollbacks = int(state_dict.get("rollbacks", 0))
            self._nan.nonfinite_steps = int(state_dict.get("nonfinite_steps", 0))
        self._data.restore(state_dict.get("data_position"))

    # ------------------------------------------------------------------------------------ set-up/resume

    @override
    def resolve_last(self, trainer: pl.Trainer) -> set[str]:
        return self._resume.answer()  # before any process group: the pointer, remade if it was lost

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # resolved: a link in dirpath must not make the checkpoints Lightning loads look like someone else's
        wait_for_gloo_at_exit()  # under any strategy (Lightning's DDP too) a finished job exits 0
        root = Path(trainer.strategy.broadcast(str(self._root.resolve())))
        self._root = self._resume.root = root
        self.dirpath = str(root)
        if stage != "fit":
            return
        self._data.forget()  # set again below if this fit resumes (on_load_checkpoint)
        if self.nan_policy == "skip" and isinstance(trainer.strategy, StepsInsideTrainingStep):
            raise ValueError(
                f"FaultTolerantCheckpoint(nan_policy='skip') (its default) cannot skip a step under"
                f" {type(trainer.strategy).__name__}: its engine steps inside training_step, before any callback sees"
                " the loss. Pass nan_policy='rollback' (back to the last checkpoint on a non-finite loss), 'raise' or"
                " None."
            )
        self._flag.install()  # from here on a signal is honoured at the next batch boundary
        self._resume.prepare_folder(trainer)
        sharded = isinstance(trainer.strategy, (ModelParallelStrategy, ShardedCheckpointing))
        if self.async_save and sharded and distributed_ready():
            # DCP's collectives run in the writer thread: give them their own group, away from training's
            self._ckpt_group = dist.new_group(backend="gloo")
        strategy = trainer.strategy
        self._writer = CheckpointWriter(
            root,
            sharded=sharded,
            layout=strategy.checkpoint_layout if isinstance(strategy, ShardedCheckpointing) else None,
            group=self._ckpt_group,
            on_complete=self._on_complete,
            report=event,
        )
        self._resume.agree(
            trainer,
            kind="sharded" if sharded else "file",
            save_initial=lambda: self._save(trainer, 0, background=False),
        )

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if not trainer.ckpt_path:
            return
        state = self._resume.check_loaded(trainer, str(trainer.ckpt_path))
        if self._resume.resumed_from is not None:
            self.resumed_from = self._resume.resumed_from
        self._resume_rng = state["rng"] if state is not None else None
        ours = checkpoint.get("callbacks", {}).get(self.state_key)
        self._data.loaded(str(trainer.ckpt_path), state["data"] if state is not None else None, ours)

    # ---------------------------------------------------------------------------------- training start

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._resume.start_fresh()  # nothing valid to resume, under a strategy that loads after its set-up

    @override
    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flag.install()  # take SIGTERM back from the handler Lightning installed right before

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flag.install()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._flag.install()
        # after every other callback's on_train_start (Lightning runs checkpoint callbacks last): the schedule's K
        if (change := self._data.start(trainer, self.on_world_size_change)) is not None:
            event(f"FaultTolerantCheckpoint: {change}")
        if self._nan is not None and self._nan.policy == "skip":
            skip_schedulers_when(trainer, self._nan.skipped_last_step)
        self._seen_step = self._last_saved_step = trainer.global_step
        self._last_save_time = time.monotonic()
        if self.hang_timeout != 0:
            self._watchdog = Watchdog(
                timeout=self.hang_timeout, rank=trainer.global_rank, world_size=trainer.world_size
            )
            self._watchdog.start()

    # ---------------------------------------------------------------------------------------- per step

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._watchdog is not None:
            self._watchdog.enter(trainer.global_step)
        if self._resume_rng is not None:
            # restored here, not at load time: nothing between the save and this batch may draw from it
            restore_rng(self._resume_rng)
            self._resume_rng = None

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        self._data.before_step(trainer, optimizer)
        plugin = trainer.precision_plugin
        if self._nan is None:
            return
        if grad_scaler(plugin) is not None or isinstance(plugin, SkipsNonFiniteSteps):
            self._nan.now = False
            return  # the precision plugin already skips steps with overflowing gradients, agreed across ranks
        self._nan.check_gradients(trainer, optimizer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        assert self._writer is not None
        step = trainer.global_step
        stepped = step != self._seen_step  # this batch closed an accumulation window
        self._seen_step = step
        self._data.samplers.track(trainer, batch_idx)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        loss_bad = isinstance(loss, Tensor) and self._nan is not None and not bool(torch.isfinite(loss).all())
        time_due = self.every_n_minutes is not None and (
            time.monotonic() - self._last_save_time >= 60.0 * self.every_n_minutes
        )
        # one all-reduce per batch decides everything that must happen on all ranks together
        preempt, time_due_all, busy, loss_bad_all = agree(
            [float(self._flag.received is not None), float(time_due), float(self._writer.busy), float(loss_bad)],
            device=trainer.strategy.root_device,
        )
        if self._writer.pending is not None and not busy:
            with self._io():
                self._writer.complete(trainer)
        if preempt:
            self._announce_preemption()
        nonfinite = stepped and self._nan is not None and (self._nan.now or loss_bad_all)
        if nonfinite:
            assert self._nan is not None
            self._nan.after_step(step, rollback=lambda: self._rollback(trainer))
        elif stepped and self._preempting:
            self._preempt(trainer, step)
        elif stepped and step > self._last_saved_step:
            every = self.every_n_train_steps_ft
            if self._is_last_step(trainer):
                # saved here, not in on_train_end: by then Lightning marks the epoch finished, and a resume
                # with a larger max_steps would skip the rest of the epoch's data
                self._save(trainer, step, background=False)
            elif (every is not None and step % every == 0) or time_due_all:
                self._save(trainer, step, background=self.async_save)
        if self._watchdog is not None:
            self._watchdog.beat(step)

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        # validation inside fit is progress too (the watchdog only runs while fitting)
        if self._watchdog is not None:
            self._watchdog.beat(trainer.global_step)  # same step: refreshes the clock, adds no step time
        if not self.signals or self._writer is None or trainer.state.fn != TrainerFn.FITTING:
            return
        # a preemption must not wait for the rest of a long validation loop (Slurm's grace period is short)
        (preempt,) = agree([float(self._flag.received is not None)], device=trainer.strategy.root_device)
        if preempt:
            self._announce_preemption()
            self._preempt(trainer, trainer.global_step)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass  # saves happen at step boundaries only

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        pass

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step > self._last_saved_step:
            self._save(trainer, trainer.global_step, background=False)
        elif self._writer is not None and self._writer.pending is not None:
            with self._io():
                self._writer.finish(trainer)
        if self._ckpt_group is not None:
            dist.destroy_process_group(self._ckpt_group)  # no writer thread uses it any more
            self._ckpt_group = None
        self._shutdown()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # no collective here: other ranks may be gone. An unfinished background write stays incomplete.
        note_failed_fit(exception)  # the exit code, should a thread still in a collective keep the exit from finalising
        self._shutdown()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._shutdown()
        self._flag.uninstall()
