"""FaultTolerantCheckpoint: checkpoints that survive kills, preemption, corruption and divergence."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from torch import Tensor
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.optim import Optimizer
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, SequentialSampler
from typing_extensions import override

from lightning_hybrid._agree import agree, all_finite, distributed_ready
from lightning_hybrid._elastic import prepare_elastic_restart
from lightning_hybrid._lightning_compat import (
    _METADATA_FILENAME,
    dump_checkpoint,
    restart_train_iterator,
    train_dataloaders,
)
from lightning_hybrid._skip import skip_schedulers_when
from lightning_hybrid.callbacks import _store as store
from lightning_hybrid.callbacks._resume import ResumableSampler, capture_rng, restore_rng
from lightning_hybrid.callbacks._watchdog import HANG_EXIT_CODE, Watchdog
from lightning_hybrid.strategies._zero import sharded_to_cpu

__all__ = ["HANG_EXIT_CODE", "PREEMPTION_EXIT_CODE", "FaultTolerantCheckpoint"]

log = logging.getLogger(__name__)
_event = rank_zero_only(log.warning)  # failures handled: shown whatever the warning filters, once per job

PREEMPTION_EXIT_CODE = 75
"""Exit status after a preemption save (``EX_TEMPFAIL``): the job is safe to relaunch and will resume."""

NanPolicy = Literal["skip", "rollback", "raise"]
_CHECKPOINT_FILE = "checkpoint.pt"


@dataclass
class _Write:
    """One rank's part of one checkpoint: written inline, or by a background thread (``async_save``)."""

    step: int
    path: Path
    thread: threading.Thread | None = None
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    error: str | None = None

    @property
    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


