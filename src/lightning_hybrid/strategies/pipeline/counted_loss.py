"""Losses that are a mean over a variable count: the global batch's mean, exactly, under any split.

A padded language-model batch's loss is a mean over its real tokens (``ignore_index``), a masked model's
over its masked positions. When a batch is cut into micro-batches, replicas and accumulation windows, the
mean of the parts' means weighs a micro-batch with 3 real tokens as much as one with 300: not what one
process computes on the whole batch (the trap of torchtitan #2972 and Lightning #20350).

A module that says what its mean is over (``pipeline_loss_count(target)``, the number of elements
``pipeline_loss`` averages) gets the exact mean over the accumulation window's elements on every rank:

- each backward unit's mean loss is weighted by ``count / reference`` instead of divided by the number of
  micro-batches and windows (``reference``: an agreed typical count, so gradients keep the scale of a mean);
- the counts of the window are summed over every replica (the pipeline's loss all-reduce carries them; no
  pipeline: one scalar all-reduce when the window closes);
- once the data-parallel reduction has averaged the gradients over ``replicas``, they are multiplied by
  ``replicas * reference / window_count``: the gradient of the window's sum over its elements, divided by
  their number, exactly the one-process gradient.

The loss the strategy reports is the count-weighted mean as well.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["CountedLoss", "counted_loss"]


class CountedLoss:
    """The weights and the window correction of a counted mean (see the module docstring)."""

    def __init__(self, count: Callable[[Any], Any], *, device: torch.device) -> None:
        self._count = count
        self.device = device
        self.reference: float | None = None  # the typical count of one backward unit, agreed on every rank
        self.window = 0.0  # elements counted so far in the accumulation window (see ``global_window``)

    def count(self, target: Any) -> float:
        n = self._count(target)
        n = float(n.item() if isinstance(n, Tensor) else n)
        if not n >= 0 or n != n:
            raise ValueError(f"pipeline_loss_count returned {n}; it must be the number of elements the loss averages")
        return n

    def agree_reference(self, local: float, units: int, group: dist.ProcessGroup | None) -> None:
        """Fix ``reference`` once, from the counts of the first batch (``local`` on this rank, ``units`` backward
        units of it over ``group``): one all-reduce, on the first batch only."""
        if self.reference is not None:
            return
        total = torch.tensor([local], dtype=torch.float64, device=_comm(self.device, group))
        if dist.is_initialized():
            dist.all_reduce(total, group=group)
        self.reference = max(float(total) / max(units, 1), 1.0)

    def weight(self, n: float) -> float:
        assert self.reference is not None
        return n / self.reference

    def factor(self, replicas: int, *, window: float) -> float:
        """What the replicas' mean gradient of the window is multiplied by; ``window``: the window's elements,
        counted over every replica. A window without a counted element keeps a zero gradient."""
        assert self.reference is not None
        return replicas * self.reference / window if window > 0 else 0.0

    def global_window(self, group: dist.ProcessGroup | None) -> float:
        """This rank's window count summed over ``group`` (one scalar all-reduce), then reset."""
        total = torch.tensor([self.window], dtype=torch.float64, device=_comm(self.device, group))
        if dist.is_initialized():
            dist.all_reduce(total, group=group)
        self.window = 0.0
        return float(total)


def counted_loss(module: nn.Module, device: torch.device) -> CountedLoss | None:
    """A :class:`CountedLoss` for a module that defines ``pipeline_loss_count``, else ``None`` (plain means)."""
    fn = getattr(module, "pipeline_loss_count", None)  # optional in the pipeline contract
    return CountedLoss(fn, device=device) if callable(fn) else None


def weighted(loss: Tensor, weight: float) -> Tensor:
    """``loss`` as a value, ``weight * loss`` for backward."""
    return loss * weight - (loss * (weight - 1.0)).detach()


def _comm(device: torch.device, group: dist.ProcessGroup | None) -> torch.device:
    if dist.is_initialized() and str(dist.get_backend(group)) == "gloo":
        return torch.device("cpu")
    return device
