"""Trainable parameters that no optimizer holds (ZeRO-0/1/2).

User code updates such a parameter by hand from its gradient (a temperature, an EMA-driven gain, a
parameter stepped by a second, hand-written rule). DDP averages every parameter that requires a gradient,
in the optimizer or not; the buckets and flat buffers of ZeRO-0/1/2 hold the optimizers' parameters only,
so these are averaged here: after every backward, one all-reduce (a sum) of their gradients and of a count
of the replicas that had one, at a point every replica reaches alike. A replica without a gradient counts
as zero (DDP's ``find_unused_parameters``); one that no replica has keeps none. Nothing is sent when the
module has no such parameter (the usual case). ZeRO-3 needs none of this: FSDP2 reduces every parameter of
its units.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.optim import Optimizer

from lightning_hybrid.strategies.zero.elsewhere import is_gradient

__all__ = ["OutsideOptimizers"]


class OutsideOptimizers:
    def __init__(
        self, params: list[Tensor], optimizers: list[Optimizer], group: dist.ProcessGroup, device: torch.device
    ) -> None:
        self.params, self.optimizers, self.group, self.device = params, optimizers, group, device
        self.world = dist.get_world_size(group)
        self._held: set[int] = set()
        self._signature: tuple[int, ...] = ()

    def _outside(self) -> list[Tensor]:
        # groups change only when a callback adds one (BackboneFinetuning): the set is rebuilt then
        signature = tuple(len(g["params"]) for o in self.optimizers for g in o.param_groups)
        if signature != self._signature:
            self._signature = signature
            self._held = {id(p) for o in self.optimizers for g in o.param_groups for p in g["params"]}
        return [p for p in self.params if p.requires_grad and id(p) not in self._held]

    @torch.no_grad()
    def average(self) -> None:
        params = self._outside()
        if not params:
            return
        has = [is_gradient(p.grad) for p in params]
        parts = [p.grad.detach().reshape(-1).float() if h else p.new_zeros(p.numel(), dtype=torch.float32)
                 for p, h in zip(params, has)]  # fmt: skip
        flat = torch.cat(
            [*(t.to(self.device) for t in parts), torch.tensor(has, dtype=torch.float32, device=self.device)]
        )
        dist.all_reduce(flat, group=self.group)
        counts = flat[-len(params) :].tolist()
        offset = 0
        for p, count in zip(params, counts):
            mean = flat[offset : offset + p.numel()].div(self.world).view_as(p).to(p.device, p.dtype)
            offset += p.numel()
            p.grad = mean if count else None
