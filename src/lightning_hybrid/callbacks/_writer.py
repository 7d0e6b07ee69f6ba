"""Writing checkpoints: collect the state, stage it (for background writes), write, complete together.

A checkpoint counts once its manifest exists, and the manifest is written only after every rank reported
its files written: one ``all_gather_object`` of (files, error) per checkpoint. A failure on any rank
(a full disk, a lost mount) is reported on every rank and the folder is removed at once; it is never
marked complete and never left to fill the disk.
"""

from __future__ import annotations

import copy
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from torch import Tensor

from lightning_hybrid._agree import agree, distributed_ready
from lightning_hybrid._lightning_compat import dump_checkpoint
from lightning_hybrid.checkpoint._files import FileEntry, atomic_write
from lightning_hybrid.checkpoint._format import CHECKPOINT_FILE, MANIFEST, Kind, manifest_payload, rank_file
from lightning_hybrid.checkpoint._safe_load import unsafe_payload
from lightning_hybrid.checkpoint._sharded import split_checkpoint, write_sharded
from lightning_hybrid.checkpoint._store import StepFolder, new_step_folder, remove_step_folder

__all__ = ["CheckpointWriter", "load_target", "snapshot"]

log = logging.getLogger(__name__)


@dataclass
class _Write:
    """One rank's part of one checkpoint: written inline, or by a background thread."""

    step: int
    folder: StepFolder
    thread: threading.Thread | None = None
    made: bool = True  # rank 0 created the folder
    files: dict[str, FileEntry] = field(default_factory=dict)
    error: str | None = None
    fatal: bool = False  # the state itself must not be saved (not a disk problem): every rank raises

    @property
    def busy(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


def load_target(folder: Path) -> Path:
    """What a strategy loads: the single file of a whole checkpoint, the folder of a sharded one."""
    full = folder / CHECKPOINT_FILE
    return full if full.is_file() else folder


class CheckpointWriter:
    """Writes this rank's part of each checkpoint and completes it together with the other ranks.

    Every file except the manifest is written through ``write_file`` (:func:`atomic_write`), the one place a
    fault test replaces to make a write fail or stop half-way.

    Args:
        root: the checkpoint folder.
        sharded: whether the strategy writes sharded (DCP) checkpoints.
        layout: the strategy's layout record for sharded checkpoints (``None`` otherwise).
        group: the process group DCP uses from a background thread (its own, away from training's).
        on_complete: called on every rank with each completed step folder (pointer, retention).
        report: where failures are reported.
    """

    write_file: Callable[[Path, Callable[[Any], Any]], FileEntry] = staticmethod(atomic_write)

    def __init__(
        self,
        root: Path,
        *,
        sharded: bool,
        layout: Callable[[], Mapping[str, Any]] | None,
        group: dist.ProcessGroup | None,
        on_complete: Callable[[StepFolder], None],
        report: Callable[[str], Any],
    ) -> None:
        self.root, self.sharded, self.layout, self.group = root, sharded, layout, group
        self.on_complete, self.report = on_complete, report
        self.pending: _Write | None = None

    @property
    def busy(self) -> bool:
        return self.pending is not None and self.pending.busy

    def start(self, trainer: pl.Trainer, step: int, per_rank: dict[str, Any], *, background: bool) -> None:
        """Collect the state and write it, inline or (``background``) from a CPU snapshot in a thread.

        A failure on any rank before the write (no folder, a state that cannot be staged or would not load
        as plain data) is agreed by all ranks before any collective write starts: every rank then skips the
        write and :meth:`complete` reports it."""
        assert self.pending is None, "finish() the previous write first"
        made: tuple[str | None, str | None] = (None, None)
        if trainer.is_global_zero:
            try:
                made = (new_step_folder(self.root, step).name, None)
            except OSError as exc:
                made = (None, f"cannot create a folder under {self.root}: {exc}")
        name, error = trainer.strategy.broadcast(made)  # every rank writes into the folder rank 0 created
        folder = StepFolder(step, _version(name or ""), self.root / (name or f"step-{step:09d}"))
        write = _Write(step=step, folder=folder, made=name is not None)
        checkpoint: dict[str, Any] = {}
        tensors = None
        if error is None:
            try:
                checkpoint = dump_checkpoint(trainer)
                if self.sharded:
                    tensors, checkpoint = split_checkpoint(
                        checkpoint, self.layout() if self.layout is not None else None
                    )
                unsafe = unsafe_payload(checkpoint) if trainer.is_global_zero else None
                if unsafe:
                    write.fatal = True
                    error = f"the checkpoint would not load without running code: {unsafe}"
                elif background:
                    # the copy is the whole stall of an async save: training may change the originals after it
                    checkpoint, per_rank, tensors = snapshot((checkpoint, per_rank, tensors))
            except Exception as exc:
                error = f"cannot collect the state: {type(exc).__name__}: {exc}"
        (failed,) = agree([float(error is not None)], device=trainer.strategy.root_device)
        self.pending = write
        if failed:
            write.error = error or "skipped: another rank could not prepare its part"
            return
        rank, group = trainer.global_rank, self.group if background else None

        def run() -> None:
            files: dict[str, FileEntry] = {}
            errors: list[str] = []
            if tensors is not None:  # collective: every rank takes part first, whatever its own files do after
                try:
                    meta = checkpoint if rank == 0 else None
                    files.update(
                        write_sharded(folder.path, tensors, meta, process_group=group, write_file=self.write_file)
                    )
                except Exception as exc:  # DCP's failures arrive as RuntimeError (Ctrl-C as itself: it stops the run)
                    errors.append(f"{type(exc).__name__}: {exc}")
            try:
                files[rank_file(rank)] = self.write_file(folder.path / rank_file(rank), _saver(per_rank))
                if tensors is None and rank == 0:
                    files[CHECKPOINT_FILE] = self.write_file(folder.path / CHECKPOINT_FILE, _saver(checkpoint))
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
            write.files = files
            write.error = "; ".join(errors) or None

        if background:
            write.thread = threading.Thread(target=run, name=f"lightning-hybrid-save-{step}", daemon=True)
            write.thread.start()
        else:
            run()

    def finish(self, trainer: pl.Trainer) -> StepFolder | None:
        """Wait for this rank's pending write, then complete it with the other ranks (all ranks call this).

        Returns the completed folder, or ``None`` when there was nothing pending or the write failed."""
        if self.pending is None:
            return None
        if self.pending.thread is not None:
            self.pending.thread.join()
        return self.complete(trainer)

    def complete(self, trainer: pl.Trainer) -> StepFolder | None:
        """All ranks: gather every rank's result; rank 0 writes the manifest unless some rank failed.

        Every outcome is the same on every rank: complete (the folder is returned), failed (``None``; the
        folder is removed), or a state that must not be saved (``ValueError`` on every rank)."""
        write = self.pending
        assert write is not None and not write.busy
        self.pending = None
        mine = (write.files, write.error, write.fatal)
        parts: list[Any] = [mine]
        if distributed_ready():
            parts = [None] * dist.get_world_size()
            dist.all_gather_object(parts, mine)
        errors = {r: err for r, (_, err, _) in enumerate(parts) if err}
        if not errors and trainer.is_global_zero:
            try:
                self._write_manifest(trainer, write, [files for files, _, _ in parts])
            except Exception as exc:
                errors[0] = f"cannot write the manifest: {type(exc).__name__}: {exc}"
        errors = trainer.strategy.broadcast(errors)
        if errors:
            # every rank sees the same errors: nobody points at this checkpoint, and it does not stay on disk
            if trainer.is_global_zero:
                removed = write.made and remove_step_folder(write.folder)
                left = "removed" if removed else "not written" if not write.made else "left: it holds other files"
                self.report(
                    f"FaultTolerantCheckpoint: checkpoint {write.folder.path} failed and is not marked complete"
                    f" ({left}): {errors}"
                )
            trainer.strategy.barrier("FaultTolerantCheckpoint.failed")
            fatal = [err for _, err, is_fatal in parts if is_fatal]
            if fatal:
                raise ValueError(
                    f"FaultTolerantCheckpoint: refusing to write checkpoint step {write.step}: {fatal[0]}."
                )
            return None
        self.on_complete(write.folder)
        trainer.strategy.barrier("FaultTolerantCheckpoint.complete")
        return write.folder

    def _write_manifest(self, trainer: pl.Trainer, write: _Write, parts: list[dict[str, FileEntry]]) -> None:
        files: dict[str, FileEntry] = {}
        for rank_files in parts:
            files.update(rank_files)
        info = {
            "epoch": trainer.current_epoch,
            "strategy": type(trainer.strategy).__name__,
            "layout": dict(self.layout()) if self.layout is not None else None,
        }
        kind: Kind = "sharded" if self.sharded else "file"
        payload = manifest_payload(step=write.step, kind=kind, world_size=trainer.world_size, files=files, info=info)
        atomic_write(write.folder.path / MANIFEST, lambda f: f.write(payload))


def _version(name: str) -> int:
    head, _, tail = name.rpartition("-v")
    return int(tail) if head and tail.isdigit() else 0


def _saver(obj: Any) -> Callable[[Any], None]:
    return lambda f: torch.save(obj, f)


def snapshot(obj: Any) -> Any:
    """A copy of ``obj`` that training cannot change: tensors copied to CPU memory, every other object as
    ``copy.deepcopy`` copies it (defaultdicts, namedtuples, dataclasses keep their types; a ZeRO
    ``FlatShard`` copies its boxes to CPU memory)."""
    memo: dict[int, Any] = {}
    _stage_tensors(obj, memo, set())
    return copy.deepcopy(obj, memo)


def _stage_tensors(obj: Any, memo: dict[int, Any], seen: set[int]) -> None:
    # pre-fill deepcopy's memo with CPU copies, so deepcopy never copies a tensor on its device
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, Tensor):
        memo[id(obj)] = obj.detach().to("cpu", copy=True)
        return
    if isinstance(obj, Mapping):
        for value in obj.values():
            _stage_tensors(value, memo, seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            _stage_tensors(value, memo, seen)
