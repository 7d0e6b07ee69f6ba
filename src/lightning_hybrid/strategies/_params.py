"""What the user set on a parameter, kept across the set-up steps that replace parameter objects.

Torch's tensor-parallel styles (``parallelize_module``) and FSDP2 (``fully_shard``) put new parameters where
the module's were; attributes set on the old ones before set-up (a no-decay mark read in
``configure_optimizers``, transformers' ``_is_hf_initialized``) would silently be gone. Each such step runs
inside :func:`attributes_kept`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn

from lightning_hybrid._torch_compat import PARAMETER_ATTRIBUTES_OF_TORCH

__all__ = ["attributes_kept", "user_attributes"]


def user_attributes(p: nn.Parameter) -> dict[str, object]:
    """What was set on ``p`` as attributes, less what torch sets itself."""
    return {k: v for k, v in vars(p).items() if k not in PARAMETER_ATTRIBUTES_OF_TORCH}


@contextlib.contextmanager
def attributes_kept(module: nn.Module) -> Iterator[None]:
    """Each parameter of ``module`` after the block carries the attributes the one under its name had before."""
    kept = {name: user_attributes(p) for name, p in module.named_parameters(remove_duplicate=False) if vars(p)}
    yield
    for name, p in module.named_parameters(remove_duplicate=False):
        for key, value in kept.get(name, {}).items():
            setattr(p, key, value)
