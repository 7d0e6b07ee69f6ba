"""The flat sharded optimizer's state dict in the layout-free form checkpoints carry: per parameter, by name.

Each chunk of a flat shard lies in one parameter, so the optimizer state is read and written per parameter
(parameter_state_dict, flat_state_dict) and a checkpoint loads into any other layout; per-element
state travels as flat ranges (FlatShard), per-parameter scalars (e.g. Adam's step) whole."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from lightning_hybrid.checkpoint._flat_shards import FlatShard, flat_index, view_boxes
from lightning_hybrid.checkpoint._sharded import GROUP_INDEX
from lightning_hybrid.strategies.tensor.local import local_boxes, local_part, whole_boxes, whole_shape

if TYPE_CHECKING:
    from lightning_hybrid.strategies.zero.flat_optimizer import _Chunk

__all__ = ["FlatStateDict"]


class FlatStateDict:
    """FlatShardedOptimizer's state dict in the layout-free form checkpoints carry (uses its groups)."""

    @torch.no_grad()
    def flat_state_dict(self) -> dict[str, Any]:
        """The optimizer state in torch DCP's flattened, name-keyed form (``state.<fqn>.<key>``,
        ``param_groups.<fqn>.<key>``): the same form ``get_optimizer_state_dict(...,
        flatten_optimizer_state_dict=True)`` gives for unsharded and FSDP optimizers, so a checkpoint does
        not depend on the ZeRO stage it was written with.

        A per-element state (Adam's moments) of a parameter is a :class:`FlatShard` of the parameter's shape
        whose boxes are views of this rank's chunks: no communication, no copy, and DCP writes each rank's
        part from that rank (and reshards it into any other layout on load). A parameter's scalars (its
        ``step``) come from any of its chunks; a parameter never stepped has no state, as in one process."""
        out: dict[str, Any] = {}
        state = self.optimizer.state
        for g in self.groups:
            base = self.rank * g.shard_numel
            for i, (p, name, off) in enumerate(zip(g.params, g.names, g.offsets)):
                mine = [c for c in g.chunks if c.index == i and state.get(c.tensor)]
                for key in sorted({k for c in mine for k in state[c.tensor]}):
                    first = state[mine[0].tensor][key]
                    if _per_element(first, mine[0]):
                        boxes = []
                        for c in mine:
                            boxes += view_boxes(p.shape, base + c.start - off, state[c.tensor][key].reshape(-1))
                        out[f"state.{name}.{key}"] = _whole_shard(p, first.dtype, boxes)
                    else:
                        out[f"state.{name}.{key}"] = first.clone() if isinstance(first, Tensor) else first
            for key, value in g.settings.items():
                if key not in ("params", "param_names"):
                    for name in g.names:
                        out[f"param_groups.{name}.{key}"] = value
        return out

    def parameter_state_dict(self) -> dict[str, FlatShard]:
        """The parameters, as FlatShards whose boxes are views of this rank's slice: the replicas then write
        (and stage for a background save) a disjoint part each instead of all of it."""
        out: dict[str, FlatShard] = {}
        for g in self.groups:
            base = self.rank * g.shard_numel
            local = g.shard.detach()
            for p, name, off in zip(g.params, g.names, g.offsets):
                lo, hi = max(off, base), min(off + p.numel(), base + g.shard_numel)
                boxes = view_boxes(p.shape, lo - off, local[lo - base : hi - base]) if lo < hi else []
                out[name] = _whole_shard(p, p.dtype, boxes)
        return out

    def state_template(self, name: str, shape: torch.Size, dtype: torch.dtype, key: str = "") -> FlatShard | None:
        """An empty FlatShard for the per-element state ``key`` of parameter ``name`` (this rank's part only),
        or None if ``shape`` is not the parameter's (then the value is not per-element). The parameters of a
        group share one shard-sized buffer per state key (their boxes do not overlap), so loading holds the
        state once, not once per parameter."""
        if name not in self._where:
            return None
        g, i = self._where[name]
        p, off = g.params[i], g.offsets[i]
        if tuple(shape) != tuple(whole_shape(p)):  # the unsplit shape, as checkpoints hold it
            return None
        slot = (id(g), key, dtype)
        local = self._templates.get(slot)
        if local is None:
            local = torch.zeros(g.shard_numel, dtype=dtype, device=g.shard.device)
            self._templates[slot] = local
        base = self.rank * g.shard_numel
        lo, hi = max(off, base), min(off + p.numel(), base + g.shard_numel)
        boxes = view_boxes(p.shape, lo - off, local[lo - base : hi - base]) if lo < hi else []
        return _whole_shard(p, dtype, boxes)

    @torch.no_grad()
    def load_flat_state_dict(self, flat: dict[str, Any]) -> None:
        """Inverse of :meth:`flat_state_dict`; each rank keeps its own slice (no communication). Values may be
        this rank's :class:`FlatShard` parts (see :meth:`state_template`; a chunk's state is then a view of the
        shared loading buffer, so the state is held once) or full tensors. The state is taken per parameter:
        a parameter the checkpoint holds no state for starts fresh, as it would in one process."""
        by_name: dict[str, dict[str, dict[str, Any]]] = {"state": {}, "param_groups": {}}
        for k, v in flat.items():
            section, _, rest = k.partition(".")
            name, _, key = rest.rpartition(".")
            if section in by_name:
                by_name[section].setdefault(name, {})[key] = v
        scalar_keys = self._scalar_keys(by_name["state"])
        for g in self.groups:
            # the group's settings, from any of its parameters the checkpoint knows
            found = next((by_name["param_groups"][n] for n in g.names if n in by_name["param_groups"]), None)
            if found:
                g.settings.update({k: v for k, v in found.items() if k != GROUP_INDEX})
            base = self.rank * g.shard_numel
            for i, (p, name, off) in enumerate(zip(g.params, g.names, g.offsets)):
                entries = by_name["state"].get(name, {})
                for c in (c for c in g.chunks if c.index == i):
                    state: dict[str, Any] = {}
                    for key, value in entries.items():
                        shaped = isinstance(value, (Tensor, FlatShard)) and tuple(value.shape) == tuple(whole_shape(p))
                        if shaped and (p.dim() > 0 or key not in scalar_keys):  # per element
                            buffer = self._templates.get((id(g), f"state.{key}", value.dtype))
                            if isinstance(value, FlatShard) and buffer is not None:
                                state[key] = buffer[c.start : c.stop]  # read there in place
                            else:
                                state[key] = _piece(value, p, base + c.start - off, c.stop - c.start)
                        elif isinstance(value, FlatShard):  # a 0-dim parameter's scalar, read as a box
                            state[key] = _placed(key, value.boxes[0][1], c.tensor, g.settings) if value.boxes else value
                        else:
                            state[key] = _placed(key, value, c.tensor, g.settings)
                    if state:
                        self.optimizer.state[c.tensor] = state
                    else:
                        self.optimizer.state.pop(c.tensor, None)
        self._templates.clear()

    def _scalar_keys(self, states: dict[str, dict[str, Any]]) -> set[str]:
        """State keys that are scalars per parameter (Adam's ``step``), told apart by the parameters that are
        not 0-dim (for a 0-dim parameter, a moment and the step have the same shape)."""
        keys: set[str] = set()
        for name, entries in states.items():
            where = self._where.get(name)
            if where is None or where[0].params[where[1]].dim() == 0:
                continue
            shape = tuple(whole_shape(where[0].params[where[1]]))
            keys.update(
                k for k, v in entries.items() if not isinstance(v, (Tensor, FlatShard)) or tuple(v.shape) != shape
            )
        return keys or {"step"}


