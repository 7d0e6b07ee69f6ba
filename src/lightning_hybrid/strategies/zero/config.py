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
            backward), and under ZeRO-3 with ``shard_units="auto"`` the largest block kept as one unit. A
            ZeRO-1/2 optimizer steps and gathers its shard in chunks of at most this size and 8 MiB of fp32, so
            an optimizer's temporaries (Adam's denominator, ...) are a chunk, not the shard.
        reshard_after_forward: ZeRO-3 only. ``True``: free each block's gathered parameters after its
            forward and gather them again for its backward (and for every micro-batch). ``False``: keep them
            gathered until the step ends (about one stage of full parameters more, fewer all-gathers).
        shard_units: ZeRO-3 only. ``"auto"``: a block is one FSDP2 unit when its parameters fit in
            ``bucket_size_mb`` and its trainable ones have one dtype (after a ``*-true`` precision's cast),
            otherwise each of its parameter-holding children is a unit.
            ``"submodules"``: each direct child of a block that holds parameters (a transformer block's
            attention, MLP, norms) is its own unit, so FSDP2's working set (the gathered unit, its unsharded
            gradient, the prefetched next unit) is a fraction of a block. ``"blocks"``: each block is one unit
            (torchtitan's choice): fewer, larger all-gathers and reduce-scatters, faster where collectives are
            latency-bound, a larger peak where blocks are large.
        max_buckets_in_flight: ZeRO-0/1/2: gradient reductions started during backward and not yet waited
            for (each bucket's reduction starts as soon as backward completed it; starting one more first
            waits for the oldest). ZeRO-0 and ZeRO-1 reduce in place (on gloo a rank receives the others'
            parts of its own shard into 4 MiB per reduction in flight); ZeRO-2 holds a bucket's gradients until
            its reduction is done, so its buckets are ``bucket_size_mb / (max_buckets_in_flight + 1)``: the
            bucket filling and those in flight hold ``bucket_size_mb``.
        overlap_reductions: ZeRO-0/1/2: ``True`` starts each bucket's reduction during backward, as soon as
            backward completed it (ZeRO-0/1 in the backward that closes the accumulation window, ZeRO-2 in
            every backward), so communication runs while the rest of backward computes. ``False`` starts them
            all when backward ends (for a model whose parameters receive their gradient in several parts in
            one backward, such as reentrant activation checkpointing over segments that share a parameter).
    """

    reduce_gradients: Literal["every_microbatch", "once_per_step"] = "every_microbatch"
    bucket_size_mb: float = 25.0
    reshard_after_forward: bool = True
    shard_units: Literal["auto", "blocks", "submodules"] = "auto"
    max_buckets_in_flight: int = 2
    overlap_reductions: bool = True

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
        n = self.max_buckets_in_flight
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"max_buckets_in_flight must be an integer >= 1, got {n!r}.")
        if not isinstance(self.overlap_reductions, bool):
            raise ValueError(f"overlap_reductions must be True or False, got {self.overlap_reductions!r}.")
        if self.shard_units not in ("auto", "blocks", "submodules"):
            raise ValueError(f"shard_units must be 'auto', 'blocks' or 'submodules', got {self.shard_units!r}.")
