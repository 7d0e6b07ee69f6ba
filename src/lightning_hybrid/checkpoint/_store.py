"""The checkpoint folder: step folders, the ``last.ckpt`` pointer, clean-up and retention.

The pack deletes only what it created, and never through a link: step folders are real directories named
``step-<N>[-v<k>]``; inside them only checkpoint file names (and their temporary names) are removed, and
a folder holding anything else is left alone. A step is never rewritten in place: a second save of step
``N`` goes to ``step-<N>-v1``, so a rejected or older-timeline checkpoint is never overwritten.
Retention keeps ``keep_last`` checkpoints that were *verified* (written by this run or checked at
start), and deletes nothing a resume could still need. Plain code: no Trainer, no process group.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import stat
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from lightning_hybrid.checkpoint._files import final_name, fsync_dir, is_temp_name, temp_name
from lightning_hybrid.checkpoint._format import CHECKPOINT_FILE, MANIFEST, is_checkpoint_file_name

__all__ = [
    "LAST_LINK",
    "StepFolder",
    "clean_stale",
    "new_step_folder",
    "parse_step_name",
    "point_last",
    "pointer_path",
    "remove_step_folder",
    "retention",
    "step_folders",
]

LAST_LINK = "last.ckpt"
_STEP = re.compile(r"^step-(\d{9,})(?:-v(\d+))?$")
_POINTER = re.compile(r"^last(?:-v(\d+))?\.ckpt$")
_OUR_TARGET = re.compile(r"^step-\d{9,}(?:-v\d+)?(?:/" + re.escape(CHECKPOINT_FILE) + r")?$")


@dataclass(frozen=True, order=True)
class StepFolder:
    """One step folder; ordered by (step, version): a rewrite of a step is newer than the original."""

    step: int
    version: int
    path: Path = field(compare=False)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def complete(self) -> bool:
        try:
            return stat.S_ISREG(os.lstat(self.path / MANIFEST).st_mode)
        except OSError:
            return False


def step_name(step: int, version: int = 0) -> str:
    return f"step-{step:09d}" + (f"-v{version}" if version else "")


def parse_step_name(name: str) -> tuple[int, int] | None:
    """``(step, version)`` of a step folder's name, or ``None`` for any other name."""
    match = _STEP.match(name)
    return (int(match.group(1)), int(match.group(2) or 0)) if match else None


def step_folders(root: str | os.PathLike) -> list[StepFolder]:
    """The step folders under ``root``, newest first; links named like step folders are not ours."""
    root = Path(root)
    found = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(root):
            match = _STEP.match(entry.name)
            if match and entry.is_dir(follow_symlinks=False):
                found.append(StepFolder(int(match.group(1)), int(match.group(2) or 0), root / entry.name))
    return sorted(found, reverse=True)


def foreign_step_entries(root: str | os.PathLike) -> list[str]:
    """Names under ``root`` that look like step folders but are links or files (never used, never deleted)."""
    root = Path(root)
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        return sorted(e.name for e in os.scandir(root) if _STEP.match(e.name) and not e.is_dir(follow_symlinks=False))
    return []


def new_step_folder(root: str | os.PathLike, step: int) -> StepFolder:
    """Create the folder for a new checkpoint of ``step``: a name never used before in ``root``."""
    root = Path(root)
    for version in itertools.count():
        path = root / step_name(step, version)
        try:
            path.mkdir()
        except FileExistsError:
            continue
        fsync_dir(root)
        return StepFolder(step, version, path)
    raise AssertionError("unreachable")


