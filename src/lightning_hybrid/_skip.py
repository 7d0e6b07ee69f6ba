"""Skipped optimizer steps must not advance step-interval LR schedulers.

Lightning steps every ``interval="step"`` scheduler after each optimizer step, whether or not the
optimizer changed anything. Whoever skips a step (the loss-scaling plugin on overflow, the checkpoint
callback's ``nan_policy="skip"``) registers a predicate here; the scheduler's ``step()`` is then a no-op
right after a step any of them skipped, so the schedule follows the updates actually applied.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl

__all__ = ["SkipAwareScheduler", "skip_schedulers_when"]


class SkipAwareScheduler:
    """Forwards everything to an LR scheduler, except ``step()`` right after a skipped optimizer step."""

    def __init__(self, scheduler: Any) -> None:
        self.__dict__["_scheduler"] = scheduler
        self.__dict__["_skipped"] = []

    def step(self, *args: Any, **kwargs: Any) -> None:
        if any(skipped() for skipped in self._skipped):
            return
        self._scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scheduler, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._scheduler, name, value)


def skip_schedulers_when(trainer: pl.Trainer, skipped: Callable[[], bool]) -> None:
    """Make every step-interval scheduler of ``trainer`` skip its ``step()`` while ``skipped()`` is true."""
    for config in trainer.lr_scheduler_configs:
        if config.interval != "step":
            continue
        if not isinstance(config.scheduler, SkipAwareScheduler):
            config.scheduler = SkipAwareScheduler(config.scheduler)
        if skipped not in config.scheduler._skipped:
            config.scheduler._skipped.append(skipped)
