"""Sharded (torch DCP) checkpoints: how a Lightning checkpoint is split, written and read back.

Tensors of the model and the optimizers go through DCP (each rank writes its own part; any layout reads
it back, resharding); everything else (loops, callbacks, schedulers, hyperparameters, the layout record)
goes into ``meta.pt``, written by global rank 0. The split is the one Lightning's ``ModelParallelStrategy``
uses, so either can read what the other wrote.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from lightning.pytorch.strategies import Strategy
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from lightning_hybrid._agree import agreed_problem
from lightning_hybrid.checkpoint._files import FileEntry, atomic_write, dcp_writer
from lightning_hybrid.checkpoint._flat_shards import FlatShardLoadPlanner, FlatShardSavePlanner
from lightning_hybrid.checkpoint._format import MANIFEST, META_FILE, ManifestError, read_manifest, verify
from lightning_hybrid.checkpoint._safe_load import (
    DCP_METADATA,
    SafeFileSystemReader,
    UnsafeCheckpointError,
    load_payload,
    read_dcp_metadata,
)

__all__ = [
    "GROUP_INDEX",
    "LAYOUT_KEY",
    "agreed_checkpoint_folder",
    "checkpoint_folder",
    "missing_values",
    "read_meta",
    "read_sharded",
    "read_sharded_index",
    "save_sharded_checkpoint",
    "split_checkpoint",
    "verified_checkpoint",
    "write_sharded",
]

LAYOUT_KEY = "hybrid_layout"  # meta.pt: the layout a sharded checkpoint was written with (informational)
# optimizer_N.param_groups.<fqn>.__group__: the index of the param group the parameter was in. A group added
# during training (BackboneFinetuning unfreezing a backbone, add_param_group) is rebuilt from it on resume,
# on each pipeline rank from its own parameters, before its state is loaded.
GROUP_INDEX = "__group__"


def split_checkpoint(
    checkpoint: dict[str, Any], layout: dict[str, Any] | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors for DCP, the rest for meta.pt)`` of a Lightning checkpoint dict (the dict is consumed); the
    layout record of the writing strategy, when given, goes into meta.pt."""
    tensors = {"state_dict": checkpoint.pop("state_dict")}
    for idx, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
        tensors[f"optimizer_{idx}"] = optimizer_state
    if layout is not None:
        checkpoint[LAYOUT_KEY] = dict(layout)
    return tensors, checkpoint


def write_sharded(
    path: str | os.PathLike,
    tensors: dict[str, Any],
    meta: dict[str, Any] | None,
    *,
    process_group: dist.ProcessGroup | None = None,
    write_file: Callable[[Path, Callable[[Any], Any]], FileEntry] = atomic_write,
) -> dict[str, FileEntry]:
    """Write this rank's part of a sharded checkpoint into the existing folder ``path`` (every rank calls it;
    ``meta`` is written by whoever passes it: global rank 0). Returns the files this rank wrote."""
    path = Path(path)
    files: dict[str, FileEntry] = {}
    failed: Exception | None = None
    if meta is not None:  # before DCP's .metadata, which DCP writes last: a folder with .metadata is whole
        try:
            files[META_FILE] = write_file(path / META_FILE, lambda f: torch.save(meta, f))
        except Exception as exc:  # a full disk: the other ranks are already in DCP's collectives, so go too
            failed = exc
    writer, fs = dcp_writer(path)
    try:
        dcp.save(
            tensors,
            storage_writer=writer,
            planner=FlatShardSavePlanner(),
            process_group=process_group,
            no_dist=not dist.is_initialized(),
        )
    except CheckpointException as exc:
        raise plain_failure(exc, f"writing {path}") from exc
    if failed is not None:  # without meta.pt the folder is not whole: take its index away again
        (path / DCP_METADATA).unlink(missing_ok=True)
        raise failed
    files.update(fs.written)
    return files


def read_sharded_index(path: str | os.PathLike) -> Metadata:
    """The DCP index of a sharded checkpoint (read without running code)."""
    return read_dcp_metadata(path)


def read_sharded(
    path: str | os.PathLike,
    tensors: dict[str, Any],
    *,
    process_group: dist.ProcessGroup | None = None,
    no_dist: bool | None = None,
) -> None:
    """Fill ``tensors`` (shaped as this rank holds them) from a sharded checkpoint, in place.

    Every rank of ``process_group`` calls it, unless ``no_dist`` (one process reads everything itself;
    the default when there is no process group)."""
    try:
        dcp.load(
            tensors,
            storage_reader=SafeFileSystemReader(path),
            planner=FlatShardLoadPlanner(),
            process_group=process_group,
            no_dist=not dist.is_initialized() if no_dist is None else no_dist,
        )
    except CheckpointException as exc:
        raise plain_failure(exc, f"reading {path}") from exc


