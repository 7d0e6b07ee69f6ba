"""Where user code can see or change gradients between backward and the optimizer step.

The gradient synchronisation chooses how much of the gradient to make visible, and when, from this: with no
such code the replicas' gradients are reduced in the cheapest way (ZeRO-1: a reduce-scatter, each rank keeps
its shard), and nothing but the pack reads them before the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.model_helpers import is_overridden

from lightning_hybrid._protocols import LeavesModelGradientsAlone

__all__ = ["RUN_BACKWARD_INSIDE", "UserGradientCode", "user_gradient_code"]

# what to do about a backward run in a hook, after the strategy reduced the window (its gradients would reach
# one replica only)
RUN_BACKWARD_INSIDE = "Run every backward inside training_step (return the loss, or self.manual_backward)."


@dataclass(frozen=True)
class UserGradientCode:
    after_backward: bool = False  # on_after_backward, of the module or a callback
    before_step: bool = False  # on_before_optimizer_step or configure_gradient_clipping
    manual: bool = False  # manual optimization: training_step runs backward and the step itself

    @property
    def reads_after_backward(self) -> bool:
        """User code runs between a backward and the step that reduces it."""
        return self.after_backward or self.manual

    @property
    def reads_at_step(self) -> bool:
        """User code runs between the reduction and the optimizer's update."""
        return self.before_step or self.manual


def user_gradient_code(trainer: pl.Trainer, module: pl.LightningModule) -> UserGradientCode:
    # the pack's own callbacks read gradients through the strategy and the optimizer's groups only
    callbacks: list[Any] = [c for c in trainer.callbacks if not isinstance(c, LeavesModelGradientsAlone)]

    def overridden(hook: str) -> bool:
        return is_overridden(hook, module) or any(is_overridden(hook, c, pl.Callback) for c in callbacks)

    return UserGradientCode(
        after_backward=overridden("on_after_backward"),
        before_step=overridden("on_before_optimizer_step") or is_overridden("configure_gradient_clipping", module),
        manual=not module.automatic_optimization,
    )
