"""Flat-range shards of a tensor in a torch DCP checkpoint, through DCP's public planner interface.

ZeRO-1/2 give each data-parallel rank a contiguous *flat* range of a group of parameters, which is not a
dim-0 slice of any one tensor (so neither a DTensor nor an FSDP shard). A rank's range of one tensor is
cut into boxes (``flat_boxes``: contiguous in memory, so each is a view) and described to DCP as chunks of
the tensor's full shape. A checkpoint therefore holds every tensor under its unsplit name and shape, each
rank writes only its boxes, and any other layout reads back exactly the chunks it owns.

:class:`FlatShard` is the state-dict value; :class:`FlatShardSavePlanner` / :class:`FlatShardLoadPlanner`
are DCP planners that know it (every other value is planned as DCP's default planners plan it).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import DefaultSavePlanner, LoadPlan, SavePlan
from torch.distributed.checkpoint.default_planner import create_default_local_load_plan, create_default_local_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from lightning_hybrid.checkpoint._safe_load import SafeLoadPlanner

__all__ = ["FlatShard", "FlatShardLoadPlanner", "FlatShardSavePlanner", "flat_boxes", "flat_index", "view_boxes"]


@dataclasses.dataclass
class FlatShard:
    """This rank's part of a tensor of ``shape``: boxes ``(offsets, view)`` of its flat range."""

    shape: torch.Size
    dtype: torch.dtype
    boxes: list[tuple[tuple[int, ...], Tensor]]

    def size(self) -> torch.Size:
        return self.shape  # what DCP compares against the checkpoint

    def chunks(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(o), torch.Size(t.shape)) for o, t in self.boxes]

    def box(self, offsets: Any) -> Tensor:
        key = tuple(offsets)
        for box_offsets, tensor in self.boxes:
            if tuple(box_offsets) == key:
                return tensor
        raise KeyError(f"no local box at {key} of a tensor of shape {tuple(self.shape)}")

    def __deepcopy__(self, memo: dict[int, Any]) -> FlatShard:
        # a snapshot for a background write: the boxes copied to CPU memory, nothing else
        return FlatShard(self.shape, self.dtype, [(o, t.detach().to("cpu", copy=True)) for o, t in self.boxes])


class FlatShardSavePlanner(DefaultSavePlanner):
    """DCP's default save planner, plus one shard write per local box of each :class:`FlatShard`."""

    def create_local_plan(self) -> SavePlan:
        plain = {k: v for k, v in self.state_dict.items() if not isinstance(v, FlatShard)}
        plan = create_default_local_save_plan(plain, self.is_coordinator)
        items = [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(offsets)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(box.shape)),
                    properties=TensorProperties(dtype=value.dtype),
                    size=torch.Size(value.shape),
                ),
            )
            for fqn, value in self.state_dict.items()
            if isinstance(value, FlatShard)
            for offsets, box in value.boxes
        ]
        plan = dataclasses.replace(plan, items=plan.items + items)
        if self.flatten_state_dict:
            plan = dataclasses.replace(plan, planner_data=self.mappings)
        self.plan = plan
        return plan

    def resolve_data(self, write_item: WriteItem) -> Any:
        value = self.state_dict.get(write_item.index.fqn)
        if isinstance(value, FlatShard):
            return value.box(write_item.index.offset)
        return super().resolve_data(write_item)