def _placed(key: str, value: Any, param: Tensor, group: dict[str, Any]) -> Any:
    """A loaded scalar state where the optimizer keeps it (torch's own rule in ``Optimizer.load_state_dict``):
    ``step`` on the host unless the group is ``capturable`` or ``fused`` (then float32 on the device), other
    tensors on the parameter's device."""
    if not isinstance(value, Tensor):
        return value
    if key == "step":
        if group.get("capturable") or group.get("fused"):
            return value.to(dtype=torch.float32, device=param.device)
        return value.clone()
    dtype = param.dtype if value.is_floating_point() else value.dtype
    return value.to(device=param.device, dtype=dtype, copy=True)


def _per_element(value: Any, chunk: _Chunk) -> bool:
    return isinstance(value, Tensor) and value.dim() == 1 and value.numel() == chunk.stop - chunk.start


def _piece(value: Any, p: Tensor, start: int, numel: int) -> Tensor:
    """Elements ``start:start+numel`` (row-major) of a per-element value of parameter ``p``: a full tensor
    or this rank's FlatShard boxes. A fresh tensor, the chunk's own."""
    if isinstance(value, FlatShard):
        out = torch.empty(numel, dtype=value.dtype)
        stop = start + numel
        for offsets, box in local_boxes(p, value.boxes):
            lo = flat_index(p.shape, offsets)
            hi = lo + box.numel()
            a, b = max(lo, start), min(hi, stop)
            if a < b:
                out[a - start : b - start].copy_(box.reshape(-1)[a - lo : b - lo])
        return out.to(p.device)
    return local_part(p, value).reshape(-1)[start : start + numel].clone().to(p.device)


def _whole_shard(param: Tensor, dtype: torch.dtype, boxes: list[tuple[tuple[int, ...], Tensor]]) -> FlatShard:
    """A FlatShard of ``param``'s boxes, in the unsplit tensor's shape and offsets (tensor parallelism)."""
    shape, boxes = whole_boxes(param, boxes)
    return FlatShard(shape, dtype, boxes)
