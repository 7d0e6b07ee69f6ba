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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist

from lightning_hybrid._agree import agree, distributed_ready
from lightning_hybrid.callbacks._writer import load_target
from lightning_hybrid.checkpoint._format import ManifestError, rank_file, read_manifest, verify
from lightning_hybrid.checkpoint._store import (
    StepFolder,
    foreign_step_entries,
    point_last,
    pointer_path,
    pointer_target,
    step_folders,
)

__all__ = ["Choice", "agreed_verdict", "answer_last", "choose"]

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
    (ok,) = agree([0.0 if problem else 1.0], op="min", device=trainer.strategy.root_device)
    if ok:
        return None
    if not distributed_ready():
        return problem
    problems: list[Any] = [None] * world
    dist.all_gather_object(problems, problem)
    return "; ".join(f"{p} (rank {r})" if world > 1 else str(p) for r, p in enumerate(problems) if p)


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