class FlatShardLoadPlanner(SafeLoadPlanner):
    """The safe load planner, plus reads of exactly the local boxes of each :class:`FlatShard`."""

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Any = None, is_coordinator: bool = False) -> None:
        # DCP's set-up rebuilds the state dict in place and drops values it does not know (a FlatShard
        # would become None): take them out first, then put them back, flat keys as DCP flattens them
        taken: list[tuple[dict[str, Any], str, str, FlatShard]] = []

        def take(container: dict[str, Any], prefix: str) -> None:
            for key, value in container.items():
                if isinstance(value, FlatShard):
                    taken.append((container, key, f"{prefix}{key}", value))
                elif isinstance(value, dict):
                    take(value, f"{prefix}{key}.")

        take(state_dict, "")
        for container, key, _, _ in taken:
            container[key] = None
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for container, key, flat_key, value in taken:
            container[key] = value
            self.state_dict[flat_key if self.flatten_state_dict else key] = value

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None
        plain = {k: v for k, v in self.state_dict.items() if not isinstance(v, FlatShard)}
        plan = create_default_local_load_plan(plain, self.metadata, not self.allow_partial_load)
        items = []
        for fqn, value in self.state_dict.items():
            if not isinstance(value, FlatShard):
                continue
            saved = self.metadata.state_dict_metadata.get(fqn)
            if not isinstance(saved, TensorStorageMetadata) or saved.size != value.shape:
                found = getattr(saved, "size", None)
                raise ValueError(
                    f"{fqn}: the checkpoint holds {found}, this layout needs a tensor of {tuple(value.shape)}"
                )
            items += create_read_items_for_chunk_list(fqn, saved, value.chunks())
        return dataclasses.replace(plan, items=plan.items + items)

    def lookup_tensor(self, index: MetadataIndex) -> Tensor:
        value = self.state_dict.get(index.fqn)
        if isinstance(value, FlatShard):
            return value.box(index.offset)
        return super().lookup_tensor(index)


def flat_boxes(shape: tuple[int, ...] | torch.Size, start: int, stop: int) -> list[tuple[list[int], list[int]]]:
    """Cut the row-major flat range ``[start, stop)`` of a tensor of ``shape`` into boxes ``(offsets, sizes)``.

    Every box is contiguous in the flat order (``sizes`` is ``[1, ..., 1, m, full, ..., full]``), in order,
    and there are at most ``2 * ndim - 1`` of them. A 0-dim tensor's element is the box ``([], [])``.
    """
    shape = list(shape)
    if start >= stop:
        return []
    if not shape:  # a 0-dim tensor: its one element is a box of no dimensions, as DCP stores it
        return [([], [])]
    if len(shape) == 1:
        return [([start], [stop - start])]
    inner = math.prod(shape[1:])
    r0, r1 = start // inner, (stop - 1) // inner
    if r0 == r1:
        return [([r0, *o], [1, *z]) for o, z in flat_boxes(shape[1:], start - r0 * inner, stop - r0 * inner)]
    boxes: list[tuple[list[int], list[int]]] = []
    first_full = r0
    if start % inner:
        boxes += [([r0, *o], [1, *z]) for o, z in flat_boxes(shape[1:], start - r0 * inner, inner)]
        first_full = r0 + 1
    end_full = r1 + 1 if stop % inner == 0 else r1
    if end_full > first_full:
        boxes.append(([first_full] + [0] * (len(shape) - 1), [end_full - first_full, *shape[1:]]))
    if stop % inner:
        boxes += [([r1, *o], [1, *z]) for o, z in flat_boxes(shape[1:], 0, stop - r1 * inner)]
    return boxes


def view_boxes(shape: tuple[int, ...] | torch.Size, start: int, local: Tensor) -> list[tuple[tuple[int, ...], Tensor]]:
    """The boxes of the flat range ``[start, start + local.numel())`` of a tensor of ``shape``, each a view of
    ``local`` (1-D, holding that range in row-major order)."""
    boxes = []
    for offsets, sizes in flat_boxes(shape, start, start + local.numel()):
        begin = flat_index(shape, offsets) - start
        boxes.append((tuple(offsets), local[begin : begin + math.prod(sizes)].view(sizes)))
    return boxes


def flat_index(shape: tuple[int, ...] | torch.Size, offsets: Any) -> int:
    """The row-major flat index of element ``offsets`` of a tensor of ``shape``."""
    index, stride = 0, 1
    for size, o in zip(reversed(list(shape)), reversed(list(offsets))):
        index += o * stride
        stride *= size
    return index
