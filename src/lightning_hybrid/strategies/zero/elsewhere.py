"""What ``param.grad`` holds where ZeRO keeps a parameter's gradient somewhere else.

Under ZeRO-2 a gradient is handed off into its bucket during backward, and from the step's start ZeRO-1/2
keep only each rank's shard of the reduced gradient: no rank holds ``param.grad`` as one process would.
``None`` there would read as "no gradient" (a norm logger logs nothing, a guarded edit does nothing, in
silence). Where user code can run (an overridden ``on_after_backward`` or ``on_before_optimizer_step``,
manual optimization), ``param.grad`` is a :class:`GradientElsewhere` instead: a tensor of the parameter's
shape and dtype with no storage, on which every operation raises with the parameter's name, where its
gradient is and what to do. It is replaced by ``None`` before the next backward, and by ``zero_grad``.
"""

from __future__ import annotations

from torch import Tensor

from lightning_hybrid._torch_compat import RaisingTensor

__all__ = ["GradientElsewhere", "is_gradient"]


class GradientElsewhere(RaisingTensor):
    """Stands in ``param.grad``; any use raises ``RuntimeError(message)``."""


def is_gradient(grad: Tensor | None) -> bool:
    """Whether ``grad`` (a ``param.grad``) holds a gradient: not ``None`` and not a placeholder."""
    return grad is not None and type(grad) is not GradientElsewhere
