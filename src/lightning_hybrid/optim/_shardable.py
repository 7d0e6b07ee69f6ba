"""Which optimizers stay exact when ZeRO shards what they step.

ZeRO-1/2 step chunks of a flat buffer (a tensor's elements split between ranks at any offset), and ZeRO-3
steps each tensor's row shard. Only an
optimizer whose update of an element depends on that element alone (its gradient, its state, scalars such as
the step count and the learning rate) computes the same thing on a slice. Everything else is refused at
set-up, by name, with what to use instead: never silently different numbers.
"""

from __future__ import annotations

import inspect

import torch
from torch.optim import Optimizer

__all__ = ["check_shardable", "is_elementwise", "register_elementwise"]

# torch's optimizers whose update is element-wise (the step count and group scalars aside)
_ELEMENTWISE: set[type[Optimizer]] = {
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
    torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.Rprop,
    torch.optim.ASGD,
}  # fmt: skip

# why the well-known others are not
_WHY = {
    "Adafactor": "it factors the second moment over each matrix's rows and columns",
    "LBFGS": "it takes the whole parameter vector (and a closure of several evaluations)",
    "SparseAdam": "it needs sparse gradients",
    "Muon": "it orthogonalises each whole matrix update",
}


def register_elementwise(cls: type[Optimizer]) -> type[Optimizer]:
    """Declare an optimizer class element-wise (each element's update depends on that element alone), so
    ZeRO-1/2/3 may step it on shards. Usable as a class decorator."""
    if not (isinstance(cls, type) and issubclass(cls, Optimizer)):
        raise TypeError(f"register_elementwise takes a torch.optim.Optimizer subclass, got {cls!r}")
    _ELEMENTWISE.add(cls)
    return cls


def _elementwise(cls: type[Optimizer]) -> bool:
    # a registered class, or a subclass that keeps such a class's step (e.g. one that only adds a method);
    # torch wraps `step` on the first instance of each class, so the functions are compared unwrapped
    for base in cls.__mro__:
        if base in _ELEMENTWISE:
            return base is cls or inspect.unwrap(cls.step) is inspect.unwrap(base.step)
    return False


def is_elementwise(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` is known to update each element from that element alone."""
    return _elementwise(type(optimizer))


def check_shardable(optimizer: Optimizer, zero_stage: int, *, tensor_parallel: bool = False) -> None:
    """Raise ``ValueError`` unless ``optimizer`` steps exactly the same under ``zero_stage``'s sharding (and, with
    ``tensor_parallel``, on each rank's slices of the split tensors, whatever the stage)."""
    if zero_stage == 0 and not tensor_parallel:
        return
    from lightning_hybrid.optim.layerwise import LayerwiseOptimizer

    cls = type(optimizer)
    if isinstance(optimizer, LayerwiseOptimizer) or _elementwise(cls):
        return
    why = _WHY.get(cls.__name__, "its update may depend on a whole tensor (a norm, a factorisation)")
    where = f"zero_stage={zero_stage}" if zero_stage else "tensor parallelism"
    raise ValueError(
        f"{cls.__module__}.{cls.__qualname__} is not known to be element-wise ({why}), so {where}"
        " would step it on a slice of each tensor and compute something else. Use zero_stage=0 without tensor"
        " parallelism, an element-wise"
        " optimizer (SGD, Adam, AdamW, RMSprop, ...), lightning_hybrid.optim.LAMB or LARS for per-tensor trust"
        f" ratios, or, if every element's update depends on that element alone, declare it with"
        f" lightning_hybrid.optim.register_elementwise({cls.__name__})."
    )