class FaultTolerantCheckpoint(ModelCheckpoint):
    """Failure-aware checkpointing: atomic, checksummed, agreed across ranks, exact to resume.

    Each checkpoint is a directory ``dirpath/step-<N>`` whose files are written under temporary names,
    fsynced and renamed; a ``manifest.json`` with every file's SHA-256 is written last and makes it count.
    ``dirpath/last.ckpt`` points at the newest complete one, so ``trainer.fit(model, ckpt_path="last")``
    resumes from it; at start the ranks agree on the newest checkpoint that validates and skip (with a
    warning naming it) any that is truncated, corrupted or incomplete. Resuming restores the model,
    optimizers, LR schedulers, precision plugin, callbacks, each rank's RNG streams and the position in the
    epoch's data, so a run killed at any step ends with the weights of an uninterrupted one.

    Preemption signals only set a flag; at the next optimizer-step boundary the ranks agree (one small
    all-reduce), save together, requeue the job under Slurm and exit with ``PREEMPTION_EXIT_CODE``. A
    watchdog exits a hung rank with ``HANG_EXIT_CODE`` instead of waiting out the collective timeout. A
    non-finite gradient (agreed across ranks) skips the step, rolls back to the last checkpoint, or raises.

    Works with single device, DDP, ``ModelParallelStrategy`` and ``HybridParallelStrategy`` (sharded DCP
    checkpoints that resume on another world size or pipeline/data-parallel layout).

    Args:
        dirpath: directory of the step checkpoints (shared by all nodes).
        every_n_train_steps: save after every N optimizer steps.
        every_n_minutes: save when this many minutes passed since the last save (rank 0's clock decides).
            If neither is given, every 30 minutes.
        keep_last: complete checkpoints to keep (>= 2, so a corrupted newest one has a fallback).
        async_save: stage the state in CPU memory and write it in the background while training goes on.
        signals: names of the preemption signals to handle (e.g. the one ``sbatch --signal`` sends).
        requeue: after a preemption save, ``scontrol requeue`` the job; ``None``: when running under Slurm.
        nan_policy: on a non-finite gradient (or loss): ``"skip"`` the update (step-interval LR schedulers
            do not advance either; ``global_step`` does), ``"rollback"`` to the last checkpoint and skip
            the data window since (step counter and LR schedule go on), or ``"raise"``; ``None`` disables
            the check.
        max_rollbacks: give up (raise) after this many rollbacks.
        hang_timeout: seconds without a finished step before the watchdog exits the process; ``None`` derives
            it from the step times seen (at least 5 minutes); ``0`` disables the watchdog.

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
        nan_policy: Union[NanPolicy, None] = "skip",
        max_rollbacks: int = 3,
        hang_timeout: Union[float, None] = None,
    ) -> None:
        if every_n_train_steps is not None and every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be >= 1, got {every_n_train_steps}.")
        if every_n_minutes is not None and every_n_minutes <= 0:
            raise ValueError(f"every_n_minutes must be > 0, got {every_n_minutes}.")
        if keep_last < 2:
            raise ValueError(
                f"keep_last must be >= 2, got {keep_last}: the previous checkpoint is the fallback when the newest"
                " one turns out to be corrupted."
            )
        if nan_policy not in ("skip", "rollback", "raise", None):
            raise ValueError(f"nan_policy must be 'skip', 'rollback', 'raise' or None, got {nan_policy!r}.")
        if max_rollbacks < 0:
            raise ValueError(f"max_rollbacks must be >= 0, got {max_rollbacks}.")
        unknown = [s for s in signals if not isinstance(getattr(signal, str(s), None), signal.Signals)]
        if unknown:
            raise ValueError(f"Unknown signal name(s) {unknown}; use names such as 'SIGTERM', 'SIGUSR1'.")
        super().__init__(dirpath=dirpath, save_top_k=0, save_last=False)
        prepare_elastic_restart()  # before the Trainer forms the process group
        if every_n_train_steps is None and every_n_minutes is None:
            every_n_minutes = 30.0
        self.every_n_train_steps_ft = every_n_train_steps
        self.every_n_minutes = every_n_minutes
        self.keep_last = keep_last
        self.async_save = async_save
        self.signals = tuple(getattr(signal, str(s)) for s in signals)
        self.requeue = requeue
        self.nan_policy = nan_policy
        self.max_rollbacks = max_rollbacks
        self.hang_timeout = hang_timeout

        self.resumed_from: Union[str, None] = None
        """The checkpoint this run resumed from (``last.ckpt`` resolved), if any."""
        # counters, saved in the checkpoint
        self.rollbacks = 0
        self.nonfinite_steps = 0

        self._root = Path(dirpath)
        self._write: _Write | None = None  # the newest save not yet marked complete
        self._last_saved_step = -1
        self._last_save_time = time.monotonic()
        self._seen_step = -1
        self._nonfinite_now = False
        self._preempting = False
        self._signal_received: int | None = None
        self._main_pid = os.getpid()
        self._previous_handlers: dict[int, Any] = {}
        self._watchdog: Watchdog | None = None
        self._ckpt_group: dist.ProcessGroup | None = None
        self._rejected: dict[str, str] = {}  # checkpoint dir -> why it was refused
        self._validated: set[str] = set()  # checkpoint dirs whose checksums matched at start
        self._samplers: list[tuple[ResumableSampler, int]] = []
        self._data_position: dict[str, int] = {"epoch": 0, "consumed": 0}
        self._resume_data: dict[str, int] | None = None
        self._resume_rng: dict[str, Any] | None = None

    # ------------------------------------------------------------------------------------------- state

    @property
    @override
    def state_key(self) -> str:
        return self._generate_state_key(dirpath=str(self._root))

    @override
    def state_dict(self) -> dict[str, Any]:
        return {
            "dirpath": str(self._root),
            "last_model_path": self.last_model_path,
            "rollbacks": self.rollbacks,
            "nonfinite_steps": self.nonfinite_steps,
            "data_position": dict(self._data_position),
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rollbacks = int(state_dict.get("rollbacks", 0))
        self.nonfinite_steps = int(state_dict.get("nonfinite_steps", 0))
        self.last_model_path = state_dict.get("last_model_path", "")
        if self._resume_data is None and "data_position" in state_dict:
            # rank 0's position: the global data position is the same on every rank
            self._resume_data = dict(state_dict["data_position"])

    # ------------------------------------------------------------------------------------ set-up/resume

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        root = Path(trainer.strategy.broadcast(str(self._root.resolve())))
        self._root = root
        self.dirpath = str(root)
        if stage != "fit":
            return
        if trainer.is_global_zero:
            root.mkdir(parents=True, exist_ok=True)
            removed = store.clean_stale(root)
            if removed:
                rank_zero_info(f"FaultTolerantCheckpoint: removed {len(removed)} unfinished file(s) under {root}")
        trainer.strategy.barrier("FaultTolerantCheckpoint.setup")
        self._agree_on_last(trainer)
        if self.async_save and distributed_ready() and self._uses_dcp(trainer):
            # DCP's collectives run in the writer thread: give them their own group, away from training's
            self._ckpt_group = dist.new_group(backend="gloo")

    def _agree_on_last(self, trainer: pl.Trainer) -> None:
        """Point ``last.ckpt`` at the newest checkpoint every rank can read and whose checksums match."""
        strategy = trainer.strategy
        report: dict[str, Any] = {"candidates": [], "rejected": {}}
        if trainer.is_global_zero:
            for entry in store.checkpoints(self._root):
                problem = store.verify(entry.path)  # reads every file once: rank 0 alone pays this
                if problem is None:
                    report["candidates"].append(str(entry.path))
                else:
                    report["rejected"][str(entry.path)] = problem
        report = strategy.broadcast(report)
        candidates: list[str] = report["candidates"]
        self._rejected.update(report["rejected"])
        self._validated.update(candidates)
        # every rank confirms it sees each candidate whole (sizes, and its own files' checksums)
        mine = [f"rank-{trainer.global_rank:05d}.pt"]
        local_ok = [
            float(store.verify(p, checksums=False) is None and store.verify(p, names=mine) is None) for p in candidates
        ]
        agreed_ok = agree(local_ok, op="min", device=strategy.root_device) if candidates else []
        chosen = next((p for p, ok in zip(candidates, agreed_ok) if ok), None)
        for p, ok in zip(candidates, agreed_ok):
            if p == chosen:
                break
            if not ok:
                self._rejected[p] = "some rank cannot read its part (missing or truncated files on that node)"
        if trainer.is_global_zero:
            for path, why in sorted(self._rejected.items(), reverse=True):
                _event(f"FaultTolerantCheckpoint: skipping checkpoint {path}: {why}")
            if chosen is not None:
                store.point_last(self._root, self._load_target(Path(chosen)))
        if chosen is not None:
            self.last_model_path = str(self._load_target(Path(chosen)))
        elif self._rejected:
            # Lightning already chose to load `last.ckpt` (it resolves "last" before any process group
            # exists): give it the initial state, written as step 0, so the run starts fresh
            _event(
                f"FaultTolerantCheckpoint: no valid checkpoint under {self._root}; starting fresh from the"
                " initial weights (saved as step 0)."
            )
            self._save(trainer, 0, background=False)
        strategy.barrier("FaultTolerantCheckpoint.agree_on_last")

    @staticmethod
    def _load_target(step_path: Path) -> Path:
        """What a strategy loads: the single file of a full checkpoint, the directory of a sharded one."""
        full = step_path / _CHECKPOINT_FILE
        return full if full.is_file() else step_path

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        if not trainer.ckpt_path:
            return
        path = Path(trainer.ckpt_path).resolve()
        step_path = path if path.is_dir() else path.parent
        if step_path.parent != self._root:
            rank_zero_warn(
                f"FaultTolerantCheckpoint: {trainer.ckpt_path} was not written by this callback: no checksums to"
                " check, and RNG streams and the data position are not restored (resume is not exact)."
            )
            return
        why = self._rejected.get(str(step_path))
        if why is None and str(step_path) not in self._validated:
            why = store.verify(step_path)  # a specific older checkpoint the user asked for
        if why is not None:
            raise RuntimeError(f"Refusing to resume from {step_path}: {why}.")
        rank_file = step_path / f"rank-{trainer.global_rank:05d}.pt"
        if rank_file.is_file():
            state = torch.load(rank_file, map_location="cpu", weights_only=True)
            self._resume_rng = state["rng"]
            self._resume_data = state["data"]
        else:
            rank_zero_warn(
                f"FaultTolerantCheckpoint: {step_path} was written by {len(list(step_path.glob('rank-*.pt')))} ranks;"
                " ranks beyond those start fresh RNG streams (the data position is restored on every rank)."
            )
        self.resumed_from = str(path)
        rank_zero_info(f"FaultTolerantCheckpoint: resuming from {step_path}")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._main_pid = os.getpid()
        for signum in self.signals:
            self._previous_handlers[signum] = signal.signal(signum, self._on_signal)
        self._own_samplers(trainer)
        if self.nan_policy == "skip":
            skip_schedulers_when(trainer, self._skipped_last_step)
        self._seen_step = self._last_saved_step = trainer.global_step
        self._last_save_time = time.monotonic()
        if self.hang_timeout != 0:
            self._watchdog = Watchdog(
                timeout=self.hang_timeout, rank=trainer.global_rank, world_size=trainer.world_size
            )
            self._watchdog.start()

    def _skipped_last_step(self) -> bool:
        return self._nonfinite_now  # the update was dropped: the LR schedule does not advance either

    def _own_samplers(self, trainer: pl.Trainer) -> None:
        """Swap each training loader's sampler for a ResumableSampler that yields the same order."""
        self._samplers = []
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        for loader in train_dataloaders(trainer):
            batch_sampler = getattr(loader, "batch_sampler", None)
            source = getattr(batch_sampler, "sampler", None)
            if not (isinstance(loader, DataLoader) and type(batch_sampler) is BatchSampler):
                rank_zero_warn(
                    "FaultTolerantCheckpoint: a training loader with a custom batch sampler (or no DataLoader) keeps"
                    " its own order; mid-epoch resume restarts its epoch unless it implements state_dict()."
                )
                continue
            assert batch_sampler is not None
            if isinstance(source, ResumableSampler):
                sampler = source
            elif isinstance(source, DistributedSampler):
                sampler = ResumableSampler(
                    len(source.dataset),  # type: ignore[arg-type]
                    num_replicas=source.num_replicas,
                    rank=source.rank,
                    shuffle=source.shuffle,
                    seed=source.seed,
                    drop_last=source.drop_last,
                )
            elif isinstance(source, (RandomSampler, SequentialSampler)):
                n = len(source.data_source)  # type: ignore[arg-type]
                sampler = ResumableSampler(n, shuffle=isinstance(source, RandomSampler), seed=seed)
            else:
                rank_zero_warn(f"FaultTolerantCheckpoint: unknown sampler {type(source).__name__}; not resumable.")
                continue
            batch_sampler.sampler = sampler
            # iterator creation would draw worker seeds from the global RNG: give the loader its own stream
            loader.generator = torch.Generator().manual_seed(seed)
            sampler.set_epoch(trainer.current_epoch)
            if self._resume_data is not None:
                sampler.resume_at(self._resume_data["epoch"], self._resume_data["consumed"])
            self._samplers.append((sampler, batch_sampler.batch_size))
        self._resume_data = None
        if self._samplers and len(self._samplers) == len(train_dataloaders(trainer)):
            # Lightning warns that a mid-epoch resume without a stateful loader is unreliable: not with ours
            warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch")
        if self._samplers:
            # the fit loop already prefetched a batch with the old sampler: start over with ours
            restart_train_iterator(trainer)

    def _on_signal(self, signum: int, frame: Any) -> None:
        # async-signal context: only set a flag. DataLoader workers inherit this handler: they ignore it.
        if os.getpid() == self._main_pid:
            self._signal_received = signum

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
        self._nonfinite_now = False
        plugin = trainer.precision_plugin
        if self.nan_policy is None or getattr(plugin, "scaler", None) is not None:
            return  # a loss scaler already skips steps with overflowing gradients
        if getattr(plugin, "skips_nonfinite_steps", False):
            return  # AdaptiveLossScalingPrecision skips them, agreed across ranks, before this hook runs
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        bad = agree([0.0 if all_finite(p.grad for p in params) else 1.0], device=trainer.strategy.root_device)[0]
        if not bad:
            return
        self._nonfinite_now = True
        if self.nan_policy in ("skip", "rollback"):
            for p in params:
                p.grad = None  # torch optimizers leave parameters without a gradient (and their state) alone

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        stepped = step != self._seen_step  # this batch closed an accumulation window
        self._seen_step = step
        self._track_data_position(trainer, batch_idx)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        loss_bad = isinstance(loss, Tensor) and self.nan_policy is not None and not bool(torch.isfinite(loss).all())
        time_due = self.every_n_minutes is not None and (
            time.monotonic() - self._last_save_time >= 60.0 * self.every_n_minutes
        )
        # one all-reduce per batch decides everything that must happen on all ranks together
        preempt, time_due_all, busy, loss_bad_all = agree(
            [
                float(self._signal_received is not None),
                float(time_due),
                float(self._write is not None and self._write.busy),
                float(loss_bad),
            ],
            device=trainer.strategy.root_device,
        )
        if self._write is not None and not busy:
            self._complete(trainer)
        if preempt and not self._preempting:
            self._preempting = True
            rank_zero_info("FaultTolerantCheckpoint: preemption signal received; saving at the next step boundary")
        if stepped and (self._nonfinite_now or loss_bad_all):
            self._on_nonfinite(trainer, step)
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

    @staticmethod
    def _is_last_step(trainer: pl.Trainer) -> bool:
        if 0 <= trainer.max_steps <= trainer.global_step:
            return True
        last_epoch = trainer.max_epochs is not None and trainer.current_epoch + 1 >= trainer.max_epochs
        return last_epoch and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch

    def _track_data_position(self, trainer: pl.Trainer, batch_idx: int) -> None:
        if not self._samplers:
            return
        sampler, batch_size = self._samplers[0]
        self._data_position = {
            "epoch": trainer.current_epoch,
            "consumed": (batch_idx + 1) * batch_size * sampler.num_replicas,
        }

    @override
    def on_validation_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        # validation inside fit is progress too (the watchdog only runs while fitting)
        if self._watchdog is not None:
            self._watchdog.beat(trainer.global_step)  # same step: refreshes the clock, adds no step time

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
        elif self._write is not None:
            self._finish_write(trainer)
        if self._ckpt_group is not None:
            dist.destroy_process_group(self._ckpt_group)  # no writer thread uses it any more
            self._ckpt_group = None
        self._shutdown()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # no collective here: other ranks may be gone. An unfinished background write stays incomplete.
        self._shutdown()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._shutdown()

    def _shutdown(self) -> None:
        if self._watchdog is not None:
            self._watchdog.stop()
            self._watchdog = None
        for signum, handler in self._previous_handlers.items():
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signum, handler)
        self._previous_handlers = {}

    # ---------------------------------------------------------------------------- failures and policy

    def _on_nonfinite(self, trainer: pl.Trainer, step: int) -> None:
        self.nonfinite_steps += 1
        what = f"non-finite loss or gradients at step {step} (seen by at least one rank; all ranks agree)"
        if self.nan_policy == "raise":
            raise FloatingPointError(f"FaultTolerantCheckpoint: {what}; nan_policy='raise'.")
        if self.nan_policy == "skip":
            _event(f"FaultTolerantCheckpoint: {what}; the update was skipped.")
            return
        if self.rollbacks >= self.max_rollbacks:
            raise FloatingPointError(
                f"FaultTolerantCheckpoint: {what}, after {self.rollbacks} rollbacks (max_rollbacks="
                f"{self.max_rollbacks}); giving up. Lower the learning rate or inspect the data near this step."
            )
        self._finish_write(trainer)
        if not self.last_model_path:
            raise FloatingPointError(f"FaultTolerantCheckpoint: {what}, and no checkpoint to roll back to yet.")
        self.rollbacks += 1
        target = Path(self.last_model_path)
        if self._watchdog is not None:
            self._watchdog.pause()
        try:
            self._load_weights(trainer, target)
        finally:
            if self._watchdog is not None:
                self._watchdog.resume()
        source = target.parent if target.is_file() else target
        _event(
            f"FaultTolerantCheckpoint: {what}; rolled back model and optimizer to {source}"
            f" (rollback {self.rollbacks}/{self.max_rollbacks}); the data since that checkpoint is skipped."
        )

    def _load_weights(self, trainer: pl.Trainer, target: Path) -> None:
        """Model and optimizer state from a checkpoint of this run (step counter, LR schedule, data go on)."""
        strategy = trainer.strategy
        # the optimizer's state comes back, its hyperparameters (the scheduled LR) stay those of now
        hyper = [[{k: v for k, v in g.items() if k != "params"} for g in o.param_groups] for o in trainer.optimizers]
        if isinstance(strategy, ModelParallelStrategy):
            strategy.load_checkpoint(target)  # loads in place, resharding as needed
        else:
            checkpoint = torch.load(target, map_location="cpu", weights_only=True)
            strategy.load_model_state_dict(checkpoint)
            strategy.load_optimizer_state_dict(checkpoint)
        for opt, groups in zip(trainer.optimizers, hyper):
            for group, saved in zip(opt.param_groups, groups):
                group.update(saved)

    def _preempt(self, trainer: pl.Trainer, step: int) -> None:
        if step > self._last_saved_step:
            self._save(trainer, step, background=False)
        else:
            self._finish_write(trainer)
        trainer.strategy.barrier("FaultTolerantCheckpoint.preempt")
        requeue = self.requeue if self.requeue is not None else _under_slurm()
        if requeue and trainer.is_global_zero:
            _slurm_requeue()
        rank_zero_info(
            f"FaultTolerantCheckpoint: saved step {step} after a preemption signal; exiting with code"
            f" {PREEMPTION_EXIT_CODE}{' (job requeued)' if requeue else ''}."
        )
        self._shutdown()
        raise SystemExit(PREEMPTION_EXIT_CODE)

    # ------------------------------------------------------------------------------------------ saving

    def _uses_dcp(self, trainer: pl.Trainer) -> bool:
        return isinstance(trainer.strategy, ModelParallelStrategy)

    def _save(self, trainer: pl.Trainer, step: int, *, background: bool) -> None:
        """Write this rank's part of checkpoint ``step``; complete it now, or later when written in background."""
        self._finish_write(trainer)
        if self._watchdog is not None:
            self._watchdog.pause()
        try:
            path = store.step_dir(self._root, step)
            path.mkdir(parents=True, exist_ok=True)
            # rewriting a step (after a rollback or resume): it must not look complete while it changes
            (path / store.MANIFEST).unlink(missing_ok=True)
            write = self._stage(trainer, step, path, copy=background)
            self._write = write
            self._last_saved_step = step
            self._last_save_time = time.monotonic()
            if not background:
                self._finish_write(trainer)
        finally:
            if self._watchdog is not None:
                self._watchdog.resume()

    def _stage(self, trainer: pl.Trainer, step: int, path: Path, *, copy: bool) -> _Write:
        """Collect the state (copied to CPU memory when written in background) and start writing it."""
        rank = trainer.global_rank
        checkpoint = dump_checkpoint(trainer)
        per_rank = {"rng": capture_rng(), "data": dict(self._data_position), "rank": rank}
        dcp_state = None
        if self._uses_dcp(trainer):
            dcp_state = {"state_dict": checkpoint.pop("state_dict")}
            for idx, optim_state in enumerate(checkpoint.pop("optimizer_states", [])):
                dcp_state[f"optimizer_{idx}"] = optim_state
            layout = getattr(trainer.strategy, "checkpoint_layout", None)
            if callable(layout):
                checkpoint["hybrid_layout"] = layout()
        if copy:
            # the copy is the whole stall of an async save: training may change the originals right after
            checkpoint, per_rank, dcp_state = _cpu_copy((checkpoint, per_rank, dcp_state))
        write = _Write(step=step, path=path)
        group = self._ckpt_group

        def run() -> None:
            try:
                files = {}
                name = f"rank-{rank:05d}.pt"
                files[name] = store.atomic_write(path / name, lambda f: torch.save(per_rank, f))
                if dcp_state is not None:
                    writer = dcp.FileSystemWriter(path, single_file_per_rank=True, sync_files=True, thread_count=1)
                    writer.fs = fs = store.AtomicFileSystem()
                    dcp.save(dcp_state, storage_writer=writer, process_group=group if copy else None)
                    # this rank's data file(s) and, on the coordinator, the final .metadata (renamed from .tmp)
                    files.update({n: e for n, e in fs.written.items() if not n.endswith(".tmp")})
                    if ".metadata.tmp" in fs.written:
                        files[".metadata"] = fs.written[".metadata.tmp"]
                    if rank == 0:
                        meta = store.atomic_write(path / _METADATA_FILENAME, lambda f: torch.save(checkpoint, f))
                        files[_METADATA_FILENAME] = meta
                elif rank == 0:
                    files[_CHECKPOINT_FILE] = store.atomic_write(
                        path / _CHECKPOINT_FILE, lambda f: torch.save(checkpoint, f)
                    )
                write.files = files
            except BaseException as exc:  # DCP can raise BaseException subclasses; never lose the reason
                write.error = f"{type(exc).__name__}: {exc}"

        if copy:
            write.thread = threading.Thread(target=run, name=f"lightning-hybrid-save-{step}", daemon=True)
            write.thread.start()
        else:
            run()
        return write

    def _finish_write(self, trainer: pl.Trainer) -> None:
        """Wait for this rank's pending write (if any), then complete it together with the other ranks."""
        if self._write is None:
            return
        if self._write.thread is not None:
            self._write.thread.join()
        self._complete(trainer)

    def _complete(self, trainer: pl.Trainer) -> None:
        """All ranks: gather every rank's file list; rank 0 writes the manifest if no rank failed."""
        write = self._write
        assert write is not None and not write.busy
        self._write = None
        parts: list[Any] = [(write.files, write.error)]
        if distributed_ready():
            gathered: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, parts[0])
            parts = gathered
        errors = {r: err for r, (_, err) in enumerate(parts) if err}
        if errors:
            # every rank sees the same errors: all skip this checkpoint, nobody points at it
            _event(f"FaultTolerantCheckpoint: checkpoint {write.path} failed and is not marked complete: {errors}")
            return
        if trainer.is_global_zero:
            files: dict[str, dict[str, Any]] = {}
            for rank_files, _ in parts:
                files.update(rank_files)
            info = {
                "step": write.step,
                "epoch": trainer.current_epoch,
                "world_size": trainer.world_size,
                "strategy": type(trainer.strategy).__name__,
                "layout": getattr(trainer.strategy, "checkpoint_layout", lambda: None)(),
            }
            store.write_manifest(write.path, files, info)
            target = self._load_target(write.path)
            store.point_last(self._root, target)
            store.retain(self._root, self.keep_last, protect=[write.path])
        self.last_model_path = str(self._load_target(write.path))
        trainer.strategy.barrier("FaultTolerantCheckpoint.complete")


def _cpu_copy(obj: Any) -> Any:
    if isinstance(obj, ShardedTensor):  # ZeRO-1/2 parameters and optimizer state: views of this rank's slice
        return sharded_to_cpu(obj)
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, _cpu_copy(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu_copy(v) for v in obj)
    return obj


def _under_slurm() -> bool:
    return "SLURM_JOB_ID" in os.environ and os.environ.get("SLURM_JOB_NAME") not in ("bash", "interactive")


def _slurm_requeue() -> None:
    array_job, array_task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    job = f"{array_job}_{array_task}" if array_job and array_task else os.environ["SLURM_JOB_ID"]
    result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, check=False)
    if result.returncode:
        log.error(f"FaultTolerantCheckpoint: `scontrol requeue {job}` failed: {result.stderr.strip()}")
    else:
        log.info(f"FaultTolerantCheckpoint: requeued Slurm job {job}")
