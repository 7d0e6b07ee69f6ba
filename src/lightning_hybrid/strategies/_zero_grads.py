"""ZeRO-1/2 gradients: where they live and how they reach each rank's shard, without full copies.

- ZeRO-1 (:class:`FlatGradients`): one persistent flat gradient buffer per parameter group; every
  ``param.grad`` is a view of it (as DDP's ``gradient_as_bucket_view``), so backward accumulates in place
  and the window's reduction is one in-place all-reduce. No step copies the gradients.
- ZeRO-2, ``reduce_gradients="every_microbatch"`` (:class:`BucketGradients`, DeepSpeed's choice): each
  parameter's gradient is handed off as soon as backward accumulated it; when a bucket of consecutive
  parameters is complete it is reduced to the ranks whose shards it covers and freed, so a rank never
  holds more of the full gradient than the buckets still in flight. One reduction per micro-batch.
- ZeRO-2, ``reduce_gradients="once_per_step"`` (:class:`WindowGradients`): the full gradient accumulates
  in a flat buffer allocated by the window's first gradient, is reduced slice by slice to the slices'
  owners once when the window closes, and freed. Half the communication when accumulating (or
  pipelining) many micro-batches, at the cost of holding the full gradient during the window.

Every object exposes the same calls, made by :class:`FlatShardedOptimizer`: ``after_backward`` (end of
each backward), ``reduce`` (the window closed: put the replicas' mean into ``shard.grad``) and
``after_step``. The hooks that hand gradients off run inside backward, so every data-parallel rank must
produce gradients for the same parameters in each backward (as DDP requires by default).
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["BucketGradients", "FlatGradients", "GroupGradients", "WindowGradients"]


class GroupGradients(ABC):
    """The gradients of one flat parameter group (``params`` at ``offsets`` of a buffer of ``padded``)."""

    averaged_every_backward = False  # whether the gradient is the replicas' mean after each backward

    def __init__(
        self, params: list[nn.Parameter], offsets: list[int], padded: int, *, group: dist.ProcessGroup
    ) -> None:
        self.params, self.offsets, self.padded = params, offsets, padded
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.shard_numel = padded // self.world
        ref = params[0]
        self.dtype, self.device = ref.dtype, ref.device

    def after_backward(self) -> None:  # noqa: B027 (an optional hook: most subclasses have nothing to do)
        """A backward (one micro-batch) finished."""

    @abstractmethod
    def reduce(self, shard: nn.Parameter) -> None:
        """The window closed: ``shard.grad`` becomes this rank's slice of the replicas' mean gradient."""

    def after_step(self, shard: nn.Parameter) -> None:
        shard.grad = None

    def local_gradients(self) -> list[Tensor]:
        """The gradient accumulated so far in the window, as this rank holds it (for the noise scale)."""
        return [p.grad for p in self.params if p.grad is not None]

    # ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _adopt(self, flat: Tensor) -> None:
        """Make ``flat`` hold every parameter's gradient: a gradient that is not a view of it (replaced by
        someone) is copied in, a missing one (set to None: discarded) is zero; then views again."""
        for p, off in zip(self.params, self.offsets):
            segment = flat[off : off + p.numel()]
            if p.grad is None:
                segment.zero_()
            elif p.grad.data_ptr() != segment.data_ptr():
                segment.copy_(p.grad.reshape(-1))
            p.grad = segment.view_as(p)

    def _shard_slice(self) -> slice:
        return slice(self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel)


class FlatGradients(GroupGradients):
    """ZeRO-1: a persistent flat gradient buffer; ``param.grad`` are its views; one in-place all-reduce."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        self._adopt(self.flat)

    @torch.no_grad()
    def reduce(self, shard: nn.Parameter) -> None:
        self._adopt(self.flat)
        dist.all_reduce(self.flat, group=self.group)
        self.flat.div_(self.world)
        # the full averaged gradient stays visible in param.grad for hooks and callbacks
        shard.grad = self.flat[self._shard_slice()]

    @torch.no_grad()
    def after_step(self, shard: nn.Parameter) -> None:
        shard.grad = None
        self.flat.zero_()
        self._adopt(self.flat)