def remove_step_folder(folder: StepFolder) -> bool:
    """Delete a step folder of ours: the manifest first (a half-deleted folder never looks complete), then its
    checkpoint files. Anything else inside (a user's file, a folder, a link's target) keeps the folder;
    nothing is ever followed out of it (the folder is opened without following links and every entry is
    removed relative to it). Returns whether the folder is gone; never raises for what it finds."""
    try:
        fd = os.open(folder.path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return False  # gone, a link, or not a folder: nothing of ours to remove
    foreign = False
    try:
        names = sorted(entry.name for entry in os.scandir(fd))
        names.sort(key=lambda n: n != MANIFEST)  # the manifest goes first
        for name in names:
            if not (is_checkpoint_file_name(final_name(name)) and _unlink_file(name, fd)):
                foreign = True
    finally:
        os.close(fd)
    if foreign:
        return False
    try:
        os.rmdir(folder.path)
    except OSError:
        return False
    return True


def _unlink_file(name: str, dir_fd: int) -> bool:
    """Unlink ``name`` inside the open folder if it is a file or a link (never a folder); whether it is gone."""
    try:
        mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            return False
        os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


def clean_stale(root: str | os.PathLike) -> tuple[list[Path], list[Path]]:
    """Remove what interrupted saves left: step folders without a manifest and temporary files of ours.

    Call it only when no save can be in flight (at start). Returns (removed, left alone because they
    hold files this pack does not write).
    """
    root = Path(root)
    removed: list[Path] = []
    kept: list[Path] = []
    for folder in step_folders(root):
        if not folder.complete:
            (removed if remove_step_folder(folder) else kept).append(folder.path)
            continue
        try:
            fd = os.open(folder.path, os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_NOFOLLOW", 0))
        except OSError:
            continue
        try:
            for name in [e.name for e in os.scandir(fd)]:
                ours = is_temp_name(name) and is_checkpoint_file_name(final_name(name))
                if ours and _unlink_file(name, fd):
                    removed.append(folder.path / name)
        finally:
            os.close(fd)
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for entry in os.scandir(root):
            if is_temp_name(entry.name) and _POINTER.match(final_name(entry.name)) and entry.is_symlink():
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    removed.append(Path(entry.path))
    return removed, kept


def retention(
    folders: list[StepFolder],
    *,
    verified: Collection[Path],
    rejected: Collection[Path],
    keep_last: int,
    protect: Collection[Path] = (),
) -> list[StepFolder]:
    """The step folders to delete so that the newest ``keep_last`` *verified* checkpoints remain.

    Deleted: verified checkpoints older than the kept ones, and any folder older than the newest kept
    one that was rejected, never completed or (once ``keep_last`` verified ones are kept) never checked.
    Never deleted: the kept ones, ``protect``, and anything newer than the newest kept checkpoint (a
    rejected newer folder may be a node's transient fault; it is superseded, then deleted, by later saves).
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    ordered = sorted(folders, reverse=True)
    kept = [f for f in ordered if f.path in verified][:keep_last]
    if not kept:
        return []
    newest, full = kept[0], len(kept) == keep_last
    doomed = []
    for folder in ordered:
        if folder in kept or folder.path in protect or not folder < newest:
            continue
        if folder.path in verified:
            doomed.append(folder)  # older than the keep_last newest verified ones
        elif folder.path in rejected or not folder.complete or full:
            doomed.append(folder)
    return doomed


def is_our_link(path: Path) -> bool:
    """Whether ``path`` is a pointer this pack made: a link to a step folder (or its checkpoint file)."""
    if not path.is_symlink():
        return False
    return _OUR_TARGET.match(os.readlink(path).replace(os.sep, "/")) is not None


def pointer_path(root: str | os.PathLike) -> tuple[Path, list[Path]]:
    """Where ``root``'s pointer to the newest checkpoint lives, and what occupies the names before it.

    ``last.ckpt`` when it is free or a link of ours; when something else holds that name (a user's file, or
    a copy of the checkpoint an rsync made), it is left alone and the pointer is ``last-v1.ckpt``, and so on.
    """
    root = Path(root)
    taken = []
    for version in itertools.count():
        path = root / (LAST_LINK if version == 0 else f"last-v{version}.ckpt")
        if not os.path.lexists(path) or is_our_link(path):
            return path, taken
        taken.append(path)
    raise AssertionError("unreachable")


def point_last(pointer: Path, target: Path) -> None:
    """Atomically (re)point ``pointer`` (from :func:`pointer_path`) at ``target``, a path inside its folder."""
    root = pointer.parent
    tmp = temp_name(pointer)
    os.symlink(os.path.relpath(target, root), tmp)
    try:
        os.replace(tmp, pointer)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(root)


def pointer_target(pointer: Path) -> Path | None:
    """The step folder a pointer of ours names, if it exists (a dangling pointer gives ``None``)."""
    if not is_our_link(pointer):
        return None
    target = pointer.parent / os.readlink(pointer)
    folder = target.parent if target.name == CHECKPOINT_FILE else target
    with contextlib.suppress(OSError):
        if stat.S_ISDIR(os.lstat(folder).st_mode) and os.path.exists(target):
            return folder
    return None
