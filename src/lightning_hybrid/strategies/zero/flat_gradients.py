"""ZeRO-1/2 gradients: where they live and how they reach each rank's shard, without full copies.

- ZeRO-1 (:class:`FlatGradients`): one persistent flat gradient buffer per flat group; a parameter's
  ``.grad`` is pointed at its part of it when backward first reaches the parameter (as DDP's
  ``gradient_as_bucket_view``), so backward accumulates in place and the window's reduction is one
  in-place all-reduce. No step copies the gradients.
- ZeRO-2, ``reduce_gradients="every_microbatch"`` (:class:`BucketGradients`, DeepSpeed's choice): each
  parameter's gradient is handed off into its bucket as soon as backward accumulated it; buckets are
  reduced to the ranks whose shards they cover and freed, so a rank never holds more of the full gradient
  than the buckets still waiting.
- ZeRO-2, ``reduce_gradients="once_per_step"`` (:class:`WindowGradients`): the full gradient accumulates
  in a flat buffer allocated by the window's first gradient, is reduced slice by slice to the slices'
  owners once when the window closes, and freed.

Every rank must issue the same collectives in the same order, whatever its data made backward compute (a
routed expert, a branch taken on some batches only). ZeRO-1 and ``once_per_step`` reduce only when the
window closes, in a fixed order. ZeRO-2's buckets go through one :class:`BucketQueue` per stage: a fixed
order over every bucket of every group; a bucket is reduced during backward only when it is complete *and*
every bucket before it in that order was reduced, and at the end of each backward (an agreed boundary:
the strategy's backward, or the end of a pipeline micro-batch's backward) every bucket not yet reduced is
reduced, with zeros where this rank has nothing. So each backward reduces every bucket exactly once, in one
order, on every rank; where parameters arrive late or never, only the overlap is lost.

A parameter's gradient counts as produced when backward reached it (``used``); which parameters no rank
produced a gradient for is agreed when the window closes (:class:`FlatShardedOptimizer`), and those are
not stepped, as in one process.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hybrid.strategies.zero.buckets import Bucket, BucketQueue, Finish, bucket_ranges

__all__ = ["BucketGradients", "FlatGradients", "GroupGradients", "WindowGradients"]


class GroupGradients(ABC):
    """The gradients of one flat group: ``params`` at ``offsets`` of a buffer of ``padded`` elements."""

    averaged_every_backward = False  # whether the gradient is the replicas' mean after each backward

    def __init__(
        self,
        params: list[nn.Parameter],
        offsets: list[int],
        padded: int,
        *,
        group: dist.ProcessGroup,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.params, self.offsets, self.padded = params, offsets, padded
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.shard_numel = padded // self.world
        self.dtype, self.device = dtype, device
        self.used = [False] * len(params)  # this rank produced a gradient for it in this window
        self.hooked: set[int] = set()
        self.watch_trainable()

    def watch_trainable(self) -> None:
        """Hook the parameters that are trainable now (a parameter unfrozen later is hooked at the next step;
        until then its gradient is collected when the window closes)."""
        for i, p in enumerate(self.params):
            if p.requires_grad and i not in self.hooked:
                self._hook(i, p)
                self.hooked.add(i)

    @abstractmethod
    def _hook(self, index: int, param: nn.Parameter) -> None: ...

    def segment(self, flat: Tensor, index: int) -> Tensor:
        off, p = self.offsets[index], self.params[index]
        return flat[off : off + p.numel()]

    def note_gradients(self) -> None:
        """Gradients that reached ``.grad`` without the hooks (a schedule's own accumulation) count as produced."""
        for i, p in enumerate(self.params):
            if p.grad is not None:
                self.used[i] = True

    def after_backward(self) -> None:
        """A backward (or a pipeline schedule's backwards) finished: gradients that are not in the buffer yet
        (a schedule accumulated weight gradients itself) go there now, before ``zero_grad`` could unlink them."""
        self.note_gradients()

    @abstractmethod
    def reduce(self, shard: nn.Parameter) -> None:
        """The window closed: ``shard.grad`` becomes this rank's slice of the replicas' mean gradient."""

    def after_step(self, shard: nn.Parameter) -> None:
        shard.grad = None
        self.used = [False] * len(self.params)
        self.watch_trainable()

    def local_gradients(self) -> list[Tensor]:
        """The gradient accumulated so far in the window, as this rank holds it (for the noise scale)."""
        return [p.grad for p in self.params if p.grad is not None]

    def clear(self) -> None:
        """``optimizer.zero_grad()``: every gradient of the window is discarded, wherever it is held."""
        for p in self.params:
            p.grad = None
        self.used = [False] * len(self.params)

    # ------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _absorb(self, flat: Tensor, *, link_all: bool) -> None:
        """Add every gradient that is not a view of ``flat`` (a schedule that accumulated weight gradients
        itself) into it and make it a view. ``None`` only unlinks a gradient (Lightning's ``zero_grad`` between
        a pipeline's backward and its own): the buffer keeps what accumulated; ``link_all`` links it again."""
        for i, p in enumerate(self.params):
            segment = self.segment(flat, i)
            if p.grad is None:
                if link_all:
                    p.grad = segment.view_as(p)
                continue
            if p.grad.data_ptr() != segment.data_ptr():
                segment.add_(p.grad.reshape(-1))
                p.grad = segment.view_as(p)

    def _strays(self, flat: Tensor | None) -> bool:
        return any(
            p.grad is not None and (flat is None or p.grad.data_ptr() != self.segment(flat, i).data_ptr())
            for i, p in enumerate(self.params)
        )

    def _shard_slice(self) -> slice:
        return slice(self.rank * self.shard_numel, (self.rank + 1) * self.shard_numel)


class _AccumulatingGradients(GroupGradients):
    """Gradients that accumulate in place in one flat buffer of the group (ZeRO-1, ZeRO-2 once per step)."""

    def _hook(self, index: int, param: nn.Parameter) -> None:
        param.register_hook(functools.partial(self._arriving, index))

    def _arriving(self, index: int, grad: Tensor) -> Tensor:
        # before backward accumulates: point .grad at the flat buffer, so it accumulates there in place
        flat = self._buffer()
        p = self.params[index]
        if p.grad is None:
            p.grad = self.segment(flat, index).view_as(p)
        self.used[index] = True
        return grad

    @abstractmethod
    def _buffer(self) -> Tensor:
        """The flat buffer gradients accumulate in."""


class FlatGradients(_AccumulatingGradients):
    """ZeRO-1: a persistent flat gradient buffer; ``param.grad`` are its views. The window's last backward
    all-reduces it bucket by bucket in the queue's order as backward completes each (``queue.armed``); a
    window closed otherwise (manual optimization, a pipeline's schedule) is all-reduced when the step needs it."""

    def __init__(self, *args: Any, bucket_numel: int, queue: BucketQueue, names: list[str], **kwargs: Any) -> None:
        self.flat = torch.zeros(args[2], dtype=kwargs["dtype"], device=kwargs["device"])
        self.queue, self.names = queue, names
        self.buckets = bucket_ranges(args[0], args[1], args[2], bucket_numel, shard_numel=args[2])
        self._bucket_of = [b for b, bucket in enumerate(self.buckets) for _ in bucket.members]
        super().__init__(*args, **kwargs)
        queue.add(self, self.buckets)

    def _buffer(self) -> Tensor:
        return self.flat

    def _hook(self, index: int, param: nn.Parameter) -> None:
        super()._hook(index, param)
        param.register_post_accumulate_grad_hook(functools.partial(self._accumulated, index))

    def _accumulated(self, index: int, param: Tensor) -> None:
        if self.queue.armed:
            bucket = self.buckets[self._bucket_of[index]]
            if bucket.started:  # already reduced or being reduced: this part would be added to the mean
                self.queue.late = self.queue.late or self.names[index]
                return
            bucket.arrived.add(index)
            self.queue.arrived()

    def complete(self, bucket: Bucket) -> bool:
        # a parameter unfrozen since the last step has no hook yet: its bucket waits for the end of backward
        return all(i in bucket.arrived for i in bucket.members if i in self.hooked or self.params[i].requires_grad)

    def holds(self, bucket: Bucket) -> bool:
        return False  # the buffer keeps the window's gradients until its reduction: nothing is pending

    @torch.no_grad()
    def start_reduction(self, bucket: Bucket) -> Finish:
        for i in bucket.members:  # a gradient that is not a view of the buffer (a schedule's own) goes in first
            p, segment = self.params[i], self.segment(self.flat, i)
            if p.grad is not None and p.grad.data_ptr() != segment.data_ptr():
                segment.add_(p.grad.reshape(-1))
                p.grad = segment.view_as(p)
        piece = self.flat[bucket.lo : bucket.hi]
        work = dist.all_reduce(piece, group=self.group, async_op=True)
        bucket.arrived, bucket.started = set(), True

        def finish() -> None:
            assert work is not None
            work.wait()
            piece.div_(self.world)

        return finish

    def after_backward(self) -> None:
        super().after_backward()
        if not any(bucket.started for bucket in self.buckets):
            self._absorb(self.flat, link_all=False)

    @torch.no_grad()
    def reduce(self, shard: nn.Parameter) -> None:
        self._absorb(self.flat, link_all=True)
        if not all(bucket.started for bucket in self.buckets):  # not reduced during backward
            dist.all_reduce(self.flat, group=self.group)
            self.flat.div_(self.world)
        for bucket in self.buckets:
            bucket.started = False
        # the full averaged gradient stays visible in param.grad for hooks and callbacks
        shard.grad = self.flat[self._shard_slice()]

    @torch.no_grad()
    def after_step(self, shard: nn.Parameter) -> None:
        self.flat.zero_()
        for p in self.params:
            p.grad = None
        super().after_step(shard)

    @torch.no_grad()
    def clear(self) -> None:
        self.flat.zero_()
        for bucket in self.buckets:
            bucket.arrived, bucket.started = set(), False
        super().clear()


class WindowGradients(_AccumulatingGradients):
    """ZeRO-2, once per step: a flat buffer from the window's first gradient, reduce-scattered, freed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.flat: Tensor | None = None
        super().__init__(*args, **kwargs)

    def _buffer(self) -> Tensor:
        if self.flat is None:  # the window's first gradient allocates the buffer
            self.flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        return self.flat

    def after_backward(self) -> None:
        super().after_backward()
        if self._strays(self.flat):
            if self.flat is None:
                self.flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
            self._absorb(self.flat, link_all=False)

    @torch.no_grad()
    def reduce(self, shard: nn.Parameter) -> None:
        if self.flat is None:  # no gradient through the hooks in this window
            self.flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        self._absorb(self.flat, link_all=False)
        # each rank's slice reduced to it in place (a reduce-scatter in N reductions: the same bytes on the wire,
        # and no backend-side copy of the whole buffer), then only this rank's slice is kept
        s = self.shard_numel
        for r in range(self.world):
            dist.reduce(self.flat[r * s : (r + 1) * s], dst=dist.get_global_rank(self.group, r), group=self.group)
        shard.grad = self.flat[self._shard_slice()].div_(self.world).clone()
        for p in self.params:
            p.grad = None
        self.flat = None  # the full gradient is gone before the step

    def clear(self) -> None:
        self.flat = None
        super().clear()


class BucketGradients(GroupGradients):
    """ZeRO-2, every micro-batch: buckets reduced to their shards' owners during backward, in the queue's order."""

    averaged_every_backward = True

    def __init__(self, *args: Any, bucket_numel: int, queue: BucketQueue, **kwargs: Any) -> None:
        self.queue = queue
        # this rank's slice of the window's gradient: from the window's first reduction until the step
        self.shard_grad: Tensor | None = None
        params, offsets, padded = args[0], args[1], args[2]
        world = dist.get_world_size(kwargs["group"])
        self.buckets = bucket_ranges(params, offsets, padded, bucket_numel, shard_numel=padded // world)
        self._bucket_of = [b for b, bucket in enumerate(self.buckets) for _ in bucket.members]
        super().__init__(*args, **kwargs)
        queue.add(self, self.buckets)

    def _hook(self, index: int, param: nn.Parameter) -> None:
        param.register_post_accumulate_grad_hook(functools.partial(self._accumulated, index))

    @torch.no_grad()
    def _accumulated(self, index: int, param: Tensor) -> None:
        # hand the gradient off at once: into the bucket's buffer, and the parameter's own storage is freed
        bucket = self.buckets[self._bucket_of[index]]
        self._hand_off(bucket, index)
        bucket.arrived.add(index)
        self.queue.arrived()

    def complete(self, bucket: Bucket) -> bool:
        return all(i in bucket.arrived for i in bucket.members if i in self.hooked)

    def holds(self, bucket: Bucket) -> bool:
        return bucket.buffer is not None or any(self.params[i].grad is not None for i in bucket.members)

    def _hand_off(self, bucket: Bucket, index: int) -> None:
        p = self.params[index]
        if p.grad is None:
            return
        self.used[index] = True
        if bucket.buffer is None:
            bucket.buffer = torch.zeros(bucket.hi - bucket.lo, dtype=self.dtype, device=self.device)
        begin = self.offsets[index] - bucket.lo
        bucket.buffer[begin : begin + p.numel()].add_(p.grad.reshape(-1))
        p.grad = None

    @torch.no_grad()
    def start_reduction(self, bucket: Bucket) -> Finish:
        """Start reducing ``bucket`` to its owners (called by the queue, in its order); the bucket's buffer is
        freed when the returned function has waited for it and added this rank's part to its shard gradient."""
        for i in bucket.members:  # gradients that reached .grad without the hook (e.g. a schedule's own)
            self._hand_off(bucket, i)
        if bucket.buffer is None:  # nothing arrived on this rank: it still takes part with zeros
            bucket.buffer = torch.zeros(bucket.hi - bucket.lo, dtype=self.dtype, device=self.device)
        flat, lo0 = bucket.buffer, bucket.lo
        works = []
        for owner, lo, hi in bucket.owners:
            piece, dst = flat[lo - lo0 : hi - lo0], dist.get_global_rank(self.group, owner)
            works.append((owner, lo, hi, dist.reduce(piece, dst=dst, group=self.group, async_op=True)))
        bucket.buffer, bucket.arrived = None, set()

        def finish() -> None:
            base = self.rank * self.shard_numel
            for owner, lo, hi, work in works:
                assert work is not None
                work.wait()
                if owner == self.rank:
                    self._shard_grad()[lo - base : hi - base] += flat[lo - lo0 : hi - lo0]

        return finish

    def _shard_grad(self) -> Tensor:
        if self.shard_grad is None:
            self.shard_grad = torch.zeros(self.shard_numel, dtype=self.dtype, device=self.device)
        return self.shard_grad

    def reduce(self, shard: nn.Parameter) -> None:
        # every bucket was reduced at the window's backward boundaries (the queue's owner made sure)
        shard.grad = self._shard_grad().div_(self.world)  # in place

    @torch.no_grad()
    def after_step(self, shard: nn.Parameter) -> None:
        # freed, not zeroed: the next window allocates it at its first reduction, after the forward
        self.shard_grad = None
        super().after_step(shard)

    def local_gradients(self) -> list[Tensor]:
        return [self._shard_grad() / self.world]  # the replicas' mean so far (disjoint shards)

    def clear(self) -> None:
        # what was already reduced lives in the shard gradients of every rank (each its own slice): discarded
        # on every rank alike, since zero_grad is called on every rank
        self.shard_grad = None
        for bucket in self.buckets:
            bucket.buffer, bucket.arrived = None, set()
        super().clear()
