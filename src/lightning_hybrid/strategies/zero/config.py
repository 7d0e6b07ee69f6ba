"""Advanced ZeRO settings of HybridParallelStrategy."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ZeroConfig"]


@dataclass(frozen=True)
class ZeroConfig:
    """Advanced ZeRO settings of :class:`HybridParallelStrategy` (the defaults save the most memory).

    Args:
        reduce_gradients: ZeRO-2 only. ``"every_microbatch"``: each bucket of gradients is reduced to the
            ranks that own it as soon as backward produced it and then freed, so no rank ever holds the
            whole stage gradient (one reduction per micro-batch, DeepSpeed's choice). ``"once_per_step"``:
            the full gradient accumulates over the accumulation window and pipeline micro-batches and is
            reduce-scattered once per optimizer step (less communication, the full gradient in memory).
        bucket_size_mb: the size of a gradient bucket (the ZeRO-0 all-reduce, ZeRO-2's reductions during
            backward). A ZeRO-1/2 optimizer steps and gathers its shard in chunks of at most this size and
            8 MiB of fp32, so an optimizer's temporaries (Adam's denominator, ...) are a chunk, not the shard.
        reshard_after_forward: ZeRO-3 only. ``True``: free each block's gathered parameters after its
            forward and gather them again for its backward (and for every micro-batch). ``False``: keep them
            gathered until the step ends (about one stage of full parameters more, fewer all-gathers).
        shard_units: ZeRO-3 only. ``"submodules"``: each direct child of a block that holds parameters (a
            transformer block's attention, MLP, norms) is its own FSDP2 unit, so FSDP2's working set (the
            gathered unit, its unsharded gradient, the prefetched next unit) is a fraction of a block.
            ``"blocks"``: each block is one unit (torchtitan's choice): fewer, larger all-gathers and
            reduce-scatters, faster where collectives are latency-bound, a larger peak on shallow models.
    """

    reduce_gradients: Literal["every_microbatch", "once_per_step"] = "every_microbatch"
    bucket_size_mb: float = 25.0
    reshard_after_forward: bool = True
    shard_units: Literal["blocks", "submodules"] = "submodules"

    def __post_init__(self) -> None:
        if self.reduce_gradients not in ("every_microbatch", "once_per_step"):
            raise ValueError(
                f"reduce_gradients must be 'every_microbatch' or 'once_per_step', got {self.reduce_gradients!r}."
            )
        size = self.bucket_size_mb
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 < size < float("inf"):
            raise ValueError(f"bucket_size_mb must be a finite number > 0, got {size!r}.")
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward must be True or False, got {self.reshard_after_forward!r}.")
        if self.shard_units not in ("blocks", "submodules"):
            raise ValueError(f"shard_units must be 'blocks' or 'submodules', got {self.shard_units!r}.")
