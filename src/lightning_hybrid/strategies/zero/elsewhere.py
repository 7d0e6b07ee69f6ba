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

from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.utils._pytree import tree_leaves

from lightning_hybrid._torch_compat import storageless_like

__all__ = ["GradientElsewhere", "is_gradient", "placeholders", "unplace"]


class GradientElsewhere(Tensor):
    """Stands in ``param.grad``; any use raises ``RuntimeError(message)``."""

    message: str

    @staticmethod
    def __new__(cls, param: Tensor, message: str) -> GradientElsewhere:
        t = storageless_like(cls, param)
        t.message = message  # type: ignore[attr-defined]
        return t  # type: ignore[return-value]

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        message = next(a.message for a in tree_leaves((args, kwargs)) if isinstance(a, GradientElsewhere))
        raise RuntimeError(message)

    def __repr__(self) -> str:  # type: ignore[override]
        return f"GradientElsewhere({self.message})"

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise RuntimeError(self.message)


def is_gradient(grad: Tensor | None) -> bool:
    """Whether ``grad`` (a ``param.grad``) holds a gradient: not ``None`` and not a placeholder."""
    return grad is not None and type(grad) is not GradientElsewhere


def placeholders(params: Iterable[Tensor], messages: dict[int, GradientElsewhere]) -> None:
    """Put each parameter's placeholder in ``.grad`` where it holds none (cached by ``id`` in ``messages``)."""
    for p in params:
        if p.grad is None:
            p.grad = messages[id(p)]


def unplace(params: Iterable[Tensor]) -> list[Tensor]:
    """Replace placeholders by ``None``; returns the parameters whose ``.grad`` is a real tensor: a gradient
    user code assigned after the pack took the parameter's own (the caller decides what that means)."""
    assigned = []
    for p in params:
        grad = p.grad
        if grad is None:
            continue
        if type(grad) is GradientElsewhere:
            p.grad = None
        else:
            assigned.append(p)
    return assigned
