"""Where pretrained tensors are read from, each by key and by row range without loading the rest: a torch
``.pt``/``.bin`` file (memory-mapped, weights only), ``.safetensors`` files or a Hugging Face index folder, or a
checkpoint folder of this pack (verified, read through DCP). ``open_weights`` picks one from the path."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol, Union

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_hybrid._slices import Box
from lightning_hybrid.checkpoint._flat_shards import FlatShard
from lightning_hybrid.checkpoint._sharded import (
    LAYOUT_KEY,
    read_meta,
    read_sharded,
    read_sharded_index,
    verified_checkpoint,
)
from lightning_hybrid.checkpoint.tied_names import CheckpointNames

__all__ = ["WeightsSource", "open_weights"]

_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}  # fmt: skip


class WeightsSource(Protocol):
    """What a source of pretrained weights offers: the shapes of its tensors, and a box of one tensor.

    ``read(key, box)``: the whole tensor for ``box=None``; else ``box`` gives ``(start, stop)`` for each leading
    dimension (the rest whole), e.g. ``((0, 4),)`` for rows 0-3 (ZeRO-3) or ``((0, 8), (16, 32))`` for a
    column slice (tensor parallelism). A source reads no more than the box where its format allows."""

    def index(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]: ...

    def read(self, key: str, box: Union[Box, None]) -> Tensor: ...


def _slices(box: Union[Box, tuple[int, int], None]) -> Union[tuple[slice, ...], None]:
    """``box`` as index slices; ``(start, stop)`` of two integers means rows."""
    if box is None:
        return None
    if len(box) == 2 and all(isinstance(b, int) for b in box):
        box = (box,)  # type: ignore[assignment]
    return tuple(slice(a, b) for a, b in box)  # type: ignore[misc]


class _TorchFile:
    def __init__(self, path: Path) -> None:
        state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        if isinstance(state, Mapping) and isinstance(state.get("state_dict"), Mapping):
            state = state["state_dict"]  # a Lightning checkpoint file: its weights
        if not isinstance(state, Mapping) or not all(isinstance(v, Tensor) for v in state.values()):
            raise ValueError(f"{path} is not a state_dict (a dict of tensor names to tensors).")
        self._state = state

    def index(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (tuple(v.shape), v.dtype) for k, v in self._state.items()}

    def read(self, key: str, box: Union[Box, None]) -> Tensor:
        tensor, where = self._state[key], _slices(box)
        return tensor if where is None else tensor[where]


class _SafetensorsFiles:
    def __init__(self, files: dict[str, Path]) -> None:
        from safetensors import safe_open

        self._handles = {path: safe_open(str(path), framework="pt", device="cpu") for path in set(files.values())}
        self._file_of = files

    def index(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        out = {}
        for key, path in self._file_of.items():
            view = self._handles[path].get_slice(key)
            dtype = _SAFETENSORS_DTYPES.get(view.get_dtype())
            if dtype is None:
                raise ValueError(f"{path}: tensor {key!r} has the unsupported dtype {view.get_dtype()}.")
            out[key] = (tuple(view.get_shape()), dtype)
        return out

    def read(self, key: str, box: Union[Box, None]) -> Tensor:
        handle, where = self._handles[self._file_of[key]], _slices(box)
        return handle.get_tensor(key) if where is None else handle.get_slice(key)[where]


class _PackCheckpoint:
    _PREFIX = "state_dict."

    def __init__(self, path: Path, *, verify: bool = True) -> None:
        self._path = verified_checkpoint(path, hashes=verify)
        metadata = read_sharded_index(self._path).state_dict_metadata
        self._meta = {
            k[len(self._PREFIX) :]: v
            for k, v in metadata.items()
            if k.startswith(self._PREFIX) and isinstance(v, TensorStorageMetadata)
        }
        # a tied parameter is stored once, under its first name: its other names read that tensor
        layout = read_meta(self._path).get(LAYOUT_KEY) or {}
        self._stored = CheckpointNames.from_json(layout.get("tied_parameters", []))

    def index(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        out = {k: (tuple(v.size), v.properties.dtype) for k, v in self._meta.items()}
        out.update({a: out[first] for a, first in self._stored.aliases.items() if first in out})
        return out

    def read(self, key: str, box: Union[Box, None]) -> Tensor:
        key = self._stored.stored_key(key)
        meta = self._meta[key]
        shape = tuple(meta.size)
        where = _slices(box)
        if where is None:
            out = torch.empty(shape, dtype=meta.properties.dtype)
            read_sharded(self._path, {self._PREFIX + key: out}, no_dist=True)
            return out
        full = [slice(0, n) for n in shape]
        full[: len(where)] = where
        offsets = tuple(s.start for s in full)
        out = torch.empty(tuple(s.stop - s.start for s in full), dtype=meta.properties.dtype)
        target = FlatShard(torch.Size(shape), out.dtype, [(offsets, out)])
        read_sharded(self._path, {self._PREFIX + key: target}, no_dist=True)  # this rank's box, nothing else
        return out


def open_weights(path: Union[str, os.PathLike], *, verify: bool = True) -> WeightsSource:
    """The source at ``path`` (see the module docstring for the kinds); raises ``ValueError`` saying what is
    wrong with the path. ``verify``: hash a pack checkpoint's files against its manifest (one rank does it
    for the job; the others check that every file is there with its size)."""
    path = Path(path)
    if path.is_file():
        if path.suffix == ".safetensors":
            return _SafetensorsFiles(_keys_of_files([path]))
        return _TorchFile(path)
    if not path.is_dir():
        raise ValueError(f"init_from={str(path)!r} does not exist (a weights file or folder on every node).")
    if (path / ".metadata").is_file():
        return _PackCheckpoint(path, verify=verify)
    indexes = sorted(path.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise ValueError(
            f"{path} holds several indexes ({[i.name for i in indexes]}); point init_from at one folder each."
        )
    if indexes:
        return _SafetensorsFiles(_index_files(indexes[0]))
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise ValueError(
            f"{path} holds no weights: expected *.safetensors (with or without an index) or a sharded checkpoint."
        )
    return _SafetensorsFiles(_keys_of_files(shards))


def _keys_of_files(files: list[Path]) -> dict[str, Path]:
    from safetensors import safe_open

    owner: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                if key in owner:
                    raise ValueError(f"tensor {key!r} is in both {owner[key].name} and {path.name}.")
                owner[key] = path
    return owner


def _index_files(index: Path) -> dict[str, Path]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{index} is not a safetensors index (a JSON object with a 'weight_map'): {exc}") from None
    if not isinstance(weight_map, dict):
        raise ValueError(f"{index}: 'weight_map' must map tensor names to file names.")
    files = {}
    for key, name in weight_map.items():
        # file names only: an index cannot send the reader outside its folder
        if not isinstance(name, str) or Path(name).name != name or not name.endswith(".safetensors"):
            raise ValueError(f"{index}: {key!r} names the file {name!r}; expected a .safetensors file in the folder.")
        files[key] = index.parent / name
    missing = sorted({p.name for p in files.values() if not p.is_file()})
    if missing:
        raise ValueError(f"{index} names shards that are not there: {missing[:5]}.")
    return files
