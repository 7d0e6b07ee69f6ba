"""Where the tensor a rank holds lies in the whole (unsplit) tensor: the record tensor parallelism leaves on
each parameter it holds as a local slice, and the box any held tensor (a slice, a DTensor shard) covers.

Checkpoints and pretrained-weight reads speak of whole tensors; a rank reads and writes only its box of each.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Shard

from lightning_hybrid._torch_compat import dtensor_offsets

__all__ = ["Box", "TensorSlice", "held_box", "mark_slice", "tensor_slice"]

Box = tuple[tuple[int, int], ...]  # per dimension (start, stop) in the whole tensor
_ATTRIBUTE = "lightning_hybrid_tensor_slice"  # set on each parameter held as a tensor-parallel slice


@dataclass(frozen=True)
class TensorSlice:
    """Where a rank's local parameter lies in the whole tensor: torch's placements on the tensor-parallel
    mesh, and the whole tensor's shape and stride."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    @property
    def dim(self) -> int | None:
        """The dimension the tensor is split along, or ``None`` when every rank holds all of it."""
        for placement in self.placements:
            if isinstance(placement, Shard):
                return placement.dim % len(self.shape)
        return None

    def origin(self) -> tuple[int, ...]:
        """The whole tensor's index of this rank's first element (torch's even chunks: ``ceil(n / T)``)."""
        origin = [0] * len(self.shape)
        if self.dim is not None:
            origin[self.dim] = self._range()[0]
        return tuple(origin)

    def local_shape(self) -> tuple[int, ...]:
        """The shape of this rank's slice."""
        shape = list(self.shape)
        if self.dim is not None:
            start, stop = self._range()
            shape[self.dim] = stop - start
        return tuple(shape)

    def _range(self) -> tuple[int, int]:
        n = self.shape[self.dim]
        chunk = math.ceil(n / self.mesh.size())
        start = min(chunk * self.mesh.get_local_rank(), n)
        return start, min(n, start + chunk)

    def as_dtensor(self, local: Tensor) -> DTensor:
        return DTensor.from_local(
            local, self.mesh, self.placements, run_check=False, shape=self.shape, stride=self.stride
        )


def tensor_slice(param: Tensor) -> TensorSlice | None:
    """The :class:`TensorSlice` of a parameter held as a tensor-parallel slice, ``None`` for any other."""
    return getattr(param, _ATTRIBUTE, None)


def mark_slice(param: Tensor, found: TensorSlice) -> None:
    setattr(param, _ATTRIBUTE, found)


def held_box(tensor: Tensor) -> tuple[Tensor, Box | None]:
    """``(the local tensor to read into, its box in the whole tensor)``; the box is ``None`` when this rank
    holds the whole tensor."""
    found = tensor_slice(tensor)
    if found is not None:
        if found.dim is None:
            return tensor, None
        return tensor, tuple((o, o + n) for o, n in zip(found.origin(), tensor.shape))
    if isinstance(tensor, DTensor):
        local = tensor.to_local()
        if all(p.is_replicate() for p in tensor.placements):
            return local, None
        offsets = dtensor_offsets(tensor)
        return local, tuple((o, o + n) for o, n in zip(offsets, local.shape))
    return tensor, None
