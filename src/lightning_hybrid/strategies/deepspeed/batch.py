"""How DeepSpeedPipelineStrategy hands a Lightning batch to DeepSpeed's engine: micro-batches and blocks."""

from __future__ import annotations

from typing import Any, Union

import lightning.pytorch as pl
from torch import Tensor, nn

from lightning_hybrid._lightning_compat import fit_data_source

__all__ = ["loader_micro_batch", "shapes", "unpacking"]


def unpacking(block: nn.Module) -> nn.Module:
    """``block`` as DeepSpeed calls it (one argument, a tuple when the previous block returned one), under the
    block's own class name (``partition_method="type:..."`` matches class names)."""
    cls = type(type(block).__name__, (_Unpack,), {})
    return cls(block)


class _Unpack(nn.Module):
    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: Any) -> Any:
        return self.block(*x) if isinstance(x, tuple) else self.block(x)


def shapes(value: Any) -> Any:
    if isinstance(value, Tensor):
        return (tuple(value.shape), value.dtype)
    return tuple(shapes(v) for v in value)


def loader_micro_batch(trainer: pl.Trainer, configured: Union[int, None], num_microbatches: int) -> int:
    """The training DataLoader's batch size / ``num_microbatches`` (the config's value, or 1, when the loader
    does not say it before training; every batch is checked again by :func:`micro_batches`)."""
    source = fit_data_source(trainer)  # what Lightning itself reads the batch size from for DeepSpeed
    try:
        loader = source.dataloader() if source.is_defined() else None
        batch = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    except Exception:  # a loader that cannot be built this early: the config says
        batch = None
    if batch is None:
        return int(configured or 1)
    if batch % num_microbatches:
        raise ValueError(
            f"the batch size {batch} is not divisible by num_microbatches={num_microbatches}; choose a batch size"
            " that is a multiple of it."
        )
    return batch // num_microbatches
