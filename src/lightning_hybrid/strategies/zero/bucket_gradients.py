"""ZeRO-2's default gradients (``reduce_gradients="every_microbatch"``, DeepSpeed's choice): each parameter's
gradient is handed off into its bucket as soon as backward accumulated it, and each bucket is reduced to the
ranks whose shards it covers, its buffer then taken by a later bucket, so a rank never holds more of the full
gradient than the buckets still waiting (those buffers, and the shard gradient's storage, are kept from step
to step: nothing is allocated afresh per bucket, micro-batch or step). The rules every ZeRO-1/2 gradient
follows are in ``flat_gradients``."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_hybrid.strategies.zero.buckets import Bucket, BucketQueue, Finish, bucket_ranges
from lightning_hybrid.strategies.zero.collectives import reduce_to_owners
from lightning_hybrid.strategies.zero.elsewhere import is_gradient
from lightning_hybrid.strategies.zero.group_gradients import GroupGradients

__all__ = ["BucketGradients"]


class BucketGradients(GroupGradients):
    """ZeRO-2, every micro-batch: buckets reduced to their shards' owners during backward, in the queue's order."""

    averaged_every_backward = True
    holds_whole = False

    def __init__(self, *args: Any, bucket_numel: int, queue: BucketQueue, **kwargs: Any) -> None:
        self.queue = queue
        # this rank's slice of the window's gradient: from the window's first reduction until the step; the
        # replicas' sum, or their mean once the window was reduced (``averaged``)
        self.shard_grad: Tensor | None = None
        self._shard_written: set[int] = set()  # the buckets (by id: an empty one shares its ``lo``) reduced into it
        self.averaged = False
        params, offsets, padded = args[0], args[1], args[2]
        world = dist.get_world_size(kwargs["group"])
        self.buckets = bucket_ranges(params, offsets, padded, bucket_numel, shard_numel=padded // world)
        self._bucket_of = [b for b, bucket in enumerate(self.buckets) for _ in bucket.members]
        # buffers of reductions that are done, for the next buckets: a buffer allocated afresh for every bucket
        # of every micro-batch would touch new memory each time (on the host, a page fault per 4 KiB), a cost
        # that grows with the model. At most as many as can be live at once are kept (the bucket filling and
        # those in flight), from step to step: every backward holds them anyway, and with the optimizer's state
        # and the shard gradient (what the step holds) a backward's peak is the higher one
        self._pool: list[Tensor] = []
        self._spare: Tensor | None = None  # the last window's shard gradient, the next one's storage
        self._pool_size = queue.max_in_flight + 1
        self._bases: dict[int, Tensor] = {}  # id(bucket) -> the pooled buffer its ``buffer`` is the start of
        self._receive: list[Tensor] = []  # gloo's receive buffers, likewise (``reduce_to_owners``'s pool)
        super().__init__(*args, **kwargs)
        queue.add(self, self.buckets)

    def _hook(self, index: int, param: nn.Parameter) -> None:
        param.register_post_accumulate_grad_hook(functools.partial(self._accumulated, index))

    def _accumulated(self, index: int, param: Tensor) -> None:
        self._refuse_graph(index)
        if self.arrived_late(index):
            param.grad = None  # refused at the step, on every rank
            return
        # hand the gradient off at once: into the bucket's buffer, and the parameter's own storage is freed
        bucket = self.buckets[self._bucket_of[index]]
        with torch.no_grad():
            self._hand_off(bucket, index)
        bucket.arrived.add(index)
        self.queue.arrived()

    def complete(self, bucket: Bucket) -> bool:
        return all(i in bucket.arrived for i in bucket.members if i in self.hooked)

    def holds(self, bucket: Bucket) -> bool:
        return bucket.buffer is not None or any(is_gradient(self.params[i].grad) for i in bucket.members)

    def after_backward(self) -> None:
        super().after_backward()
        if self.user.reads_after_backward:  # user code looks at .grad next: it says where the gradient went
            for i, p in enumerate(self.params):
                if p.grad is None:
                    p.grad = self._placeholder(i)

    def _buffer(self) -> Tensor:
        raise AssertionError("ZeRO-2's default keeps no buffer of the window's whole gradient")

    def _taken(self, index: int) -> bool:
        # a hooked parameter's gradient was handed off when backward accumulated it: a tensor in .grad is user
        # code's. One unfrozen since the last step has no hook yet: autograd's gradient waits in .grad until
        # its bucket's next reduction takes it
        return index in self.hooked

    def _elsewhere_message(self, index: int) -> str:
        return (
            f"{self.names[index]}.grad: under zero_stage=2 (reduce_gradients='every_microbatch') each gradient is"
            " handed off to its bucket during backward and reduced to the data-parallel ranks that own its"
            " slices, so no rank holds it whole between backward and the step. Edit gradients with a tensor hook"
            " (param.register_hook), or element-wise in on_before_optimizer_step through optimizer.param_groups"
            " (this rank's shard); or use ZeroConfig(reduce_gradients='once_per_step') or zero_stage=1, under"
            " which on_after_backward sees the replicas' mean gradient as under DDP."
        )

    def _hand_off(self, bucket: Bucket, index: int) -> None:
        p = self.params[index]
        if not is_gradient(p.grad):
            return
        self.used[index] = True
        if bucket.buffer is None:  # not zeroed: each member's first gradient is copied in, the rest added
            self._new_buffer(bucket)
        begin = self.offsets[index] - bucket.lo
        segment = bucket.buffer[begin : begin + p.numel()]
        if index in bucket.written:  # a second part in one backward (reentrant checkpointing, overlap off)
            segment.add_(p.grad.reshape(-1))
        else:
            segment.copy_(p.grad.reshape(-1))
            bucket.written.add(index)
        p.grad = None

    def _zero_unwritten_of_bucket(self, bucket: Bucket) -> None:
        """Zeros where no gradient was handed off: members without one on this rank, any gap between members,
        and the padding: one fill per stretch between written segments."""
        assert bucket.buffer is not None
        start = 0  # where the stretch still to be zeroed begins
        for i in bucket.members:  # in the buffer's order
            if i in bucket.written:
                begin = self.offsets[i] - bucket.lo
                if start < begin:
                    bucket.buffer[start:begin].zero_()
                start = max(start, begin + self.params[i].numel())
        if start < bucket.buffer.numel():
            bucket.buffer[start:].zero_()

    @torch.no_grad()
    def start_reduction(self, bucket: Bucket) -> Finish:
        """Start reducing ``bucket`` to its owners (called by the queue, in its order); the bucket's buffer is
        freed when the returned function has waited for it and added this rank's part to its shard gradient."""
        for i in bucket.members:  # gradients that reached .grad without the hook (e.g. a schedule's own)
            self._hand_off(bucket, i)
        if bucket.buffer is None:  # nothing arrived on this rank: it still takes part with zeros
            self._new_buffer(bucket).zero_()
        else:
            self._zero_unwritten_of_bucket(bucket)
        flat, lo0, pooled = bucket.buffer, bucket.lo, self._bases.pop(id(bucket))
        parts = [(owner, lo - lo0, hi - lo0) for owner, lo, hi in bucket.owners]
        pending = reduce_to_owners(flat, parts, self.group, pool=self._receive)
        bucket.buffer, bucket.arrived, bucket.written = None, set(), set()

        def finish() -> None:
            pending.wait()
            base = self.rank * self.shard_numel
            for owner, lo, hi in bucket.owners:
                if owner != self.rank:
                    continue
                part, target = flat[lo - lo0 : hi - lo0], self._summed_shard_grad()[lo - base : hi - base]
                if id(bucket) in self._shard_written:
                    target += part
                else:  # this bucket's first reduction in the window: copied, not added to zeros
                    target.copy_(part)
                    self._shard_written.add(id(bucket))
            self._pool.append(pooled)
            if len(self._pool) > self._pool_size:  # the smallest goes
                self._pool.pop(min(range(len(self._pool)), key=lambda n: self._pool[n].numel()))

        return finish

    def _new_buffer(self, bucket: Bucket) -> Tensor:
        """``bucket``'s buffer for this backward: the start of a pooled one (see ``_pool``), not zeroed."""
        numel = bucket.hi - bucket.lo
        fits = [n for n, b in enumerate(self._pool) if b.numel() >= numel]
        if fits:  # the smallest that fits
            base = self._pool.pop(min(fits, key=lambda n: self._pool[n].numel()))
        else:
            base = torch.empty(numel, dtype=self.dtype, device=self.device)
        self._bases[id(bucket)] = base
        bucket.buffer = base[:numel]
        return bucket.buffer

    def _shard_grad(self) -> Tensor:
        """The shard gradient to read: zeros where no reduction wrote yet (none in the window, or a bucket
        not reduced yet when the noise scale reads the gradient so far)."""
        if self.shard_grad is None:
            self.shard_grad = self._storage().zero_()
            self._shard_written = {id(bucket) for bucket in self.buckets}
        base = self.rank * self.shard_numel
        for bucket in self.buckets:
            if id(bucket) not in self._shard_written:
                for owner, lo, hi in bucket.owners:
                    if owner == self.rank:
                        self.shard_grad[lo - base : hi - base].zero_()
                self._shard_written.add(id(bucket))
        return self.shard_grad

    def _summed_shard_grad(self) -> Tensor:
        """The shard gradient as the replicas' sum, to add a reduction to: a window reduced before its step
        (manual optimization clipped, then ran another backward) turns back into a sum first."""
        if self.shard_grad is None:  # the window's first reduction: each bucket's first one writes its part
            self.shard_grad = self._storage()
            self._shard_written = set()
        grad = self.shard_grad
        if self.averaged:
            grad.mul_(self.world)
            self.averaged = False
        return grad

    def _storage(self) -> Tensor:
        """Storage for a window's shard gradient, not zeroed: the last window's (stepped and let go) when kept."""
        spare, self._spare = self._spare, None
        return spare if spare is not None else torch.empty(self.shard_numel, dtype=self.dtype, device=self.device)

    def reduce(self, shard: nn.Parameter) -> None:
        # every bucket was reduced at the window's backward boundaries (the queue's owner made sure)
        grad = self._shard_grad()
        if not self.averaged:
            grad.div_(self.world)  # in place
            self.averaged = True
        shard.grad = grad

    @torch.no_grad()
    def after_step(self, shard: nn.Parameter) -> None:
        # let go, not zeroed: the next window's first reductions overwrite it (``_shard_written``); storage parked
        # by a zero_grad between the reduction and the step (``clear``) stays parked
        if self.shard_grad is not None:
            self._spare = self.shard_grad
        self.shard_grad, self.averaged = None, False
        super().after_step(shard)

    def local_gradients(self) -> list[Tensor]:
        grad = self._shard_grad()
        return [grad if self.averaged else grad / self.world]  # the replicas' mean so far (disjoint shards)

    def clear(self) -> None:
        # what was already reduced lives in the shard gradients of every rank (each its own slice): discarded
        # on every rank alike, since zero_grad is called on every rank
        if self.shard_grad is not None:
            self._spare = self.shard_grad
        self.shard_grad, self.averaged = None, False
        for bucket in self.buckets:
            bucket.buffer, bucket.arrived, bucket.written = None, set(), set()
        self._bases.clear()
        super().clear()
