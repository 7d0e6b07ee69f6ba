"""The only place lightning-hybrid touches private torch names (checked on torch 2.13).

Each has a fallback, so a rename in a future release costs a detail, not a crash.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["default_store", "init_optimizer_state", "mul_"]


def default_store() -> dist.Store | None:
    """The key-value store of the default process group (torch 2.13: ``distributed_c10d._get_default_store``),
    or ``None`` when there is none or torch no longer offers it."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except Exception:  # a missing store only costs the caller a detail
        return None


def mul_(tensors: list[Tensor], factor: float) -> None:
    """Multiply every tensor in place by ``factor``: one fused kernel per device where torch offers it
    (torch 2.13: ``torch._foreach_mul_``), else one multiply per tensor."""
    foreach = getattr(torch, "_foreach_mul_", None)
    if foreach is not None:
        foreach(tensors, factor)
        return
    for t in tensors:
        t.mul_(factor)


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create ``optimizer``'s state as its first step would, without changing a parameter (a step with zero
    gradients at LR 0; torch 2.13: ``checkpoint.state_dict._init_optim_state``, what DCP does before it loads
    optimizer state). A no-op when the state exists or some parameter has a gradient."""
    from torch.distributed.checkpoint import state_dict as dcp_state_dict

    init = getattr(dcp_state_dict, "_init_optim_state", None)
    if init is not None:
        init(optimizer)
        return
    if optimizer.state or any(p.grad is not None for g in optimizer.param_groups for p in g["params"]):
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
    optimizer.zero_grad(set_to_none=True)
