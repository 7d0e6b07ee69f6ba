"""What a checkpoint folder holds, and the manifest that says it is complete and intact.

::

    step-000000120/        one checkpoint (a rewrite of the same step goes to step-000000120-v1, ...)
        checkpoint.pt      kind "file" (single device, DDP): Lightning's whole checkpoint
        .metadata          kind "sharded" (HybridParallelStrategy, ModelParallelStrategy): torch DCP's index,
        __<r>_0.distcp       each rank's tensors,
        meta.pt              and everything that is not a model or optimizer tensor
        rank-00000.pt ...  per rank: RNG streams, position in the epoch's data
        manifest.json      written last: the folder counts only once it exists

A manifest is hostile input like every other file here: :func:`parse_manifest` accepts only the exact
shape :func:`manifest_payload` writes, every name must be a plain file name of this folder, and it must
list every file a load reads (for a sharded checkpoint, every data file its ``.metadata`` names).
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lightning_hybrid.checkpoint._files import FileEntry, sha256_file
from lightning_hybrid.checkpoint._safe_load import (
    DCP_DATA_FILE,
    DCP_METADATA,
    dcp_data_files,
    load_payload,
    read_dcp_metadata,
    unsafe_byte_items,
)

__all__ = [
    "CHECKPOINT_FILE",
    "MANIFEST",
    "META_FILE",
    "Kind",
    "Manifest",
    "ManifestError",
    "parse_manifest",
    "rank_file",
    "read_manifest",
    "verify",
]

MANIFEST = "manifest.json"
CHECKPOINT_FILE = "checkpoint.pt"
# Lightning's ModelParallelStrategy names its non-tensor file "meta.pt" too (lightning 2.6), so either can
# read what the other wrote; a test pins the name against Lightning's.
META_FILE = "meta.pt"
FORMAT_VERSION = 2
Kind = Literal["file", "sharded"]

_RANK_FILE = re.compile(r"^rank-(\d{5,})\.pt$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def is_checkpoint_file_name(name: str) -> bool:
    """A name this pack writes inside a step folder (clean-up deletes nothing else)."""
    return (
        name in (MANIFEST, CHECKPOINT_FILE, META_FILE, DCP_METADATA, DCP_METADATA + ".tmp")
        or _RANK_FILE.match(name) is not None
        or DCP_DATA_FILE.match(name) is not None
    )


class ManifestError(ValueError):
    """A manifest that is missing, unreadable or not in the shape this pack writes."""


@dataclass(frozen=True)
class Manifest:
    step: int
    kind: Kind
    world_size: int
    files: Mapping[str, FileEntry]
    info: Mapping[str, Any] = field(default_factory=dict)  # epoch, strategy, layout: informational

    def required(self) -> set[str]:
        """The files a load of this checkpoint always reads (a sharded one also reads its data files)."""
        ranks = {rank_file(r) for r in range(self.world_size)}
        return ranks | ({CHECKPOINT_FILE} if self.kind == "file" else {DCP_METADATA, META_FILE})


def manifest_payload(
    *, step: int, kind: Kind, world_size: int, files: Mapping[str, FileEntry], info: Mapping[str, Any]
) -> bytes:
    body = {
        "format": FORMAT_VERSION,
        **{k: v for k, v in info.items() if k not in ("format", "step", "kind", "world_size", "files")},
        "step": step,
        "kind": kind,
        "world_size": world_size,
        "files": {name: dict(entry) for name, entry in sorted(files.items())},
    }
    parse_manifest(json.dumps(body), step=step)  # what we write must be what we accept
    return json.dumps(body, indent=1, sort_keys=True).encode()


def parse_manifest(text: str | bytes, *, step: int | None = None) -> Manifest:
    """The manifest in ``text``; raises :class:`ManifestError` naming the first thing wrong with it."""
    try:
        body = json.loads(text)
    except Exception as exc:  # hostile JSON: bad bytes, bad syntax, nesting deep enough to exhaust the stack
        raise ManifestError(f"not valid JSON ({type(exc).__name__})") from None
    if not isinstance(body, dict):
        raise ManifestError(f"a JSON {type(body).__name__}, not an object")
    version = body.get("format")
    if version not in (1, FORMAT_VERSION):
        raise ManifestError(f"unknown format {version!r}")
    manifest_step = _int(body, "step", minimum=0)
    if step is not None and manifest_step != step:
        raise ManifestError(f"its step ({manifest_step}) is not the folder's ({step})")
    world_size = _int(body, "world_size", minimum=1)
    files = body.get("files")
    if not isinstance(files, dict) or not files:
        raise ManifestError(f"'files' must be a non-empty object, got {_show(files)}")
    if world_size > len(files):  # every rank writes a file: this also bounds what the checks below build
        raise ManifestError(f"'world_size' ({world_size}) is larger than the number of files it lists ({len(files)})")
    for name, entry in files.items():
        if not is_checkpoint_file_name(name) or name in (MANIFEST, DCP_METADATA + ".tmp"):
            raise ManifestError(f"lists {name!r}, which is not a checkpoint file name of this folder")
        if not (
            isinstance(entry, dict)
            and isinstance(entry.get("bytes"), int)
            and not isinstance(entry.get("bytes"), bool)
            and entry["bytes"] >= 0
            and isinstance(entry.get("sha256"), str)
            and _SHA256.match(entry["sha256"])
        ):
            raise ManifestError(
                f"the entry of {name!r} must be {{'bytes': int >= 0, 'sha256': hex}}, got {_show(entry)}"
            )
    kind = body.get("kind")
    if version == 1:  # written before kinds were recorded
        kind = "file" if CHECKPOINT_FILE in files else "sharded"
    if kind not in ("file", "sharded"):
        raise ManifestError(f"'kind' must be 'file' or 'sharded', got {_show(kind)}")
    info = {k: v for k, v in body.items() if k not in ("format", "step", "kind", "world_size", "files")}
    manifest = Manifest(manifest_step, kind, world_size, {n: dict(e) for n, e in files.items()}, info)
    missing = sorted(manifest.required() - set(files))
    if missing:
        raise ManifestError(f"does not list {missing}, which a load of a {kind!r} checkpoint reads")
    return manifest


def read_manifest(folder: str | os.PathLike, *, step: int | None = None) -> Manifest:
    path = Path(folder) / MANIFEST
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        raise ManifestError("incomplete (no manifest)") from None
    if not stat.S_ISREG(info.st_mode):
        raise ManifestError(f"{MANIFEST} is not a regular file")
    if info.st_size > 16 << 20:
        raise ManifestError(f"{MANIFEST} is {info.st_size} bytes, far more than any manifest")
    try:
        return parse_manifest(path.read_bytes(), step=step)
    except OSError as exc:
        raise ManifestError(f"unreadable ({exc})") from None


def verify(folder: str | os.PathLike, manifest: Manifest, *, hash_names: Iterable[str] | None = None) -> str | None:
    """Why ``folder`` does not hold what ``manifest`` lists, or ``None`` when it does.

    Every listed file must be a regular file (never a link) of the listed size; the files in
    ``hash_names`` (default: all) must match their SHA-256, and a hashed ``.metadata`` may only name data
    files the manifest lists.
    """
    folder = Path(folder)
    for name, entry in sorted(manifest.files.items()):
        try:
            info = os.lstat(folder / name)
        except FileNotFoundError:
            return f"{name} is missing"
        except OSError as exc:
            return f"{name} cannot be read ({exc})"
        if not stat.S_ISREG(info.st_mode):
            return f"{name} is not a regular file (a link or a folder)"
        if info.st_size != entry["bytes"]:
            return f"{name} has {info.st_size} bytes, the manifest says {entry['bytes']} (truncated or overwritten)"
    hashed = sorted(manifest.files if hash_names is None else set(hash_names) & set(manifest.files))
    for name in hashed:
        try:
            if sha256_file(folder / name) != manifest.files[name]["sha256"]:
                return f"{name} does not match its SHA-256 checksum (corrupted or modified)"
        except OSError as exc:
            return f"{name} cannot be read ({exc})"
    for name in hashed:
        if name.endswith(".pt"):
            problem = _payload_problem(folder / name)
            if problem:
                return f"{name} {problem}"
    if manifest.kind == "sharded" and any(n == DCP_METADATA or n.endswith(".distcp") for n in hashed):
        # the index decides which files a load reads, and DCP unpickles its non-tensor values: both checked
        # here, before any loader sees them
        try:
            index = read_dcp_metadata(folder)
            unlisted = sorted(dcp_data_files(index) - set(manifest.files))
            unsafe = unsafe_byte_items(folder, index, {n for n in hashed if n.endswith(".distcp")})
        except Exception as exc:  # hostile bytes can fail an unpickler in many ways; all mean "invalid"
            return f"{DCP_METADATA} is not a valid torch DCP index ({type(exc).__name__}: {exc})"
        if unlisted:
            return f"{DCP_METADATA} refers to {unlisted}, which the manifest does not list"
        if unsafe:
            return unsafe
    return None


def _payload_problem(path: Path) -> str | None:
    """Why a ``torch.save`` file of the checkpoint would not load as plain data (or ``None``).

    Memory-mapped: the tensors' bytes are not read, only the structure is unpickled (allow-listed).
    """
    try:
        payload = load_payload(path, mmap=True)
    except Exception as exc:
        return f"does not load as plain data ({type(exc).__name__})"
    if _RANK_FILE.match(path.name) and not (
        isinstance(payload, dict) and isinstance(payload.get("rng"), dict) and isinstance(payload.get("data"), dict)
    ):
        return "is not a rank state (RNG streams and data position)"
    return None


def _int(body: dict[str, Any], key: str, *, minimum: int) -> int:
    value = body.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ManifestError(f"{key!r} must be an integer >= {minimum}, got {_show(value)}")
    return value


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