class WindowGradients(GroupGradients):
    """ZeRO-2, once per step: a flat buffer from the window's first gradient, reduce-scattered, freed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.flat: Tensor | None = None
        for p in self.params:
            # before the first accumulation of a window: give every gradient its place in one buffer, so
            # backward accumulates in place and no step copies the gradients
            p.register_hook(self._allocate)

    def _allocate(self, grad: Tensor) -> Tensor:
        if self.flat is None:
            self.flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
            self._adopt(self.flat)
        return grad

    @torch.no_grad()
    def reduce(self, shard: nn.Parameter) -> None:
        if self.flat is None:  # no gradient at all in this window
            self.flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        self._adopt(self.flat)
        # each rank's slice reduced to it in place (a reduce-scatter in N reductions: the same bytes on the wire,
        # and no backend-side copy of the whole buffer), then only this rank's slice is kept
        s = self.shard_numel
        for r in range(self.world):
            dist.reduce(self.flat[r * s : (r + 1) * s], dst=dist.get_global_rank(self.group, r), group=self.group)
        shard.grad = self.flat[self._shard_slice()].div_(self.world).clone()
        for p in self.params:
            p.grad = None
        self.flat = None  # the full gradient is gone before the step


@dataclass
class _Bucket:
    lo: int  # range of the group's flat buffer
    hi: int
    members: list[int]  # parameter indices
    owners: list[tuple[int, int, int]]  # (group rank, lo, hi): the parts of shards it covers
    arrived: set[int] = field(default_factory=set)  # members handed off in the current backward
    buffer: Tensor | None = None  # their gradients, from the first hand-off until the bucket is reduced


class BucketGradients(GroupGradients):
    """ZeRO-2, every micro-batch: complete buckets are reduced to their shards' owners during backward."""

    averaged_every_backward = True

    def __init__(self, *args: Any, bucket_numel: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # this rank's slice of the window's gradient: from the window's first reduction until the step
        self.shard_grad: Tensor | None = None
        self.buckets: list[_Bucket] = []
        self._bucket_of: list[int] = []
        start, members = 0, []
        for i, (p, off) in enumerate(zip(self.params, self.offsets)):
            members.append(i)
            self._bucket_of.append(len(self.buckets))  # the bucket being filled
            end = off + p.numel()
            last = i == len(self.params) - 1
            if end - start >= bucket_numel or last:
                hi = self.padded if last else end  # the padding belongs to the last bucket
                self.buckets.append(_Bucket(start, hi, members, self._owners(start, hi)))
                start, members = end, []
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(functools.partial(self._accumulated, i))

    def _owners(self, lo: int, hi: int) -> list[tuple[int, int, int]]:
        s = self.shard_numel
        return [(r, max(lo, r * s), min(hi, (r + 1) * s)) for r in range(lo // s, (hi - 1) // s + 1)]

    @torch.no_grad()
    def _accumulated(self, index: int, param: Tensor) -> None:
        # hand the gradient off at once: into the bucket's buffer, and the parameter's own storage is freed
        bucket = self.buckets[self._bucket_of[index]]
        self._hand_off(bucket, index)
        bucket.arrived.add(index)
        if len(bucket.arrived) == len(bucket.members):
            self._reduce_bucket(bucket)

    def _hand_off(self, bucket: _Bucket, index: int) -> None:
        p = self.params[index]
        if p.grad is None:
            return
        if bucket.buffer is None:
            bucket.buffer = torch.zeros(bucket.hi - bucket.lo, dtype=self.dtype, device=self.device)
        begin = self.offsets[index] - bucket.lo
        bucket.buffer[begin : begin + p.numel()].add_(p.grad.reshape(-1))
        p.grad = None

    @torch.no_grad()
    def _reduce_bucket(self, bucket: _Bucket) -> None:
        for i in bucket.members:  # gradients that reached .grad without the hook (e.g. a schedule's own)
            self._hand_off(bucket, i)
        if bucket.buffer is None:  # nothing arrived on this rank: it still takes part with zeros
            bucket.buffer = torch.zeros(bucket.hi - bucket.lo, dtype=self.dtype, device=self.device)
        flat, base = bucket.buffer, self.rank * self.shard_numel
        for owner, lo, hi in bucket.owners:
            piece = flat[lo - bucket.lo : hi - bucket.lo]
            dist.reduce(piece, dst=dist.get_global_rank(self.group, owner), group=self.group)
            if owner == self.rank:
                self._shard_grad()[lo - base : hi - base] += piece
        bucket.buffer, bucket.arrived = None, set()

    def after_backward(self) -> None:
        # buckets whose parameters did not all accumulate (unused ones, or a schedule that accumulated weight
        # gradients itself) go now, in a fixed order, so every micro-batch's gradient is reduced before the next
        for bucket in self.buckets:
            if bucket.arrived or any(self.params[i].grad is not None for i in bucket.members):
                self._reduce_bucket(bucket)

    def _shard_grad(self) -> Tensor:
        if self.shard_grad is None:
            self.shard_grad = torch.zeros(self.shard_numel, dtype=self.dtype, device=self.device)
        return self.shard_grad

    def reduce(self, shard: nn.Parameter) -> None:
        self.after_backward()
        shard.grad = self._shard_grad().div_(self.world)  # in place

    @torch.no_grad()
    def after_step(self, shard: nn.Parameter) -> None:
        # freed, not zeroed: the next window allocates it at its first reduction, after the forward
        shard.grad = self.shard_grad = None

    def local_gradients(self) -> list[Tensor]:
        return [self._shard_grad() / self.world]  # the replicas' mean so far (disjoint shards)
