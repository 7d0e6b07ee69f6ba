"""Module buffers (BatchNorm's running statistics) kept as Lightning's DDP keeps them: those of the first
data-parallel replica, on every replica.

DDP broadcasts the buffers from rank 0 before every forward, so rank 0's running statistics are the
model's, and every replica evaluates and checkpoints with them. Here they are broadcast once per optimizer
step (after it): the same values wherever a forward, an evaluation or a checkpoint can see them, since a
training-mode forward reads batch statistics only. One broadcast per dtype of the persistent buffers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

__all__ = ["ReplicaBuffers", "make_replicas_identical"]


@torch.no_grad()
def make_replicas_identical(
    module: nn.Module, group: dist.ProcessGroup, skip: Callable[[Tensor], bool] | None = None
) -> None:
    """Every replica starts from the first one's parameters and buffers, as Lightning's DDP makes them when it
    wraps the model: without a shared seed each replica would otherwise initialise its own weights, train
    them apart (ZeRO-0) or assemble its shards from different initialisations (ZeRO-1/2/3), silently. One
    broadcast per tensor, at set-up; ``skip`` leaves tensors each rank holds its own part of (tensor-parallel
    slices)."""
    if dist.get_world_size(group) == 1:
        return
    src = dist.get_global_rank(group, 0)
    seen: set[int] = set()
    for t in [*module.parameters(), *module.buffers()]:
        # a block a meta-built model sharded as it materialised holds DTensors, initialised from an agreed seed
        if id(t) not in seen and not t.is_meta and not isinstance(t, DTensor) and not (skip and skip(t)):
            seen.add(id(t))
            data = t.data.contiguous()  # the collective needs contiguous memory (channels_last, transposes)
            dist.broadcast(data, src=src, group=group)
            if data.data_ptr() != t.data.data_ptr():
                t.data.copy_(data)


class ReplicaBuffers:
    """Broadcasts ``module``'s persistent buffers from the first rank of ``group``."""

    def __init__(self, module: nn.Module, group: dist.ProcessGroup) -> None:
        self.module, self.group = module, group
        persistent = set(module.state_dict().keys())
        self.names = [n for n, _ in module.named_buffers() if n in persistent]
        self.src = dist.get_global_rank(group, 0)

    @torch.no_grad()
    def broadcast(self) -> None:
        if not self.names or dist.get_world_size(self.group) == 1:
            return
        named = dict(self.module.named_buffers())  # looked up each time: a callback may replace a buffer
        by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
        for n in self.names:
            if n in named and named[n] is not None:
                by_kind.setdefault((named[n].dtype, named[n].device), []).append(named[n])
        for tensors in by_kind.values():
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.broadcast(flat, src=self.src, group=self.group)
            offset = 0
            for t in tensors:
                t.copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()
