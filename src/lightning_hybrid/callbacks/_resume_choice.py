"""Choosing what to resume: Lightning's ``ckpt_path="last"`` answered by the callback, then agreed by all ranks.

Lightning resolves ``"last"`` before any process group exists, by asking each ``ModelCheckpoint`` for
candidates. The callback answers with its pointer (``last.ckpt``), which it (re)creates on the spot when
it is missing or dangling (rsync and object stores drop links) and step folders exist; so a lost link
never turns into a silent fresh start. Once the process group exists, the ranks verify the step
folders newest first and stop at the first one that every rank can read and whose checksums match; the
pointer is moved there before Lightning loads it.

Verification spreads the hashing over the ranks (each file is read by one rank), so it costs about the
checkpoint's size divided by the world size per rank, and one all-reduce per candidate.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn

from lightning_hybrid._agree import agree, agreed_problem
from lightning_hybrid._protocols import ShardedCheckpointing
from lightning_hybrid.callbacks._resume import counterpart_rank
from lightning_hybrid.callbacks._writer import load_target
from lightning_hybrid.checkpoint._format import ManifestError, rank_file, read_manifest, verify
from lightning_hybrid.checkpoint._safe_load import load_payload
from lightning_hybrid.checkpoint._store import (
    StepFolder,
    clean_stale,
    foreign_step_entries,
    parse_step_name,
    point_last,
    pointer_path,
    pointer_target,
    remove_step_folder,
    retention,
    step_folders,
)

__all__ = ["Choice", "ResumeState", "agreed_verdict", "answer_last", "choose"]

log = logging.getLogger(__name__)


def _plausible(folder: StepFolder) -> bool:
    """Cheap (no file is read but the manifest): a well-formed manifest whose files have the listed sizes."""
    try:
        return verify(folder.path, read_manifest(folder.path, step=folder.step), hash_names=()) is None
    except Exception:
        return False


def answer_last(root: Path) -> set[str]:
    """The callback's answer to Lightning's "last" lookup (no process group yet: every rank runs this)."""
    pointer, _ = pointer_path(root)
    if pointer_target(pointer) is not None:
        return {str(pointer)}
    newest = next((f for f in step_folders(root) if _plausible(f)), None)
    if newest is None:
        return set()  # nothing to resume: Lightning starts fresh
    point_last(pointer, load_target(newest.path))  # every rank writes the same link, atomically
    return {str(pointer)}


@dataclass
class Choice:
    """The agreed outcome of the start-up verification (identical on every rank)."""

    chosen: StepFolder | None = None
    rejected: dict[Path, str] = field(default_factory=dict)  # folder -> why
    ignored: list[str] = field(default_factory=list)  # links and files named like step folders


def agreed_verdict(trainer: pl.Trainer, folder: StepFolder, *, kind: str | None = None) -> str | None:
    """Why ``folder`` cannot be resumed, or ``None``: the same answer on every rank.

    Every rank checks the manifest and all sizes, and hashes its share of the files (file ``i`` of the
    sorted list on rank ``i % world_size``) plus its own rank file; one all-reduce combines the verdicts.
    """
    rank, world = trainer.global_rank, trainer.world_size
    try:
        manifest = read_manifest(folder.path, step=folder.step)
        names = sorted(manifest.files)
        share = set(names[rank::world]) | ({rank_file(rank)} & set(names))
        problem = verify(folder.path, manifest, hash_names=share)
        if problem is None and kind is not None and manifest.kind != kind:
            problem = f"a {manifest.kind!r} checkpoint; this run's strategy reads {kind!r} ones"
    except ManifestError as exc:
        problem = f"unreadable manifest: {exc}"
    except Exception as exc:  # hostile files fail in many ways; each rank must still reach the all-reduce
        problem = f"cannot be verified ({type(exc).__name__}: {exc})"
    return agreed_problem(problem, device=trainer.strategy.root_device)


def choose(trainer: pl.Trainer, root: Path, *, kind: str) -> Choice:
    """Verify step folders newest first until one of ``kind`` passes on every rank (all ranks call this)."""
    listing = [(f.step, f.version, f.name) for f in step_folders(root)] if trainer.is_global_zero else None
    listing = trainer.strategy.broadcast(listing)  # one view of the folder for every rank
    choice = Choice(ignored=foreign_step_entries(root) if trainer.is_global_zero else [])
    for step, version, name in listing:
        folder = StepFolder(step, version, root / name)
        why = agreed_verdict(trainer, folder, kind=kind)
        if why is None:
            choice.chosen = folder
            break
        choice.rejected[folder.path] = why
    return choice


class ResumeState:
    """What this run resumed from and which checkpoints it may count and prune, the same on every rank.

    Args:
        root: the checkpoint folder.
        report: where events are reported (once per job).
    """

    def __init__(self, root: Path, report: Callable[[str], Any]) -> None:
        self.root, self.report = root, report
        self.answered = False  # Lightning will load our pointer (ckpt_path="last")
        self.verified: set[Path] = set()  # folders written by this run or verified at start
        self.rejected: dict[Path, str] = {}  # folder -> why it was refused
        self.written: set[Path] = set()  # folders this run completed
        self.lineage = False  # resumed from this folder: its history is this run's (retention may prune it)
        self.fresh_start: StepFolder | None = None  # the initial state saved when nothing was valid
        self._save_fresh: Callable[[], StepFolder | None] | None = None  # that save, until it can run
        self.complete_step = -1  # step of the newest complete checkpoint (resumed from or written)
        self.resumed_from: str | None = None

    def prepare_folder(self, trainer: pl.Trainer) -> None:
        """Create the folder and remove what interrupted saves left (rank 0); a failure stops every rank."""
        problem = None
        if trainer.is_global_zero:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                removed, kept = clean_stale(self.root)
                if removed:
                    rank_zero_info(f"FaultTolerantCheckpoint: removed {len(removed)} unfinished save(s) in {self.root}")
                for path in kept:
                    self.report(f"FaultTolerantCheckpoint: {path} has no manifest but holds other files; left alone")
            except OSError as exc:
                problem = f"cannot use {self.root} as the checkpoint folder: {exc}"
        problem = trainer.strategy.broadcast(problem)
        if problem:
            raise RuntimeError(f"FaultTolerantCheckpoint: {problem}")

    def start_fresh(self) -> None:
        """Save the initial state as step 0 where nothing verified (the save moves the pointer Lightning loads).
        A strategy that loads after its own set-up (sharded: HybridParallelStrategy, ModelParallelStrategy) can
        save its state only once set up: from ``on_fit_start``, right before Lightning loads."""
        save, self._save_fresh = self._save_fresh, None
        if save is None:
            return
        self.fresh_start = save()
        if self.fresh_start is None:
            raise RuntimeError(f"FaultTolerantCheckpoint: cannot write to {self.root} (see the error above).")

    def answer(self) -> set[str]:
        """Lightning's "last" lookup (before any process group: every rank runs this)."""
        try:
            answer = answer_last(self.root.resolve())
        except OSError as exc:  # e.g. the folder cannot be read: no answer now, the same error at set-up
            self.report(f"FaultTolerantCheckpoint: cannot look for checkpoints under {self.root}: {exc}")
            answer = set()
        self.answered = bool(answer)
        return answer

    def agree(self, trainer: pl.Trainer, *, kind: str, save_initial: Callable[[], StepFolder | None]) -> None:
        """When Lightning will load our pointer: choose, with every rank, what it loads (all ranks call this)."""
        mine = float(self.answered)
        most, least = agree([mine, -mine], op="max", device=trainer.strategy.root_device)
        if most != -least:
            raise RuntimeError(
                f"FaultTolerantCheckpoint: some ranks found checkpoints under {self.root} and some did not: the"
                " folder must be the same shared folder on every node."
            )
        if not self.answered:
            existing = step_folders(self.root)
            if existing and trainer.is_global_zero:
                self.report(
                    f"FaultTolerantCheckpoint: {self.root} holds {len(existing)} checkpoint(s) this run does not"
                    " resume from; they are left alone (neither loaded, counted nor deleted)."
                )
            return
        choice = choose(trainer, self.root, kind=kind)
        self.rejected.update(choice.rejected)
        if trainer.is_global_zero:
            for name in choice.ignored:
                self.report(f"FaultTolerantCheckpoint: {self.root / name} is a link or a file, not a step folder")
            for path, why in sorted(choice.rejected.items(), reverse=True):
                self.report(f"FaultTolerantCheckpoint: skipping checkpoint {path}: {why}")
        if choice.chosen is None:
            # Lightning already chose to load the pointer (it resolves "last" before any process group
            # exists), but nothing under it verifies: give it the initial state, so the run starts fresh
            self.report(
                f"FaultTolerantCheckpoint: no valid checkpoint under {self.root}; starting fresh from the initial"
                " weights (saved as step 0)."
            )
            self._save_fresh = save_initial
            if not trainer.strategy.restore_checkpoint_after_setup:
                self.start_fresh()  # Lightning loads before the strategy's set-up: the state can be saved now
            return
        problem = None
        if trainer.is_global_zero:
            try:
                self.point_last(choice.chosen)
            except OSError as exc:
                problem = f"cannot point {self.root}'s last.ckpt at {choice.chosen.path}: {exc}"
        problem = trainer.strategy.broadcast(problem)
        if problem:
            raise RuntimeError(f"FaultTolerantCheckpoint: {problem}")  # Lightning would load the wrong one

    def point_last(self, folder: StepFolder) -> None:
        pointer, taken = pointer_path(self.root)
        for path in taken:
            self.report(f"FaultTolerantCheckpoint: {path} was not made by this callback; left alone ({pointer.name})")
        point_last(pointer, load_target(folder.path))

    def check_loaded(self, trainer: pl.Trainer, ckpt_path: str) -> dict[str, Any] | None:
        """After Lightning loaded ``ckpt_path``: agree it is the same, valid checkpoint of ours on every rank.

        Returns this rank's state to restore (RNG streams, data position), ``None`` when there is none (not
        ours, or the initial state of a fresh start). Raises the same error on every rank otherwise."""
        path = Path(ckpt_path).resolve()
        folder_path = path if path.is_dir() else path.parent
        parsed = parse_step_name(folder_path.name) if folder_path.parent == self.root else None
        # every rank must have loaded the same folder (a stale view of the pointer on one node would not)
        step, version = parsed or (-1, -1)
        top = agree([step, version, -step, -version], op="max", device=trainer.strategy.root_device)
        if (top[0], top[1]) != (-top[2], -top[3]):
            raise RuntimeError(
                f"FaultTolerantCheckpoint: the ranks loaded different checkpoints; this rank loaded {path}. A node"
                f" sees a stale or different copy of {self.root}; relaunch once every node sees the same folder."
            )
        if parsed is None:
            rank_zero_warn(
                f"FaultTolerantCheckpoint: {ckpt_path} was not written by this callback: no checksums to check,"
                " and RNG streams and the data position are not restored (resume is not exact)."
            )
            return None
        folder = StepFolder(*parsed, folder_path)
        why = None if folder.path in self.verified else self.rejected.get(folder.path)
        if why is None and folder.path not in self.verified:
            why = agreed_verdict(trainer, folder)  # a specific checkpoint the user asked for
        if why is not None:
            raise RuntimeError(f"Refusing to resume from {folder.path}: {why}.")
        self.verified.add(folder.path)
        self.complete_step = max(self.complete_step, folder.step)
        self.lineage = True
        self.resumed_from = str(path)
        if self.fresh_start is not None and folder.path == self.fresh_start.path:
            return None  # the initial state this run just wrote: RNG and data start as in any fresh run
        rank_zero_info(f"FaultTolerantCheckpoint: resuming from {folder.path}")
        return _rank_state(trainer, folder)

    def completed(self, folder: StepFolder, *, keep_last: int) -> None:
        """A checkpoint of this run is complete: count it; on global rank 0 also move the pointer and prune."""
        self.verified.add(folder.path)
        self.written.add(folder.path)
        self.complete_step = max(self.complete_step, folder.step)
        if rank_zero_only.rank != 0:
            return
        try:  # the checkpoint is complete whatever happens here: a failure is reported, never raised
            self.point_last(folder)
            # a run that did not resume from this folder leaves the checkpoints it found alone
            folders = [f for f in step_folders(self.root) if self.lineage or f.path in self.written]
            for old in retention(folders, verified=self.verified, rejected=set(self.rejected), keep_last=keep_last):
                if remove_step_folder(old):
                    self.verified.discard(old.path)
                else:
                    self.report(f"FaultTolerantCheckpoint: {old.path} holds files this callback did not write; kept")
        except OSError as exc:
            self.report(f"FaultTolerantCheckpoint: after completing {folder.path}: {exc} (pointer or retention)")