def plain_failure(exc: CheckpointException, what: str) -> BaseException:
    """What to raise for DCP's ``CheckpointException``, which wraps every rank's failure and is a
    ``BaseException``: an ``except Exception`` (a user's, Lightning's callers', a job script's) would let it
    through and end the process. Ctrl-C or a SystemExit it wraps is raised as itself (it stops the run; it
    is not a failed checkpoint), a refused value as its own message, anything else as a ``RuntimeError``
    naming each rank's failure."""
    failures = {rank: f[0] if isinstance(f, tuple) else f for rank, f in exc.failures.items()}  # (error, traceback)
    for wanted in ((KeyboardInterrupt, SystemExit), UnsafeCheckpointError):
        found = [e for e in failures.values() if isinstance(e, wanted)]
        if found:
            return found[0]
    detail = "; ".join(f"rank {rank}: {type(e).__name__}: {e}" for rank, e in sorted(failures.items()))
    return RuntimeError(f"{what} failed: {detail}")


def read_meta(path: str | os.PathLike) -> dict[str, Any]:
    return load_payload(Path(path) / META_FILE)


def missing_index(path: Path) -> str | None:
    """Why ``path`` is not a complete sharded checkpoint (no DCP index), or None: the check every reader makes."""
    if (path / DCP_METADATA).is_file():
        return None
    return (
        f"{path} is not a complete sharded checkpoint of this pack (it has no {DCP_METADATA} file); pass the"
        " folder that trainer.save_checkpoint or FaultTolerantCheckpoint wrote."
    )


def verified_checkpoint(path: str | os.PathLike, *, hashes: bool = True) -> Path:
    """``path`` resolved, once it is a complete sharded checkpoint that matches its manifest when it has one (one
    process; ``hashes=False`` checks the files' presence and sizes only, as a rank does whose peer hashed them)."""
    path = Path(path).resolve()
    problem = missing_index(path)
    if problem:
        raise FileNotFoundError(problem)
    if (path / MANIFEST).exists():
        try:
            problem = verify(path, read_manifest(path), hash_names=None if hashes else ())
        except ManifestError as exc:
            problem = f"unreadable manifest: {exc}"
        if problem:
            raise ValueError(f"{path} fails verification: {problem}.")
    return path


def agreed_checkpoint_folder(path: Path, device: torch.device) -> Path:
    """``path`` once every rank found it a complete sharded checkpoint; else every rank raises the same error."""
    problem = agreed_problem(missing_index(path), device=device)
    if problem:
        raise FileNotFoundError(problem)
    return path


def missing_values(path: Path, missing: list[str]) -> str:
    """The refusal of a strict load (``strict_loading=True``) that finds no values for ``missing``."""
    return f"The checkpoint at {path} has no values for {missing[:5]} (strict_loading=True)"


def checkpoint_folder(strategy: Strategy, checkpoint_path: str | os.PathLike) -> Path:
    """The folder every rank reads: rank 0 resolves links (``last.ckpt``), whatever each node caches."""
    return Path(strategy.broadcast(str(Path(checkpoint_path).resolve())))


def save_sharded_checkpoint(
    strategy: Strategy, checkpoint: dict[str, Any], filepath: str | os.PathLike, layout: dict[str, Any]
) -> None:
    """Write Lightning's ``checkpoint`` dict as a sharded folder at ``filepath`` (every rank calls it)."""
    path = Path(strategy.broadcast(str(filepath)))  # one folder for every rank
    problem = None
    if strategy.is_global_zero:
        try:
            path.mkdir(parents=True, exist_ok=True)
            # rewriting a folder: without the old index it never looks whole while the new one is written
            (path / DCP_METADATA).unlink(missing_ok=True)
        except OSError as exc:  # a file there, no permission: every rank fails the same way
            problem = f"cannot write a sharded checkpoint (a folder) at {path}: {exc}"
    problem = strategy.broadcast(problem)
    if problem:
        raise OSError(problem)
    tensors, meta = split_checkpoint(checkpoint, layout)
    write_sharded(path, tensors, meta if strategy.is_global_zero else None)
    strategy.barrier(f"{type(strategy).__name__}.save_checkpoint.done")
