"""The only place lightning-hybrid touches private torch names (checked on torch 2.13).

Each has a fallback, so a rename in a future release costs a detail, not a crash.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["default_store", "mul_"]


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
