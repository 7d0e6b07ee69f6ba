"""How DeepSpeedPipelineStrategy hands a Lightning batch to DeepSpeed's engine: micro-batches and blocks."""

from __future__ import annotations

from typing import Any, Union

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_hybrid._agree import agree

__all__ = ["batch_size", "loader_micro_batch", "micro_batches", "shapes", "split", "unpacking"]


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


def split(value: Any, parts: int) -> list[Any]:
    if isinstance(value, Tensor):
        return list(value.chunk(parts))
    if isinstance(value, (tuple, list)):
        return [tuple(items) for items in zip(*(split(v, parts) for v in value))]
    raise TypeError(f"pipeline inputs and targets must be tensors or tuples of tensors, got {type(value).__name__}")


def batch_size(value: Any) -> int:
    return value.shape[0] if isinstance(value, Tensor) else batch_size(value[0])


def shapes(value: Any) -> Any:
    if isinstance(value, Tensor):
        return (tuple(value.shape), value.dtype)
    return tuple(shapes(v) for v in value)


def loader_micro_batch(trainer: pl.Trainer, configured: Union[int, None], num_microbatches: int) -> int:
    """The training DataLoader's batch size / ``num_microbatches`` (the config's value, or 1, when the loader
    does not say it before training; every batch is checked again by :func:`micro_batches`)."""
    source = trainer.fit_loop._data_source  # what Lightning itself reads the batch size from for DeepSpeed
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


def micro_batches(module: nn.Module, batch: Any, num_microbatches: int, device: torch.device) -> list[tuple[Any, Any]]:
    """``batch`` as the pipeline contract reads it (``pipeline_batch``, else ``(batch[0], batch[1])``), cut
    into ``num_microbatches`` equal ``(inputs, target)`` pairs; the same batch size on every rank, checked."""
    fn = getattr(module, "pipeline_batch", None)  # optional in the contract
    inputs, target = fn(batch) if callable(fn) else (batch[0], batch[1])
    size = batch_size(inputs)
    low, high = agree([-size, size], op="max", device=device)
    if -low != high:
        raise ValueError(
            f"the ranks got batches of {-low:.0f} to {high:.0f} samples; the data-parallel mean weighs every"
            " replica's batch equally, so every rank needs the same batch size (drop_last=True, or a batch size"
            " that divides the data on every rank, validation included)."
        )
    if size % num_microbatches:
        raise ValueError(
            f"a batch of {size} samples cannot be cut into num_microbatches={num_microbatches} equal micro-batches;"
            " use a batch size divisible by it (and drop_last=True if the last batch is shorter)."
        )
    return list(zip(split(inputs, num_microbatches), split(target, num_microbatches)))
