"""Durable file writes: temporary name, flush, fsync, rename, fsync of the directory.

A reader never sees a half-written file under its real name, and a file that has its real name survives
a power loss with its final contents: the bytes are flushed out of Python's buffer and fsynced *before*
the rename, and the directory is fsynced after it. Every file is hashed while it is written, so a
checksum costs no second read.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import stat
import uuid
from collections.abc import Callable, Generator
from pathlib import Path
from typing import IO, Any

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

__all__ = [
    "AtomicFileSystem",
    "FileEntry",
    "atomic_write",
    "durable_writer",
    "fsync_dir",
    "is_temp_name",
    "sha256_file",
]

FileEntry = dict[str, Any]  # {"bytes": size, "sha256": hex digest}: one file of a manifest

# `<final name>.lhtmp-<16 hex>`: specific enough that clean-up never matches a name a user chose
_TMP_MARK = ".lhtmp-"
_TMP_NAME = re.compile(r"^(?P<final>.+)\.lhtmp-[0-9a-f]{16}$")
_CHUNK = 8 << 20


def temp_name(path: Path) -> Path:
    return path.with_name(f"{path.name}{_TMP_MARK}{uuid.uuid4().hex[:16]}")


def is_temp_name(name: str) -> bool:
    return _TMP_NAME.match(name) is not None


def final_name(name: str) -> str:
    """The name a temporary file would have been renamed to (the name itself for other files)."""
    match = _TMP_NAME.match(name)
    return match.group("final") if match else name


def fsync_dir(path: Path) -> None:
    """Make the renames inside ``path`` durable (a no-op where a directory cannot be opened)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _HashingFile(io.RawIOBase):
    """A write-only file that hashes what passes through and, on close, flushes and fsyncs it."""

    def __init__(self, raw: IO[bytes]) -> None:
        super().__init__()
        self.raw, self.digest, self.size = raw, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.digest.update(view)
        self.size += len(view)
        return self.raw.write(view)

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def tell(self) -> int:
        return self.size

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        if self.closed:
            return
        if not self.raw.closed:
            # whoever wrote through us may have fsynced before Python's buffer reached the OS (torch DCP
            # does): flush and fsync here, so the bytes are on disk before the file gets its real name
            self.raw.flush()
            os.fsync(self.raw.fileno())
            self.raw.close()
        super().close()

    def entry(self) -> FileEntry:
        return {"bytes": self.size, "sha256": self.digest.hexdigest()}


@contextlib.contextmanager
def durable_writer(path: str | os.PathLike, mode: str = "wb") -> Generator[_HashingFile, None, None]:
    """Open ``path`` for writing under a temporary name; on success it is fsynced and renamed into place.

    The yielded file has ``entry()`` (size and SHA-256 of what was written). On any exception (Ctrl-C
    included) the temporary file is removed and the exception propagates; the real name is untouched.
    """
    path = Path(path)
    tmp = temp_name(path)
    try:
        with open(tmp, mode) as raw:
            hashing = _HashingFile(raw)
            yield hashing
            hashing.close()  # flush + fsync, only for a complete file
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> FileEntry:
    """Write ``path`` through ``write(file)`` durably; returns its manifest entry (size and SHA-256)."""
    with durable_writer(path) as f:
        write(f)  # type: ignore[arg-type]
    return f.entry()


class AtomicFileSystem(FileSystem):
    """torch DCP's local filesystem, made durable: each file appears under its real name only once its final
    contents are on disk (see :func:`durable_writer`); ``written`` maps each final name to its entry."""

    def __init__(self) -> None:
        super().__init__()
        self.written: dict[str, FileEntry] = {}

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with durable_writer(path, mode) as stream:
            yield stream
        self.written[Path(path).name] = stream.entry()

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        # DCP writes `.metadata.tmp` and renames it last: that rename is what makes its checkpoint readable
        os.replace(path, new_path)
        fsync_dir(Path(new_path).parent)
        old, new = Path(path).name, Path(new_path).name
        if old in self.written:
            self.written[new] = self.written.pop(old)


def dcp_writer(path: str | os.PathLike) -> tuple[FileSystemWriter, AtomicFileSystem]:
    """A DCP writer for ``path`` whose files are durable and hashed (one file per rank)."""
    writer = FileSystemWriter(path, single_file_per_rank=True, sync_files=True, thread_count=1)
    writer.fs = fs = AtomicFileSystem()  # a public attribute of the writer; DCP writes only through it
    return writer, fs


def sha256_file(path: str | os.PathLike) -> str:
    """SHA-256 of a regular file, never through a link (and never blocking on a FIFO put in its place)."""
    digest = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    with open(fd, "rb", closefd=True) as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise OSError(f"{path} is not a regular file")
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()
