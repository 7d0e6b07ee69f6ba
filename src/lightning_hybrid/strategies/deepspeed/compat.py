"""The only place the pack touches DeepSpeed's private names (checked on deepspeed 0.19.8).

Each is used as DeepSpeed's own code uses it; a rename in a future release breaks here, once.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

__all__ = [
    "fp32_partition_of",
    "inner_optimizer",
    "keep_only_stage_blocks",
    "keep_torch_collectives",
    "loss_scaler",
    "stage_blocks",
]


def keep_torch_collectives() -> None:
    """On CPU, DeepSpeed would JIT-compile a shared-memory collective with ninja; torch's gloo is used instead
    (DeepSpeed consults ``deepspeed.ops.__compatible_ops__`` before building an op)."""
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def stage_blocks(pipe: nn.Module) -> tuple[int, int]:
    """``[start, stop)``: the layer specs of a ``PipelineModule`` this stage builds (``_local_start`` /
    ``_local_stop``, set by its partitioning)."""
    return pipe._local_start, pipe._local_stop


def fp32_partition_of(param: Tensor) -> tuple[bool, Any]:
    """``(linked, mapping)``: whether DeepSpeed's mixed-precision or ZeRO-1 optimizer linked ``param`` to its
    fp32 partition (``param._hp_mapping``), and the link (None where another data-parallel rank's partition
    holds all of it). Unlinked parameters are stepped by the torch optimizer itself."""
    if not hasattr(param, "_hp_mapping"):
        return False, None
    return True, param._hp_mapping


def keep_only_stage_blocks(pipe: nn.Module, start: int, stop: int) -> None:
    """Drop the other stages' layer specs from a ``PipelineModule`` (``_layer_specs``), so they and the
    modules they hold are not kept alive on this rank."""
    pipe._layer_specs = [spec if start <= i < stop else None for i, spec in enumerate(pipe._layer_specs)]


def inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer a DeepSpeed optimizer wrapper (ZeRO-1, bf16, fp16) keeps in ``.optimizer``, or None
    for a torch optimizer the engine steps itself."""
    return optimizer.optimizer if hasattr(optimizer, "optimizer") else None


def loss_scaler(optimizer: Any) -> Any:
    """The dynamic loss scaler of DeepSpeed's fp16 optimizer wrapper (``.loss_scaler``), or None."""
    return optimizer.loss_scaler if hasattr(optimizer, "loss_scaler") else None
