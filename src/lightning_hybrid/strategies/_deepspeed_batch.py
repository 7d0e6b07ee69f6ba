"""How DeepSpeedPipelineStrategy hands a Lightning batch to DeepSpeed's engine: micro-batches and blocks."""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

__all__ = ["batch_size", "shapes", "split", "unpacking"]


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
