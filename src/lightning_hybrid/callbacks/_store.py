"""The on-disk checkpoint store: atomic step directories, a checksummed manifest, validation, retention.

Layout under the root directory::

    step-000000120/            one checkpoint, whatever the strategy writes into it
        checkpoint.pt          (single device / DDP)  or  .metadata, __0_0.distcp, meta.pt  (DCP, sharded)
        rank-00000.pt ...      per-rank state: RNG streams, data position
        manifest.json          written last: the checkpoint counts only once this exists
    last.ckpt -> step-000000120[/checkpoint.pt]   what ``Trainer.fit(ckpt_path="last")`` loads

Every file is written under a temporary name in its final directory, fsynced, then renamed, so a reader
never sees a half-written file under its real name; the manifest lists each file's size and SHA-256, so
a truncated or bit-flipped file is detected before anything is loaded from it. Plain code: no Trainer,
no process group (the callback decides which rank calls what).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from torch.distributed.checkpoint.filesystem import FileSystem

__all__ = [
    "LAST_LINK",
    "MANIFEST",
    "AtomicFileSystem",
    "CheckpointEntry",
    "atomic_write",
    "checkpoints",
    "clean_stale",
    "point_last",
    "retain",
    "sha256_file",
    "step_dir",
    "verify",
    "write_manifest",
]

MANIFEST = "manifest.json"
LAST_LINK = "last.ckpt"
_TMP = ".tmp-"
_STEP = re.compile(r"^step-(\d{9,})$")
_CHUNK = 8 << 20


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:09d}"


def _tmp_name(path: Path) -> Path:
    return path.with_name(f"{path.name}{_TMP}{uuid.uuid4().hex[:8]}")


def _fsync_dir(path: Path) -> None:
    # makes the renames inside `path` durable; not every filesystem allows opening a directory
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _HashingWriter(io.RawIOBase):
    """A write-only file that hashes what passes through, so a checksum costs no second read."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw, self.digest, self.size = raw, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        self.size += len(view)
        return self.raw.write(view)

    def flush(self) -> None:
        self.raw.flush()

    def tell(self) -> int:
        return self.size

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        if not self.closed:
            super().close()  # flushes through to the raw file first
            self.raw.close()


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> dict[str, Any]:
    """Write ``path`` through ``write(file)`` under a temporary name, fsync, then rename into place.

    Returns the manifest entry of the file (``bytes`` and ``sha256``), hashed while it was written.
    """
    path = Path(path)
    tmp = _tmp_name(path)
    try:
        with open(tmp, "wb") as f:
            hashing = _HashingWriter(f)
            write(hashing)  # type: ignore[arg-type]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    return {"bytes": hashing.size, "sha256": hashing.digest.hexdigest()}


class AtomicFileSystem(FileSystem):
    """DCP's local filesystem, except that each file appears under its real name only once fully written.

    Files are hashed while DCP writes them; ``written`` maps each file name to its manifest entry.
    """

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, dict[str, Any]] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        path = Path(path)
        tmp = _tmp_name(path)
        try:
            with open(tmp, mode) as raw:
                hashing = _HashingWriter(raw)
                yield hashing  # DCP fsyncs (through fileno) and closes the stream itself
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
            raise
        self.written[path.name] = {"bytes": hashing.size, "sha256": hashing.digest.hexdigest()}


def sha256_file(path: str | os.PathLike) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def describe_files(directory: Path, names: Iterable[str]) -> dict[str, dict[str, Any]]:
    """``{name: {"bytes": size, "sha256": digest}}`` for the given files of ``directory``."""
    return {n: {"bytes": (directory / n).stat().st_size, "sha256": sha256_file(directory / n)} for n in names}