def _rank_state(trainer: pl.Trainer, folder: StepFolder) -> dict[str, Any] | None:
    """This rank's RNG streams and data position, from the rank file of the rank that had its role in the
    checkpoint's world (verified, listed in the manifest); None where that world had no such role."""
    problem, state = None, None
    try:
        manifest = read_manifest(folder.path, step=folder.step)
        strategy = trainer.strategy
        layout = strategy.checkpoint_layout() if isinstance(strategy, ShardedCheckpointing) else None
        source = counterpart_rank(trainer.global_rank, layout, manifest.info.get("layout"))
        name = rank_file(source) if source is not None else None
        if name in manifest.files:
            raw = load_payload(folder.path / name)
            state = {"rng": raw["rng"], "data": {k: int(v) for k, v in raw["data"].items()}}
    except Exception as exc:  # agreed below, so that every rank stops together
        problem = f"{type(exc).__name__}: {exc}"
    failed, fresh = agree(
        [float(problem is not None), float(state is None)], op="sum", device=trainer.strategy.root_device
    )
    if failed:
        raise RuntimeError(
            f"FaultTolerantCheckpoint: cannot restore the ranks' RNG streams and data position from {folder.path}"
            f" ({problem or 'on another rank'})."
        )
    if fresh:
        rank_zero_warn(
            f"FaultTolerantCheckpoint: {folder.path} was written by a world without the role of {int(fresh)} rank(s)"
            " of this one (more data-parallel replicas now); those start fresh RNG streams (the data position is"
            " global and restored on every rank)."
        )
    return state
