"""ZeRO-1/2 gradients: where they live and how they reach each rank's shard, without full copies.

- ZeRO-1 (:class:`FlatGradients`): one persistent flat gradient buffer per flat group; a parameter's
  first gradient of the window is added into its part of it and ``.grad`` becomes that view (as DDP's
  ``gradient_as_bucket_view``), so the window's later micro-batches accumulate in place; the window's last
  backward reduces it bucket by bucket to the ranks whose shards each covers (a reduce-scatter).
- ZeRO-2, ``reduce_gradients="every_microbatch"`` (``bucket_gradients.BucketGradients``, DeepSpeed's choice): each
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
from lightning_hybrid.strategies.zero.collectives import reduce_to_owners

__all__ = ["FlatGradients", "GroupGradients", "WindowGradients"]


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
        names: list[str],
    ) -> None:
        self.params, self.offsets, self.padded, self.names = params, offsets, padded, names
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

    def _refuse_graph(self, index: int) -> None:
        """Called when autograd accumulated a parameter's gradient: a backward with ``create_graph=True``
        (grad mode on inside it) accumulates out of place (``.grad`` becomes a new tensor holding the earlier
        gradient too) and keeps a graph a flat buffer cannot: refused, on every rank alike (each runs the same
        backward)."""
        if torch.is_grad_enabled():
            raise RuntimeError(
                f"backward(create_graph=True) reached {self.names[index]}: ZeRO-1/2 move gradients into flat"
                " buffers, which keep no graph (and an out-of-place"
                " accumulation would count an earlier micro-batch twice). For a gradient penalty use"
                " torch.autograd.grad(..., create_graph=True), which does not accumulate into .grad; for"
                " second-order training use zero_stage=0 or 3."
            )

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
    def _absorb(self, flat: Tensor) -> None:
        """Add every gradient that is not a view of ``flat`` (a schedule that accumulated weight gradients
        itself) into it and make it a view. ``None`` only unlinks a gradient (Lightning's ``zero_grad`` between
        a pipeline's backward and its own): the buffer keeps what accumulated."""
        for i, p in enumerate(self.params):
            segment = self.segment(flat, i)
            if p.grad is not None and p.grad.data_ptr() != segment.data_ptr():
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
        param.register_post_accumulate_grad_hook(lambda _, i=index: self._refuse_graph(i))

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
    """ZeRO-1: a persistent flat gradient buffer; ``param.grad`` are its views while the window accumulates.
    The window's last backward reduces it to the shards' owners bucket by bucket in the queue's order as
    backward completes each (``queue.armed``); a window closed otherwise (manual optimization, a pipeline's
    schedule) is reduced when the step needs it. Then each rank holds the replicas' mean of its own shard only
    (what it steps), so ``param.grad`` is unlinked (as under ZeRO-2): the rest of the buffer holds this rank's
    own sums. A reduce-scatter and the parameters' all-gather move what DDP's one all-reduce moves."""

    def __init__(self, *args: Any, bucket_numel: int, queue: BucketQueue, **kwargs: Any) -> None:
        self.flat = torch.zeros(args[2], dtype=kwargs["dtype"], device=kwargs["device"])
        self.queue = queue
        world = dist.get_world_size(kwargs["group"])
        self.buckets = bucket_ranges(args[0], args[1], args[2], bucket_numel, shard_numel=args[2] // world)
        self._bucket_of = [b for b, bucket in enumerate(self.buckets) for _ in bucket.members]
        self._dirty = False  # the buffer holds something since it was last zeroed
        self._reduced = False  # reduced, not stepped yet: this rank's shard holds the mean, the rest its own sums
        super().__init__(*args, **kwargs)
        queue.add(self, self.buckets)

    def _buffer(self) -> Tensor:
        self._dirty = True
        return self.flat

    def _hook(self, index: int, param: nn.Parameter) -> None:
        # one hook, after autograd accumulated: the window's first gradient (autograd's own tensor) is added
        # into the buffer and .grad becomes its view, so the window's later micro-batches accumulate in place
        param.register_post_accumulate_grad_hook(functools.partial(self._accumulated, index))

    def _accumulated(self, index: int, param: Tensor) -> None:
        self._refuse_graph(index)
        bucket = self.buckets[self._bucket_of[index]]
        if self.queue.armed and bucket.started:  # reduced or being reduced: this part would be added to the mean
            self.queue.late = self.queue.late or self.names[index]
            return
        self._reopen()
        segment, grad = self.segment(self._buffer(), index), self.params[index].grad
        if grad is not None and grad.data_ptr() != segment.data_ptr():
            with torch.no_grad():
                segment.add_(grad.reshape(-1))
            self.params[index].grad = segment.view_as(grad)
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
            p, segment = self.params[i], self.segment(self._buffer(), i)
            if p.grad is not None and p.grad.data_ptr() != segment.data_ptr():
                segment.add_(p.grad.reshape(-1))
                p.grad = segment.view_as(p)
        pending = reduce_to_owners(self.flat, bucket.owners, self.group)
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
        elif not any(bucket.started for bucket in self.buckets) and self._strays(self.flat):
            self._reopen()
            self._absorb(self._buffer())

    @torch.no_grad()
    def _reopen(self) -> None:
        """Gradients arrive after the window was reduced and before its step (manual optimization clipped, then
        ran another backward): the buffer becomes a sum again, so that reducing it once more adds the new
        gradients to what was reduced (and clipped) before, exactly: this rank's shard back to the replicas'
        sum, the rest (this rank's own sums, already counted) zero."""
        if not self._reduced:
            return
        self._reduced = False
        own = self._shard_slice()
        self.flat[own].mul_(self.world)
        self.flat[: own.start].zero_()
        self.flat[own.stop :].zero_()

    @torch.no_grad()
    def reduce(self, shard: nn.Parameter) -> None:
        self._reopen()
        self._absorb(self._buffer())
        if not all(bucket.started for bucket in self.buckets):  # not reduced during backward
            s = self.shard_numel
            reduce_to_owners(self.flat, [(r, r * s, (r + 1) * s) for r in range(self.world)], self.group).wait()
            self.flat[self._shard_slice()].div_(self.world)
        for bucket in self.buckets:
            bucket.started = False
        shard.grad = self.flat[self._shard_slice()]
        for p in self.params:  # the buffer outside this rank's shard holds its own sums, not the mean
            p.grad = None
        self._reduced = True

    @torch.no_grad()
    def after_step(self, shard: nn.Parameter) -> None:
        self._zero()
        for p in self.params:
            p.grad = None
        super().after_step(shard)

    @torch.no_grad()
    def clear(self) -> None:
        self._zero()
        for bucket in self.buckets:
            bucket.arrived, bucket.started = set(), False
        super().clear()

    def _zero(self) -> None:
        self._reduced = False
        if self._dirty:  # zeroed at the step's end, and Lightning's zero_grad follows: once is enough
            self.flat.zero_()
            self._dirty = False


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
            self._absorb(self.flat)

    @torch.no_grad()
    def reduce(self, shard: nn.Parameter) -> None:
        if self.flat is None:  # no gradient through the hooks in this window
            self.flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        self._absorb(self.flat)
        # each rank's slice reduced to it (a reduce-scatter), then only this rank's slice is kept
        s = self.shard_numel
        reduce_to_owners(self.flat, [(r, r * s, (r + 1) * s) for r in range(self.world)], self.group).wait()
        mean = self.flat[self._shard_slice()].div_(self.world)
        # reduced before in this window (manual optimization clipped, then ran another backward): added to it
        shard.grad = mean.clone() if shard.grad is None else shard.grad.add_(mean)
        for p in self.params:
            p.grad = None
        self.flat = None  # the full gradient is gone before the step

    def clear(self) -> None:
        self.flat = None
        super().clear()