def write_manifest(directory: str | os.PathLike, files: dict[str, dict[str, Any]], info: dict[str, Any]) -> None:
    """Mark ``directory`` complete: the manifest goes last, after every file it lists is durable."""
    directory = Path(directory)
    missing = [n for n in files if not (directory / n).is_file()]
    if missing:
        raise FileNotFoundError(f"cannot complete checkpoint {directory}: missing {missing}")
    _fsync_dir(directory)
    payload = json.dumps({"format": 1, **info, "files": files}, indent=1, sort_keys=True).encode()
    atomic_write(directory / MANIFEST, lambda f: f.write(payload))
    _fsync_dir(directory)


def read_manifest(directory: str | os.PathLike) -> dict[str, Any]:
    return json.loads((Path(directory) / MANIFEST).read_text())


def verify(directory: str | os.PathLike, *, names: Iterable[str] | None = None, checksums: bool = True) -> str | None:
    """Why ``directory`` is not a valid checkpoint, or ``None`` when it is.

    ``names`` restricts the check to some files (a rank confirming its own part); ``checksums=False``
    checks presence and sizes only (cheap: no file is read).
    """
    directory = Path(directory)
    try:
        manifest = read_manifest(directory)
    except FileNotFoundError:
        return "incomplete (no manifest)"
    except (OSError, ValueError) as exc:
        return f"unreadable manifest ({exc})"
    files: dict[str, dict[str, Any]] = manifest.get("files", {})
    wanted = files if names is None else {n: files[n] for n in names if n in files}
    for name, entry in sorted(wanted.items()):
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != entry["bytes"]:
            return f"{name} has {size} bytes, the manifest says {entry['bytes']} (truncated or overwritten)"
        if checksums and sha256_file(path) != entry["sha256"]:
            return f"{name} does not match its SHA-256 checksum (corrupted or modified)"
    return None


@dataclass(frozen=True)
class CheckpointEntry:
    step: int
    path: Path

    @property
    def complete(self) -> bool:
        return (self.path / MANIFEST).is_file()


def checkpoints(root: str | os.PathLike) -> list[CheckpointEntry]:
    """Every step directory under ``root``, newest first (complete or not)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [CheckpointEntry(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and p.is_dir()]
    return sorted(found, key=lambda e: e.step, reverse=True)


def clean_stale(root: str | os.PathLike) -> list[Path]:
    """Remove temporary files and step directories without a manifest (a save that never finished).

    Call it only when no save can be in flight (at start, before the first save).
    """
    root = Path(root)
    removed: list[Path] = []
    for entry in checkpoints(root):
        if not entry.complete:
            shutil.rmtree(entry.path, ignore_errors=True)
            removed.append(entry.path)
            continue
        for tmp in entry.path.glob(f"*{_TMP}*"):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    if root.is_dir():
        for tmp in root.glob(f"*{_TMP}*"):
            tmp.unlink(missing_ok=True)
            removed.append(tmp)
    return removed


def retain(root: str | os.PathLike, keep_last: int, *, protect: Iterable[Path] = ()) -> list[Path]:
    """Delete complete checkpoints beyond the newest ``keep_last``; never an incomplete or protected one.

    ``protect`` names directories that must survive whatever their age (the one ``last.ckpt`` points to).
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    keep = {Path(p).resolve() for p in protect}
    complete = [e for e in checkpoints(root) if e.complete]
    removed = []
    for entry in complete[keep_last:]:
        if entry.path.resolve() in keep:
            continue
        # the manifest goes first: a half-deleted directory must never look complete
        (entry.path / MANIFEST).unlink(missing_ok=True)
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry.path)
    return removed


def point_last(root: str | os.PathLike, target: Path) -> None:
    """Atomically (re)point ``root/last.ckpt`` at ``target`` (a path inside ``root``) with a relative symlink."""
    root = Path(root)
    link = root / LAST_LINK
    tmp = _tmp_name(link)
    os.symlink(os.path.relpath(target, root), tmp)
    os.replace(tmp, link)
    _fsync_dir(root)


def last_target(root: str | os.PathLike) -> Path | None:
    link = Path(root) / LAST_LINK
    return link.resolve() if link.is_symlink() or link.exists() else None
