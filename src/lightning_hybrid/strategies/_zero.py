"""ZeRO-1 / ZeRO-2 for plain (replicated) parameters: optimizer state sharded over the data-parallel group.

Each parameter group of the user's optimizer is flattened into one buffer, padded to a multiple of the
data-parallel size; rank ``r`` owns the contiguous slice ``r``. The optimizer object keeps its identity (LR
schedulers and Lightning hold references to it) but its groups then hold a single shard parameter, so
optimizer state is allocated for ``1/N`` of the parameters (ZeRO-1). With ZeRO-2 the gradients are
reduce-scattered instead of all-reduced and the full gradients are freed before the step.

Element-wise optimizers (SGD, Adam, AdamW, RMSprop, Adagrad, ...) are exact on a shard; an optimizer that
needs whole-tensor norms is told which tensor each element of its chunks belongs to
(:meth:`tensor_partition`, used by ``lightning_hybrid.optim.LAMB`` / ``LARS``); any other is refused at
set-up (``lightning_hybrid.optim._shardable``).

Checkpoints keep the layout-free, name-keyed form (one entry per parameter, of the parameter's shape), but
each rank contributes only its slice: a rank's flat range of a parameter is cut into boxes (each contiguous,
so each is a view) and handed to torch DCP as a :class:`FlatShard`. Saving gathers nothing; loading into
any other layout reads, on each rank, only the boxes it owns there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_hybrid.checkpoint._flat_shards import FlatShard, flat_index, view_boxes
from lightning_hybrid.optim.layerwise import TensorPartition
from lightning_hybrid.strategies._zero_grads import BucketGradients, FlatGradients, GroupGradients, WindowGradients

__all__ = ["FlatShardedOptimizer"]

# the most elements one optimizer parameter (a chunk of a shard) holds: 8 MiB of fp32
STEP_CHUNK_NUMEL = 2**21


@dataclass
class _FlatGroup:
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    flat: Tensor  # the parameters' storage, padded to a multiple of the group size
    shard: nn.Parameter  # this rank's slice of `flat`
    grads: GroupGradients  # where the gradients live and how they reach `shard.grad`
    chunks: list[nn.Parameter]  # what the optimizer steps: views of `shard`, at most a bucket each
    slices: list[slice]  # each chunk's range of `shard`

    @property
    def padded_numel(self) -> int:
        return self.flat.numel()

    @property
    def shard_numel(self) -> int:
        return self.shard.numel()


class FlatShardedOptimizer:
    """Owns the sharding of one optimizer; the strategy calls it around Lightning's optimizer step."""

    def __init__(
        self,
        optimizer: Optimizer,
        *,
        names: dict[Tensor, str],
        group: dist.ProcessGroup,
        zero_stage: int,
        reduce_gradients: str = "every_microbatch",
        bucket_numel: int = 2**22,
    ) -> None:
        assert zero_stage in (1, 2), zero_stage  # the layout validated it
        fresh_adagrad = isinstance(optimizer, torch.optim.Adagrad) and all(
            float(s.get("step", 0)) == 0 for s in optimizer.state.values()
        )
        if fresh_adagrad:  # Adagrad creates its state in its constructor: created again below, for the chunks
            optimizer.state.clear()
        elif optimizer.state:
            raise RuntimeError("the optimizer already has state; shard it before the first step")
        self.optimizer = optimizer
        self.group = group
        self.zero_stage = zero_stage
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.groups: list[_FlatGroup] = []
        for pg in optimizer.param_groups:
            params = [p for p in pg["params"] if p.requires_grad]
            dtypes = {p.dtype for p in params}
            if len(dtypes) > 1:
                raise TypeError(f"zero_stage {zero_stage} needs one dtype per parameter group, got {dtypes}")
            offsets, total = [], 0
            for p in params:
                offsets.append(total)
                total += p.numel()
            padded = -(-max(total, 1) // self.world) * self.world
            shard_numel = padded // self.world
            # the parameters become views of one flat buffer and the shard is a view of that buffer too:
            # the optimizer updates the model's own memory, no second copy of the weights exists
            flat = self._flatten(params, offsets, padded)
            shard = nn.Parameter(flat[self.rank * shard_numel : (self.rank + 1) * shard_numel])
            # the optimizer steps the shard in chunks: an optimizer's temporaries (Adam's denominator, ...) are
            # then the size of a chunk, not of the shard
            step = min(bucket_numel, STEP_CHUNK_NUMEL)
            slices = [slice(a, min(a + step, shard_numel)) for a in range(0, shard_numel, step)]
            chunks = [nn.Parameter(shard.data[sl]) for sl in slices]
            grads = _gradients(zero_stage, reduce_gradients, params, offsets, padded, group, bucket_numel)
            self.groups.append(
                _FlatGroup(params, [names[p] for p in params], offsets, flat, shard, grads, chunks, slices)
            )
            pg["params"] = chunks
            if fresh_adagrad:
                for c in chunks:
                    optimizer.state[c] = {
                        "step": torch.zeros((), device=c.device) if pg.get("fused") else torch.tensor(0.0),
                        "sum": torch.full_like(c, pg["initial_accumulator_value"]),
                    }
        # parameter name -> (its group, the parameter, its offset in the group's flat buffer)
        self._where = {n: (g, p, off) for g in self.groups for p, n, off in zip(g.params, g.names, g.offsets)}
        self._templates: dict[tuple[int, str, torch.dtype], Tensor] = {}  # shared loading buffers

    @staticmethod
    @torch.no_grad()
    def _flatten(params: list[nn.Parameter], offsets: list[int], padded: int) -> Tensor:
        """One buffer holding every parameter; each parameter's own storage is freed as soon as it is copied
        (the buffer's untouched pages cost nothing until then), so the model is not held twice."""
        ref = params[0] if params else torch.empty(0)
        out = torch.empty(padded, dtype=ref.dtype, device=ref.device)
        end = offsets[-1] + params[-1].numel() if params else 0
        out[end:].zero_()  # the padding
        for p, off in zip(params, offsets):
            out[off : off + p.numel()].copy_(p.detach().reshape(-1))
            p.data = out[off : off + p.numel()].view_as(p)
        return out

    def _shard_slice(self, g: _FlatGroup) -> slice:
        return slice(self.rank * g.shard_numel, (self.rank + 1) * g.shard_numel)

    def tensor_partition(self) -> TensorPartition:
        """Which model tensor each element of each stepped chunk belongs to (for per-tensor norms)."""
        segments: dict[Tensor, list[tuple[int, int, int]]] = {}
        first = 0
        for g in self.groups:
            base = self.rank * g.shard_numel
            numels = [p.numel() for p in g.params]
            chunks = [(c, base + sl.start) for c, sl in zip(g.chunks, g.slices)]
            segments.update(TensorPartition.of_flat_ranges(chunks, g.offsets, numels, first))
            first += len(g.params)
        return TensorPartition(segments, first, self.group)

    def after_backward(self) -> None:
        """A backward (one micro-batch) finished: ZeRO-2 hands off what its hooks did not."""
        for g in self.groups:
            g.grads.after_backward()

    def reduce_gradients(self) -> None:
        """The window closed: each rank's shard gets its slice of the replicas' mean gradient."""
        for g in self.groups:
            g.grads.reduce(g.shard)
            grad = g.shard.grad
            for chunk, sl in zip(g.chunks, g.slices):
                chunk.grad = None if grad is None else grad[sl]

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """Write every rank's updated shard back into the full parameters (one all-gather per chunk: what is
        sent is a copy of one chunk, as an input may not alias the output)."""
        for g in self.groups:
            size = g.shard_numel
            base = self.rank * size
            for sl in g.slices:
                outputs = [g.flat[r * size + sl.start : r * size + sl.stop] for r in range(self.world)]
                dist.all_gather(outputs, g.flat[base + sl.start : base + sl.stop].clone(), group=self.group)
            g.grads.after_step(g.shard)
            for chunk in g.chunks:
                chunk.grad = None

    @property
    def averaged_every_backward(self) -> bool:
        return all(g.grads.averaged_every_backward for g in self.groups)

    def shard_gradient_parts(self, param: Tensor) -> list[Tensor]:
        """The part of ``param``'s gradient in this rank's shard (views of ``shard.grad``; empty if none)."""
        for g in self.groups:
            for p, off in zip(g.params, g.offsets):
                if p is param and g.shard.grad is not None:
                    base = self.rank * g.shard_numel
                    lo, hi = max(off, base), min(off + p.numel(), base + g.shard_numel)
                    return [g.shard.grad[lo - base : hi - base]] if lo < hi else []
        return []

    def local_gradients(self) -> list[Tensor]:
        return [t for g in self.groups for t in g.grads.local_gradients()]

    @torch.no_grad()
    def load_parameters_into_shards(self) -> None:
        """Make sure the (just loaded) parameters still live in the flat buffer the shards view."""
        for g in self.groups:
            for p, off in zip(g.params, g.offsets):
                if p.data_ptr() != g.flat[off:].data_ptr():  # a loader replaced the storage: copy back in
                    g.flat[off : off + p.numel()].copy_(p.detach().reshape(-1))
                    p.data = g.flat[off : off + p.numel()].view_as(p)

    # --------------------------------------------------------------------------- layout-free state dict

    @torch.no_grad()
    def flat_state_dict(self) -> dict[str, Any]:
        """The optimizer state in torch DCP's flattened, name-keyed form (``state.<fqn>.<key>``,
        ``param_groups.<fqn>.<key>``): the same form ``get_optimizer_state_dict(...,
        flatten_optimizer_state_dict=True)`` gives for unsharded and FSDP optimizers, so a checkpoint does
        not depend on the ZeRO stage it was written with.

        A per-element state (Adam's moments) of a parameter is a :class:`FlatShard` of the parameter's shape
        whose boxes are views of this rank's slice: no communication, no copy, and DCP writes each rank's
        part from that rank (and reshards it into any other layout on load)."""
        out: dict[str, Any] = {}
        for pg, g in zip(self.optimizer.param_groups, self.groups):
            state = self.optimizer.state.get(g.chunks[0], {})
            for key in sorted(state):
                value = state[key]
                if isinstance(value, Tensor) and value.numel() == g.chunks[0].numel() and value.dim() == 1:
                    pieces = [(sl.start, self.optimizer.state[c][key]) for c, sl in zip(g.chunks, g.slices)]
                    for p, name, off in zip(g.params, g.names, g.offsets):
                        out[f"state.{name}.{key}"] = self._sharded_view(g, p, off, pieces)
                else:  # per-group scalars (Adam's `step`) are the same for every parameter
                    for name in g.names:
                        out[f"state.{name}.{key}"] = value.clone() if isinstance(value, Tensor) else value
            for key, value in pg.items():
                if key != "params":
                    for name in g.names:
                        out[f"param_groups.{name}.{key}"] = value
        return out

    def parameter_state_dict(self) -> dict[str, FlatShard]:
        """The parameters, as FlatShards whose boxes are views of this rank's slice: the replicas then write
        (and stage for a background save) a disjoint part each instead of all of it."""
        out: dict[str, FlatShard] = {}
        for g in self.groups:
            local = g.flat[self._shard_slice(g)]
            for p, name, off in zip(g.params, g.names, g.offsets):
                out[name] = self._sharded_view(g, p, off, [(0, local.detach())])
        return out

    def state_template(self, name: str, shape: torch.Size, dtype: torch.dtype, key: str = "") -> FlatShard | None:
        """An empty FlatShard for the per-element state ``key`` of parameter ``name`` (this rank's part only),
        or None if ``shape`` is not the parameter's (then the value is not per-element). The parameters of a
        group share one shard-sized buffer per state key (their boxes do not overlap), so loading holds the
        state once, not once per parameter."""
        if name not in self._where:
            return None
        g, p, off = self._where[name]
        if tuple(shape) != tuple(p.shape) or p.dim() == 0:
            return None
        slot = (id(g), key, dtype)
        local = self._templates.get(slot)
        if local is None:
            local = torch.empty(g.shard_numel, dtype=dtype, device=g.shard.device)
            self._templates[slot] = local
        return self._sharded_view(g, p, off, [(0, local)])

    @torch.no_grad()
    def load_flat_state_dict(self, flat: dict[str, Any]) -> None:
        """Inverse of :meth:`flat_state_dict`; each rank keeps its own slice (no communication). Values may be
        this rank's :class:`FlatShard` parts (see :meth:`state_template`) or full tensors."""
        self._templates.clear()  # the values below are views of them until copied into each group's state
        for pg, g in zip(self.optimizer.param_groups, self.groups):
            first = g.names[0]
            prefix = f"param_groups.{first}."
            for key, value in flat.items():
                if key.startswith(prefix):
                    pg[key[len(prefix) :]] = value
            state_keys = {k[len(f"state.{first}.") :] for k in flat if k.startswith(f"state.{first}.")}
            states: list[dict[str, Any]] = [{} for _ in g.chunks]
            for key in state_keys:
                value = flat[f"state.{first}.{key}"]
                if isinstance(value, FlatShard) or (
                    isinstance(value, Tensor) and value.shape == g.params[0].shape and value.dim() > 0
                ):
                    local = self._local_slice(g, [flat[f"state.{name}.{key}"] for name in g.names])
                    for state, sl in zip(states, g.slices):
                        state[key] = local[sl]  # each chunk's state is a view of this rank's slice
                else:
                    for state in states:
                        state[key] = value.clone() if isinstance(value, Tensor) else value
            for chunk, state in zip(g.chunks, states):
                self.optimizer.state[chunk] = state

    def _local_slice(self, g: _FlatGroup, values: list[Any]) -> Tensor:
        """This rank's flat slice of a per-element state, from each parameter's full tensor or local boxes."""
        dtype = next(v.dtype for v in values)
        out = torch.zeros(g.shard_numel, dtype=dtype, device=g.shard.device)
        base = self.rank * g.shard_numel
        for value, p, off in zip(values, g.params, g.offsets):
            if isinstance(value, FlatShard):
                for offsets, box in value.boxes:
                    begin = off + flat_index(p.shape, offsets) - base
                    out[begin : begin + box.numel()].copy_(box.reshape(-1))
                continue
            lo, hi = max(off, base), min(off + p.numel(), base + g.shard_numel)
            if lo < hi:
                out[lo - base : hi - base].copy_(value.reshape(-1)[lo - off : hi - off])
        return out

    def _sharded_view(self, g: _FlatGroup, p: Tensor, off: int, pieces: list[tuple[int, Tensor]]) -> FlatShard:
        """Parameter ``p``'s elements (``off`` in the group's flat buffer) of this rank's slice of a flat
        per-element state, held as ``pieces`` ``(start in the slice, tensor)``, as a FlatShard of ``p``'s shape
        (boxes are views of the pieces)."""
        base = self.rank * g.shard_numel
        boxes = []
        for start, local in pieces:
            lo = max(off, base + start)
            hi = min(off + p.numel(), base + start + local.numel())
            if lo < hi:
                boxes += view_boxes(p.shape, lo - off, local[lo - base - start : hi - base - start])
        return FlatShard(torch.Size(p.shape), pieces[0][1].dtype, boxes)


def _gradients(
    zero_stage: int,
    reduce_gradients: str,
    params: list[nn.Parameter],
    offsets: list[int],
    padded: int,
    group: dist.ProcessGroup,
    bucket_numel: int,
) -> GroupGradients:
    if zero_stage == 1:
        return FlatGradients(params, offsets, padded, group=group)
    if reduce_gradients == "once_per_step":
        return WindowGradients(params, offsets, padded, group=group)
    return BucketGradients(params, offsets, padded, group=group, bucket_numel=bucket_numel)
