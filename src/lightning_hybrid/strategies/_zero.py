"""ZeRO-1 / ZeRO-2 for plain (replicated) parameters: optimizer state sharded over the data-parallel group.

Each parameter group of the user's optimizer is flattened into one buffer, padded to a multiple of the
data-parallel size; rank ``r`` owns the contiguous slice ``r``. The optimizer object keeps its identity (LR
schedulers and Lightning hold references to it) but its groups then hold a single shard parameter, so
optimizer state is allocated for ``1/N`` of the parameters (ZeRO-1). With ZeRO-2 the gradients are
reduce-scattered instead of all-reduced and the full gradients are freed before the step.

This is exact only for element-wise optimizers (SGD, Adam, AdamW, RMSprop, Adagrad, ...): an optimizer
that takes per-tensor norms (LAMB, Adafactor) would see a shard instead of a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = ["FlatShardedOptimizer"]


@dataclass
class _FlatGroup:
    params: list[nn.Parameter]
    names: list[str]
    offsets: list[int]
    flat: Tensor  # the parameters' storage, padded to a multiple of the group size
    shard: nn.Parameter  # this rank's slice of `flat`

    @property
    def padded_numel(self) -> int:
        return self.flat.numel()

    @property
    def shard_numel(self) -> int:
        return self.shard.numel()


class FlatShardedOptimizer:
    """Owns the sharding of one optimizer; the strategy calls it around Lightning's optimizer step."""

    def __init__(
        self, optimizer: Optimizer, *, names: dict[Tensor, str], group: dist.ProcessGroup, zero_stage: int
    ) -> None:
        if zero_stage not in (1, 2):
            raise ValueError(f"FlatShardedOptimizer implements zero_stage 1 and 2, got {zero_stage}")
        if optimizer.state:
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
            flat = self._flatten([p.detach() for p in params], padded, params)
            # the parameters become views of one flat buffer and the shard is a view of that buffer too:
            # the optimizer updates the model's own memory, no second copy of the weights exists
            for p, off in zip(params, offsets):
                p.data = flat[off : off + p.numel()].view_as(p)
            shard = nn.Parameter(flat[self.rank * shard_numel : (self.rank + 1) * shard_numel])
            self.groups.append(_FlatGroup(params, [names[p] for p in params], offsets, flat, shard))
            pg["params"] = [shard]

    @staticmethod
    def _flatten(tensors: list[Tensor | None], padded: int, like: list[Tensor]) -> Tensor:
        ref = like[0] if like else torch.empty(0)
        out = torch.zeros(padded, dtype=ref.dtype, device=ref.device)
        offset = 0
        for t, p in zip(tensors, like):
            if t is not None:
                out[offset : offset + p.numel()].copy_(t.reshape(-1))
            offset += p.numel()
        return out

    def _shard_slice(self, g: _FlatGroup) -> slice:
        return slice(self.rank * g.shard_numel, (self.rank + 1) * g.shard_numel)

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Average the model's gradients over the group into each rank's shard (one collective per group)."""
        for g in self.groups:
            flat = self._flatten([p.grad for p in g.params], g.padded_numel, g.params)
            if self.zero_stage == 1:
                dist.all_reduce(flat, group=self.group)
                flat.div_(self.world)
                # ZeRO-1 keeps the full averaged gradient (views into one buffer) for hooks and callbacks
                for p, off in zip(g.params, g.offsets):
                    p.grad = flat[off : off + p.numel()].view_as(p)
                g.shard.grad = flat[self._shard_slice(g)]
            else:
                out = torch.empty(g.shard_numel, dtype=flat.dtype, device=flat.device)
                dist.reduce_scatter_single(out, flat, group=self.group)
                g.shard.grad = out.div_(self.world)
                for p in g.params:
                    p.grad = None  # ZeRO-2: the full gradient is gone before the step

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """Write every rank's updated shard back into the full parameters (one all-gather per group)."""
        for g in self.groups:
            # the input may not alias the output: send a copy of the shard (1/N of the group, transient)
            dist.all_gather_single(g.flat, g.shard.detach().clone(), group=self.group)
            for p in g.params:
                p.grad = None
            g.shard.grad = None

    @torch.no_grad()
    def load_parameters_into_shards(self) -> None:
        """Make sure the (just loaded) parameters still live in the flat buffer the shards view."""
        for g in self.groups:
            for p, off in zip(g.params, g.offsets):
                if p.data_ptr() != g.flat[off:].data_ptr():  # a loader replaced the storage: copy back in
                    g.flat[off : off + p.numel()].copy_(p.detach().reshape(-1))
                    p.data = g.flat[off : off + p.numel()].view_as(p)

    def grad_tensors(self) -> list[Tensor]:
        return [g.shard.grad for g in self.groups if g.shard.grad is not None]

    # --------------------------------------------------------------------------- layout-free state dict

    @torch.no_grad()
    def flat_state_dict(self) -> dict[str, Any]:
        """The optimizer state in torch DCP's flattened, name-keyed form (``state.<fqn>.<key>``,
        ``param_groups.<fqn>.<key>``): the same form ``get_optimizer_state_dict(...,
        flatten_optimizer_state_dict=True)`` gives for unsharded and FSDP optimizers, so a checkpoint does
        not depend on the ZeRO stage it was written with. Collective: every rank of the group calls it."""
        out: dict[str, Any] = {}
        for pg, g in zip(self.optimizer.param_groups, self.groups):
            state = self.optimizer.state.get(g.shard, {})
            for key in sorted(state):
                value = state[key]
                if isinstance(value, Tensor) and value.numel() == g.shard_numel and value.dim() == 1:
                    full = torch.empty(g.padded_numel, dtype=value.dtype, device=value.device)
                    dist.all_gather_single(full, value.contiguous(), group=self.group)
                    for p, name, off in zip(g.params, g.names, g.offsets):
                        out[f"state.{name}.{key}"] = full[off : off + p.numel()].view_as(p).clone()
                else:  # per-group scalars (Adam's `step`) are the same for every parameter
                    for name in g.names:
                        out[f"state.{name}.{key}"] = value.clone() if isinstance(value, Tensor) else value
            for key, value in pg.items():
                if key != "params":
                    for name in g.names:
                        out[f"param_groups.{name}.{key}"] = value
        return out

    @torch.no_grad()
    def load_flat_state_dict(self, flat: dict[str, Any]) -> None:
        """Inverse of :meth:`flat_state_dict`; each rank keeps its own slice (no communication)."""
        for pg, g in zip(self.optimizer.param_groups, self.groups):
            first = g.names[0]
            prefix = f"param_groups.{first}."
            for key, value in flat.items():
                if key.startswith(prefix):
                    pg[key[len(prefix) :]] = value
            state_keys = {k[len(f"state.{first}.") :] for k in flat if k.startswith(f"state.{first}.")}
            state: dict[str, Any] = {}
            for key in state_keys:
                value = flat[f"state.{first}.{key}"]
                if isinstance(value, Tensor) and value.shape == g.params[0].shape and value.dim() > 0:
                    full = self._flatten(
                        [flat[f"state.{name}.{key}"].to(g.shard.device) for name in g.names],
                        g.padded_numel,
                        g.params,
                    ).to(value.dtype)
                    state[key] = full[self._shard_slice(g)].clone()
                else:
                    state[key] = value.clone() if isinstance(value, Tensor) else value
            self.optimizer.state[g.shard] = state
