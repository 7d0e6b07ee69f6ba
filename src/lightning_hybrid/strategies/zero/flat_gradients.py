"""ZeRO-1/2 gradients: where they live and how they reach each rank's shard, without full copies.

- ZeRO-1 (:class:`FlatGradients`): one persistent flat gradient buffer per flat group; a parameter's
  first gradient of the window is copied into its part of it and ``.grad`` becomes that view (as DDP's
  ``gradient_as_bucket_view``), so the window's later micro-batches accumulate in place; the window's last
  backward reduces it bucket by bucket to the ranks whose shards each covers (a reduce-scatter). The buffer
  is not zeroed per step: what no gradient was written to in the window is zeroed as its bucket is reduced.
- ZeRO-2, ``reduce_gradients="every_microbatch"`` (``bucket_gradients.BucketGradients``, DeepSpeed's choice): each
  parameter's gradient is handed off into its bucket as soon as backward accumulated it; buckets are
  reduced to the ranks whose shards they cover and their buffers reused, so a rank never holds more of the
  full gradient than the buckets still waiting.
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

User code between backward and the step (``UserGradientCode``): ``.grad`` is a view of the buffer while a
window accumulates, so an edit in place lands in it; a gradient assigned there replaces what the view held
(and ``None`` drops it), as it would in one process. Where user code reads the gradient after the window's
last backward (``on_after_backward``, manual optimization), ZeRO-1 and ``once_per_step`` are "full": the
buffer is all-reduced when backward ends, so ``.grad`` is the replicas' mean there, as under DDP (the bytes
of DDP's all-reduce, plus the parameters' all-gather), and what user code changes is settled before the step
(:meth:`GroupGradients.edits`). From the step's start each rank keeps only its shard: ``.grad`` of the
model's parameters is then a :class:`GradientElsewhere` where user code can look (None where none can).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hybrid.strategies.zero.buckets import Bucket, BucketQueue, Finish, bucket_ranges
from lightning_hybrid.strategies.zero.collectives import reduce_to_owners
from lightning_hybrid.strategies.zero.group_gradients import GroupGradients

__all__ = ["FlatGradients", "WindowGradients"]


class FlatGradients(GroupGradients):
    """ZeRO-1: a persistent flat gradient buffer; ``param.grad`` are its views while the window accumulates.
    The window's last backward reduces it to the shards' owners bucket by bucket in the queue's order as
    backward completes each (``queue.armed``); a window closed otherwise (manual optimization, a pipeline's
    schedule) is reduced when the step needs it. Then each rank holds the replicas' mean of its own shard only
    (what it steps), so ``param.grad`` is unlinked (as under ZeRO-2): the rest of the buffer holds this rank's
    own sums. A reduce-scatter and the parameters' all-gather move what DDP's one all-reduce moves. Full (user
    code reads the gradient after backward): all-reduced when backward ends instead, never during it."""

    def __init__(self, *args: Any, bucket_numel: int, queue: BucketQueue, **kwargs: Any) -> None:
        self.flat = torch.zeros(args[2], dtype=kwargs["dtype"], device=kwargs["device"])
        self.queue = queue
        world = dist.get_world_size(kwargs["group"])
        self.buckets = bucket_ranges(args[0], args[1], args[2], bucket_numel, shard_numel=args[2] // world)
        self._bucket_of = [b for b, bucket in enumerate(self.buckets) for _ in bucket.members]
        self._receive: list[Tensor] = []  # gloo's receive buffers of the reductions, reused from step to step
        super().__init__(*args, **kwargs)
        queue.add(self, self.buckets)

    def _buffer(self) -> Tensor:
        return self.flat

    def _hook(self, index: int, param: nn.Parameter) -> None:
        # one hook, after autograd accumulated: the window's first gradient (autograd's own tensor) is copied
        # into the buffer and .grad becomes its view, so the window's later micro-batches accumulate in place
        param.register_post_accumulate_grad_hook(functools.partial(self._accumulated, index))

    def _accumulated(self, index: int, param: Tensor) -> None:
        self._refuse_graph(index)
        if self.arrived_late(index):
            return
        bucket = self.buckets[self._bucket_of[index]]
        if self.queue.armed and bucket.started:  # reduced or being reduced: this part would be added to the mean
            self.queue.late = self.queue.late or self.names[index]
            return
        self._reopen()
        self._take(index, self._buffer())
        self.used[index] = True
        if self.queue.armed:
            bucket.arrived.add(index)
            self.queue.arrived()

    def complete(self, bucket: Bucket) -> bool:
        # a parameter unfrozen since the last step has no hook yet: its bucket waits for the end of backward
        return all(i in bucket.arrived for i in bucket.members if i in self.hooked or self.params[i].requires_grad)

    def holds(self, bucket: Bucket) -> bool:
        return False  # the buffer keeps the window's gradients until its reduction: nothing is pending

    @torch.no_grad()
    def start_reduction(self, bucket: Bucket) -> Finish:
        self._reopen()
        for i in bucket.members:  # a gradient that is not a view of the buffer (a schedule's own) goes in first
            self._take(i, self._buffer())
        self._zero_unwritten(self.flat, bucket.members, bucket.lo, bucket.hi)
        pending = reduce_to_owners(self.flat, bucket.owners, self.group, pool=self._receive)
        bucket.arrived, bucket.started = set(), True

        def finish() -> None:
            pending.wait()
            for owner, lo, hi in bucket.owners:
                if owner == self.rank:
                    self.flat[lo:hi].div_(self.world)

        return finish

    def after_backward(self) -> None:
        super().after_backward()
        if all(bucket.started for bucket in self.buckets):
            # reduced during this backward: outside this rank's shard the buffer holds its own sums, not the
            # mean, so ``.grad`` is unlinked before on_after_backward could read it (as under ZeRO-2)
            for p in self.params:
                p.grad = None
            self.linked.clear()
        elif not any(bucket.started for bucket in self.buckets) and self._strays(self.flat):
            self._reopen()
            self._take_all(self._buffer())

    @torch.no_grad()
    def reduce(self, shard: nn.Parameter) -> None:
        if self.full:
            self._reduce_full(shard, self._buffer())
            return
        self._reopen()
        self._take_all(self._buffer())
        if not all(bucket.started for bucket in self.buckets):  # not reduced during backward
            self._zero_all_unwritten(self.flat)
            s = self.shard_numel
            reduce_to_owners(self.flat, [(r, r * s, (r + 1) * s) for r in range(self.world)], self.group).wait()
            self.flat[self._shard_slice()].div_(self.world)
        for bucket in self.buckets:
            bucket.started = False
        shard.grad = self.flat[self._shard_slice()]
        for p in self.params:  # the buffer outside this rank's shard holds its own sums, not the mean
            p.grad = None
        self.linked.clear()
        self._reduced = True

    @torch.no_grad()
    def clear(self) -> None:
        for bucket in self.buckets:
            bucket.arrived, bucket.started = set(), False
        super().clear()


class WindowGradients(GroupGradients):
    """ZeRO-2, once per step: a flat buffer from the window's first gradient, reduce-scattered, freed (full:
    all-reduced when backward ends and kept until the step)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.flat: Tensor | None = None
        super().__init__(*args, **kwargs)

    def _buffer(self) -> Tensor:
        if self.flat is None:  # the window's first gradient allocates the buffer
            self.flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        return self.flat

    def _hook(self, index: int, param: nn.Parameter) -> None:
        param.register_hook(functools.partial(self._arriving, index))
        param.register_post_accumulate_grad_hook(lambda _, i=index: self._refuse_graph(i))

    def _arriving(self, index: int, grad: Tensor) -> Tensor:
        # before backward accumulates: .grad becomes the buffer's view (what user code put there taken in
        # first), so backward accumulates into the buffer in place
        if self.arrived_late(index):
            return grad
        flat = self._buffer()
        p = self.params[index]
        self._take(index, flat)
        if p.grad is None:  # the window's fresh (zeroed) buffer: backward accumulates into the view
            p.grad = self.segment(flat, index).view_as(p)
            self.linked.add(index)
            self._written.add(index)
        self.used[index] = True
        return grad

    def after_backward(self) -> None:
        super().after_backward()
        if self._strays(self.flat):
            self._take_all(self._buffer())

    @torch.no_grad()
    def reduce(self, shard: nn.Parameter) -> None:
        if self.full:
            self._reduce_full(shard, self._buffer())
            return
        flat = self._buffer()  # zeros when no gradient came through the hooks in this window
        self._take_all(flat)
        # each rank's slice reduced to it (a reduce-scatter), then only this rank's slice is kept
        s = self.shard_numel
        reduce_to_owners(flat, [(r, r * s, (r + 1) * s) for r in range(self.world)], self.group).wait()
        mean = flat[self._shard_slice()].div_(self.world)
        # reduced before in this window (a backward after the reduction, before the step): added to it
        shard.grad = mean.clone() if shard.grad is None else shard.grad.add_(mean)
        for p in self.params:
            p.grad = None
        self.linked.clear()
        self.flat = None  # the full gradient is gone before the step

    def after_step(self, shard: nn.Parameter) -> None:
        self.flat = None
        super().after_step(shard)

    def clear(self) -> None:
        self.flat = None
        super().clear()
