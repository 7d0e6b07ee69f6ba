"""One gradient synchronisation per ZeRO stage, picked by :func:`gradient_sync`: ZeRO-0 replicated
(all-reduce), ZeRO-1/2 into flat shards, ZeRO-3 fully sharded (FSDP2 reduces)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_hybrid.strategies.pipeline.tied import TiedGradients
from lightning_hybrid.strategies.zero.config import ZeroConfig
from lightning_hybrid.strategies.zero.fully_sharded import UnitGradients
from lightning_hybrid.strategies.zero.grad_sync import FullyShardedGradients, GradientSync
from lightning_hybrid.strategies.zero.replicated import ReplicatedGradients
from lightning_hybrid.strategies.zero.sharded_gradients import ShardedOptimizerGradients

__all__ = ["gradient_sync"]


def gradient_sync(
    zero_stage: int,
    *,
    config: ZeroConfig,
    device: torch.device,
    data_parallel_group: dist.ProcessGroup,
    pipeline_group: dist.ProcessGroup,
    ties: TiedGradients | None = None,
    units: UnitGradients | None = None,
) -> GradientSync:
    """The gradient synchronisation for ``zero_stage`` (validated by the layout); ``units``: ZeRO-3's watch on
    the gradients FSDP2 reduces."""
    kwargs: dict[str, Any] = {
        "device": device,
        "data_parallel_group": data_parallel_group,
        "pipeline_group": pipeline_group,
        "ties": ties,
    }
    if zero_stage == 0:
        return ReplicatedGradients(config=config, **kwargs)
    if zero_stage in (1, 2):
        return ShardedOptimizerGradients(zero_stage=zero_stage, config=config, **kwargs)
    return FullyShardedGradients(units=units, **kwargs)
