"""Reading checkpoint files without running code from them.

A checkpoint directory is data, never code: whoever can write to it must not be able to make a resume
execute anything. Three places in a load would unpickle arbitrary objects, and each is closed here:

- torch DCP's ``.metadata`` is read with plain ``pickle``: :class:`SafeFileSystemReader` reads it with an
  allow-list unpickler (DCP's own metadata classes, ``torch.Size``, dtypes, layouts, paths); anything
  else is refused, naming the class. It also refuses a ``.metadata`` that points at files outside its
  directory.
- DCP loads non-tensor values (optimizer hyperparameters) with ``torch.load(weights_only=False)``:
  :class:`SafeLoadPlanner` checks each with ``weights_only=True`` first.
- Lightning's single-file and ``meta.pt`` payloads are read with ``torch.load(weights_only=True)``
  (:func:`load_payload`).
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from lightning_hybrid._torch_compat import DCP_PRIVATE_GLOBALS

__all__ = [
    "UnsafeCheckpointError",
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "dcp_data_files",
    "load_payload",
    "read_dcp_metadata",
    "unsafe_byte_items",
    "unsafe_payload",
]

DCP_METADATA = ".metadata"
DCP_DATA_FILE = re.compile(r"^__\d+_\d+\.distcp$")

# What torch 2.13's DCP writes into `.metadata` (checked by a test that saves every kind of state the pack
# writes and reads it back through this list).
_ALLOWED: dict[str, frozenset[str]] = {
    "torch.distributed.checkpoint.metadata": frozenset(
        {
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
        }
    )
    | DCP_PRIVATE_GLOBALS["torch.distributed.checkpoint.metadata"],
    "torch.distributed.checkpoint.filesystem": DCP_PRIVATE_GLOBALS["torch.distributed.checkpoint.filesystem"],
    "torch.serialization": DCP_PRIVATE_GLOBALS["torch.serialization"],
    "torch": frozenset({"Size"}),
    "pathlib": frozenset({"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"}),
    "collections": frozenset({"OrderedDict"}),
    "builtins": frozenset({"set", "frozenset", "slice", "complex"}),
}


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file asked to build an object outside the allow-list (it could run code)."""


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # dtypes pickle as a global lookup: torch.float32
        raise UnsafeCheckpointError(
            f"refusing to load {module}.{name}: a checkpoint's metadata may only hold torch DCP's own metadata"
            " classes and plain values (the file was not written by torch DCP, or was modified)"
        )


def read_dcp_metadata(path: str | os.PathLike) -> Metadata:
    """The ``.metadata`` of the DCP checkpoint directory ``path``, read with the allow-list unpickler."""
    with open(Path(path) / DCP_METADATA, "rb") as f:
        metadata = _AllowListUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"{Path(path) / DCP_METADATA} holds a {type(metadata).__name__}, not DCP Metadata")
    dcp_data_files(metadata, where=Path(path))  # refuses references outside the directory
    return metadata


def dcp_data_files(metadata: Metadata, *, where: Path | None = None) -> set[str]:
    """The data files a DCP load may read: DCP data file names (``__<rank>_<n>.distcp``) of the directory.

    Nothing else: a value stored "inside" ``.metadata``, ``meta.pt`` or a rank file would escape the
    checks made on data files, and a path would escape the directory.
    """
    names = set()
    for info in (metadata.storage_data or {}).values():
        name = getattr(info, "relative_path", None)
        if not isinstance(name, str) or not DCP_DATA_FILE.match(name):
            raise UnsafeCheckpointError(
                f"{where or 'the checkpoint'}: .metadata refers to {name!r}, which is not a DCP data file of the"
                " checkpoint directory"
            )
        if getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpointError(
                f"{where or 'the checkpoint'}: .metadata asks for stream transforms {info.transform_descriptors}"
                " (never written by lightning-hybrid)"
            )
        names.add(name)
    return names


class SafeFileSystemReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` is read with :func:`read_dcp_metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise ValueError("per-rank DCP metadata files are not used by lightning-hybrid checkpoints")
        metadata = read_dcp_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that never unpickles more than ``torch.load(weights_only=True)`` accepts."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)  # raises on any global outside torch's safe set
        except pickle.UnpicklingError as exc:
            why = str(exc).split("WeightsUnpickler error: ")[-1].split(". Please use")[0]
            raise UnsafeCheckpointError(f"refusing to load {read_item.dest_index.fqn}: {why}") from None
        value.seek(0)
        super().load_bytes(read_item, value)  # the same bytes, now known to be plain values


def load_payload(path: str | os.PathLike, *, mmap: bool = False) -> Any:
    """A ``torch.save`` file of tensors and plain values (``weights_only=True``: never runs code)."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def unsafe_payload(obj: Any) -> str | None:
    """Why ``obj``, saved with ``torch.save``, would not load back with ``weights_only=True`` (or ``None``).

    Checked on a skeleton of ``obj`` (every tensor replaced by an empty one), so it costs a pickle of the
    non-tensor part only. The pack writes no checkpoint it could not read back without running code.
    """
    where = _defaultdict_at(obj, "")
    if where is not None:
        # torch's weights-only unpickler cannot rebuild a defaultdict even when it is allow-listed
        return (
            f"{where or 'the checkpoint'} is a collections.defaultdict, which torch's weights-only loader never"
            " rebuilds (allow-listing it does not help): return dict(...) from that state_dict"
        )
    buffer = io.BytesIO()
    torch.save(_skeleton(obj), buffer)
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as exc:
        why = str(exc).split("WeightsUnpickler error: ")[-1].split("Please use")[0].split("Check the documentation")[0]
        return " ".join(why.split()) + (
            "; keep state to tensors, numbers, strings, lists and dicts, or register the types with"
            " torch.serialization.add_safe_globals"
        )
    return None


def _defaultdict_at(obj: Any, path: str) -> str | None:
    """The key path of the first ``collections.defaultdict`` inside ``obj`` (``""``: ``obj`` itself)."""
    if isinstance(obj, collections.defaultdict):
        return path
    if isinstance(obj, dict):
        items: Any = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = enumerate(obj)
    else:
        return None
    for key, value in items:
        found = _defaultdict_at(value, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


def _skeleton(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return torch.empty(0, dtype=obj.dtype)
    if type(obj) is dict:
        return {k: _skeleton(v) for k, v in obj.items()}
    if type(obj) is list:
        return [_skeleton(v) for v in obj]
    if type(obj) is tuple:
        return tuple(_skeleton(v) for v in obj)
    return obj  # anything else goes as it is: exactly what the loader will meet


def unsafe_byte_items(folder: str | os.PathLike, metadata: Metadata, files: set[str]) -> str | None:
    """Why a non-tensor value stored in ``files`` would not load with ``weights_only=True``, or ``None``.

    A verification runs this before any loader sees the checkpoint, so a loader that unpickles DCP's byte
    items freely (Lightning's own ``ModelParallelStrategy``) never meets one that could run code.
    """
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    folder = Path(folder)
    for index, info in (metadata.storage_data or {}).items():
        if info.relative_path not in files:
            continue
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        with open(folder / info.relative_path, "rb") as f:
            f.seek(info.offset)
            value = io.BytesIO(f.read(info.length))
        try:
            torch.load(value, weights_only=True)
        except Exception as exc:
            return f"{info.relative_path}: the value of {index.fqn} is not plain data ({type(exc).__name__})"
    return None
